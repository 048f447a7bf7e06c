"""FLOPs of the work the benchmarks time (multiply-adds x 2): the numerators of every MFU figure.

Shapes are the `dims` dicts of `batchjob.synthetic.random_engine` (QWEN25_VL_7B, QWEN3_VL_8B, ...). Only useful
work counts: the weights' real widths (not the GEMM-tile padding the engine adds), causal attention over the
positions a query sees, windowed attention over its window.
"""
from __future__ import annotations


def head_dim(d: dict) -> int:
    return d.get("head_dim") or d["hidden"] // d["heads"]


def lm_linear_flops_per_token(d: dict) -> float:
    """One decoder layer's projections and MLP for one token."""
    q_width, kv_width = d["heads"] * head_dim(d), d["kv_heads"] * head_dim(d)
    params = d["hidden"] * q_width * 2 + d["hidden"] * kv_width * 2 + 3 * d["hidden"] * d["inter"]
    return 2.0 * params


def lm_attention_flops(q_len: int, cached: int, d: dict) -> float:
    """One layer: QK^T and PV over the visible keys, causal (row j sees cached + j + 1)."""
    visible = q_len * cached + q_len * (q_len + 1) / 2
    return 4.0 * d["heads"] * head_dim(d) * visible


def request_flops(prompt_len: int, cached: int, layers: int, d: dict) -> float:
    q = prompt_len - cached
    return layers * (q * lm_linear_flops_per_token(d) + lm_attention_flops(q, cached, d))


def vision_block_linear_flops(patches: int, model_type: str, d: dict) -> float:
    """qkv, proj and the MLP of one block (Qwen2.5-VL's gated MLP has three matrices, Qwen3-VL's two)."""
    vh, vi = d["v_hidden"], d["v_inter"]
    mlp = 3 if model_type == "qwen2_5_vl" else 2
    return 2.0 * patches * (vh * 3 * vh + vh * vh + mlp * vh * vi)


def vision_flops_per_clip(grid, v_layers: int, model_type: str, d: dict) -> float:
    """The whole tower for one clip of `grid` (t, h, w) patches: patch embedding, blocks, merger(s)."""
    t, h, w = grid
    patches = t * h * w
    vh = d["v_hidden"]
    patch = d.get("patch", 14)
    embed = 2.0 * patches * (3 * 2 * patch * patch) * vh
    merger = 2.0 * (patches // 4) * (4 * vh * 4 * vh + 4 * vh * d["hidden"])
    if model_type == "qwen2_5_vl":
        window = 64  # 112-pixel windows: 8 x 8 patches
        full = sum(1 for i in d["fullatt"] if i < v_layers)
        attention = (v_layers - full) * 4.0 * vh * patches * window + full * 4.0 * vh * patches * (h * w)
        mergers = 1
    else:  # full attention within each temporal patch; a DeepStack merger per tap
        attention = v_layers * 4.0 * vh * patches * (h * w)
        mergers = 1 + sum(1 for i in d["deepstack"] if i < v_layers)
    return v_layers * vision_block_linear_flops(patches, model_type, d) + attention + mergers * merger + embed
