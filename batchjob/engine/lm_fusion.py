"""The decoder's projections as fewer, wider GEMMs: q/k/v as one matmul, gate/up as one.

A Qwen decoder layer runs five matmuls besides its output projection and down projection; k and v are narrow
(num_kv_heads x head_dim, e.g. 512 wide next to a 3,584-wide q), and each re-reads the layer's input. Stacked,
q/k/v are one GEMM of the summed width and gate/up one of twice the intermediate width: the same products,
fewer launches and passes over the activations. The stacking happens once at load (`fix_model`), in place, so
one copy of the weights exists; mlx-vlm's own forward keeps working through row slices of the stacked weight
(`RowSlice`), which the engine never calls.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .vision_mlp import fuse_gated_mlps


class RowSlice(nn.Module):
    """`q_proj` (or k/v) as rows `[start, stop)` of a stacked projection; holds no parameters of its own."""

    def __init__(self, stacked: nn.Linear, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "_stacked", stacked)   # not a child: its weight is counted once, under qkv_proj
        self.start, self.stop = start, stop

    def __call__(self, x: mx.array) -> mx.array:
        stacked = self._stacked
        y = x @ stacked.weight[self.start:self.stop].T
        return y + stacked.bias[self.start:self.stop] if "bias" in stacked else y


def _stack_qkv(attn: nn.Module) -> bool:
    parts = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) is nn.Linear for p in parts) or len({"bias" in p for p in parts}) != 1:
        return False   # quantized, already stacked, or mixed biases: left as mlx-vlm built it
    widths = [p.weight.shape[0] for p in parts]
    stacked = nn.Linear(parts[0].weight.shape[1], sum(widths), bias="bias" in parts[0])
    stacked.weight = mx.concatenate([p.weight for p in parts], axis=0)
    if "bias" in parts[0]:
        stacked.bias = mx.concatenate([p.bias for p in parts], axis=0)
    attn.qkv_proj = stacked
    edges = [0, widths[0], widths[0] + widths[1], sum(widths)]
    for name, start, stop in zip(("q_proj", "k_proj", "v_proj"), edges, edges[1:]):
        setattr(attn, name, RowSlice(stacked, start, stop))
    return True


def fuse_decoder_projections(language_model: nn.Module) -> int:
    """Stack every decoder layer's q/k/v and gate/up projections (idempotent); returns the layers changed.
    MoE layers keep their experts (only dense gated MLPs are stacked)."""
    changed = 0
    for layer in language_model.model.layers:
        attn = getattr(layer.self_attn, "inner", layer.self_attn)
        stacked = _stack_qkv(attn)
        fused = fuse_gated_mlps([layer]) > 0
        if stacked or fused:   # materialise layer by layer: the unstacked weights are freed as we go
            mx.eval(attn.parameters(), layer.mlp.parameters())
            changed += 1
    return changed
