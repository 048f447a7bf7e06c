"""What a checkpoint occupies in memory, from its config.json alone: the weights as mlx-vlm stores them (bf16, or
quantized to 8 or 4 bits by its converter) and the KV cache per token.

A user picks a model size and a quantization before downloading anything, and a job must be refused at start
when its budget cannot hold the model (metal_backend/memory.py), so this is arithmetic over the config: no MLX,
no weights. The tensor list follows mlx-vlm's module layout (its parameter names and shapes); which tensors get
quantized follows mlx-vlm's converter (`python -m mlx_vlm.convert --quantize --q-bits 4|8`): every Linear,
Embedding and expert stack of the language model whose input width is a multiple of the group size, and nothing
in the vision tower (older converters quantized the tower too: `Quantization(vision=True)`). A quantized weight
is stored packed (bits / 8 bytes per element) with one scale and one bias per group, in the checkpoint's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QUANTIZABLE = ("linear", "embedding", "experts")   # modules with `to_quantized` in MLX / mlx-vlm


@dataclass(frozen=True)
class TensorSpec:
    """One parameter as mlx-vlm names it, and the kind of module that owns it (`QUANTIZABLE` or "other")."""

    name: str
    shape: tuple[int, ...]
    module: str = "other"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def vision(self) -> bool:
        return self.name.startswith("vision_tower.")


@dataclass(frozen=True)
class Quantization:
    """mlx-vlm's affine quantization: `bits` per weight, one scale and one bias per `group_size` inputs."""

    bits: int
    group_size: int = 64
    vision: bool = False  # the vision tower too, as older mlx-vlm converters did (mlx-vlm still loads those)

    def applies_to(self, spec: TensorSpec) -> bool:
        return (spec.module in QUANTIZABLE and spec.name.endswith(".weight") and spec.shape[-1] % self.group_size == 0
                and (self.vision or not spec.vision))


def _linear(name: str, out: int, inp: int, bias: bool) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (out, inp), "linear")]
    return specs + [TensorSpec(f"{name}.bias", (out,))] if bias else specs


def _norm(name: str, width: int, bias: bool = False) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (width,))]
    return specs + [TensorSpec(f"{name}.bias", (width,))] if bias else specs


def text_settings(config: dict) -> dict:
    """The language model's settings: top level for Qwen2.5-VL, `text_config` for Qwen3-VL."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r}: footprints are known for {', '.join(SUPPORTED)}")
    return config["text_config"] if model_type.startswith("qwen3") else config


def _head_dim(text: dict) -> int:
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def _language_tensors(config: dict) -> list[TensorSpec]:
    text = text_settings(config)
    qwen3 = config["model_type"].startswith("qwen3")
    hidden, vocab, layers = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    heads, kv_heads, head_dim = text["num_attention_heads"], text["num_key_value_heads"], _head_dim(text)
    qkv_bias = bool(text.get("attention_bias", False)) if qwen3 else True   # Qwen2.5: q/k/v biases, no o bias
    # mlx-vlm's defaults when the key is absent (real configs always set it)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", not qwen3))
    experts = int(text.get("num_experts", 0)) if config["model_type"] == "qwen3_vl_moe" else 0
    dense_layers, sparse_step = set(text.get("mlp_only_layers") or []), int(text.get("decoder_sparse_step", 1))
    specs = [TensorSpec("language_model.model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for i in range(layers):
        p = f"language_model.model.layers.{i}"
        specs += _linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, qkv_bias)
        specs += _linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias)
        specs += _linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias)
        specs += _linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, qwen3 and qkv_bias)
        if qwen3:
            specs += _norm(f"{p}.self_attn.q_norm", head_dim) + _norm(f"{p}.self_attn.k_norm", head_dim)
        specs += _norm(f"{p}.input_layernorm", hidden) + _norm(f"{p}.post_attention_layernorm", hidden)
        if experts and i not in dense_layers and (i + 1) % sparse_step == 0:
            inter = text["moe_intermediate_size"]
            specs += _linear(f"{p}.mlp.gate", experts, hidden, False)
            specs += [TensorSpec(f"{p}.mlp.switch_mlp.gate_proj.weight", (experts, inter, hidden), "experts"),
                      TensorSpec(f"{p}.mlp.switch_mlp.up_proj.weight", (experts, inter, hidden), "experts"),
                      TensorSpec(f"{p}.mlp.switch_mlp.down_proj.weight", (experts, hidden, inter), "experts")]
        else:
            inter = text["intermediate_size"]
            specs += (_linear(f"{p}.mlp.gate_proj", inter, hidden, False)
                      + _linear(f"{p}.mlp.up_proj", inter, hidden, False)
                      + _linear(f"{p}.mlp.down_proj", hidden, inter, False))
    specs += _norm("language_model.model.norm", hidden)
    return specs if tied else specs + _linear("language_model.lm_head", vocab, hidden, False)


def _vision_tensors(config: dict) -> list[TensorSpec]:
    vision = config["vision_config"]
    qwen3 = config["model_type"].startswith("qwen3")
    width, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    merged = width * vision.get("spatial_merge_size", 2) ** 2
    out = vision.get("out_hidden_size") or text_settings(config)["hidden_size"]
    patch = (width, vision.get("temporal_patch_size", 2), vision["patch_size"], vision["patch_size"],
             vision.get("in_channels", vision.get("in_chans", 3)))
    specs = [TensorSpec("vision_tower.patch_embed.proj.weight", patch)]
    if qwen3:   # patch embedding with a bias, learned position table, LayerNorms with biases
        specs += [TensorSpec("vision_tower.patch_embed.proj.bias", (width,)),
                  TensorSpec("vision_tower.pos_embed.weight", (vision["num_position_embeddings"], width), "embedding")]
    for i in range(depth):
        p = f"vision_tower.blocks.{i}"
        specs += _norm(f"{p}.norm1", width, qwen3) + _norm(f"{p}.norm2", width, qwen3)
        specs += _linear(f"{p}.attn.qkv", 3 * width, width, True) + _linear(f"{p}.attn.proj", width, width, True)
        if qwen3:
            specs += _linear(f"{p}.mlp.linear_fc1", inter, width, True)
            specs += _linear(f"{p}.mlp.linear_fc2", width, inter, True)
        else:
            specs += _linear(f"{p}.mlp.gate_proj", inter, width, True) + _linear(f"{p}.mlp.up_proj", inter, width, True)
            specs += _linear(f"{p}.mlp.down_proj", width, inter, True)
    if not qwen3:
        return specs + (_norm("vision_tower.merger.ln_q", width)
                        + _linear("vision_tower.merger.mlp.0", merged, merged, True)
                        + _linear("vision_tower.merger.mlp.2", out, merged, True))
    mergers = [("vision_tower.merger", width)] + [(f"vision_tower.deepstack_merger_list.{i}", merged)
                                                   for i in range(len(vision.get("deepstack_visual_indexes") or []))]
    for name, norm_width in mergers:   # DeepStack mergers normalise after the 2x2 shuffle
        specs += (_norm(f"{name}.norm", norm_width, True) + _linear(f"{name}.linear_fc1", merged, merged, True)
                  + _linear(f"{name}.linear_fc2", out, merged, True))
    return specs


def checkpoint_tensors(config: dict) -> list[TensorSpec]:
    """Every parameter of the checkpoint `config` describes, as mlx-vlm names and shapes it."""
    return _language_tensors(config) + _vision_tensors(config)


def stored_tensors(config: dict, quantization: Quantization | None = None, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of each tensor an mlx-vlm conversion writes (quantized weights as packed weight, scales, biases)."""
    stored: dict[str, int] = {}
    for spec in checkpoint_tensors(config):
        if quantization is None or not quantization.applies_to(spec):
            stored[spec.name] = spec.size * dtype_bytes
            continue
        prefix = spec.name[:-len(".weight")]
        groups = spec.size // quantization.group_size
        stored[spec.name] = spec.size * quantization.bits // 8
        stored[f"{prefix}.scales"] = stored[f"{prefix}.biases"] = groups * dtype_bytes
    return stored


def _engine_padding_bytes(config: dict, quantization: Quantization | None, dtype_bytes: int) -> int:
    """What the engine adds at load by widening unquantized vision MLPs to the GEMM tile (engine/vision_mlp.py)."""
    from .vision_mlp import GEMM_TILE

    vision = config["vision_config"]
    width, inter = vision["hidden_size"], vision["intermediate_size"]
    pad = -(-inter // GEMM_TILE) * GEMM_TILE - inter
    parts = [TensorSpec("vision_tower.mlp.weight", (inter, width), "linear"),
             TensorSpec("vision_tower.mlp.weight", (width, inter), "linear")]
    if not pad or (quantization is not None and any(map(quantization.applies_to, parts))):
        return 0   # aligned already, or a quantized part: the engine leaves such an MLP as it is
    if config["model_type"].startswith("qwen3"):
        per_block = pad * (2 * width + 1)          # fc1 rows + bias, fc2 columns
    else:
        per_block = pad * (3 * width + 2)          # gate and up rows + biases, down columns
    return vision["depth"] * per_block * dtype_bytes


def weights_bytes(config: dict, quantization: Quantization | None = None, dtype_bytes: int = 2, *,
                  engine: bool = False) -> int:
    """The checkpoint's weights in bytes; with `engine`, as the engine holds them after loading (what it counts
    against the memory budget): floating tensors in the engine's dtype, vision MLPs padded to the GEMM tile."""
    total = sum(stored_tensors(config, quantization, dtype_bytes).values())
    return total + (_engine_padding_bytes(config, quantization, dtype_bytes) if engine else 0)


def parameter_counts(config: dict) -> tuple[int, int]:
    """(language model, vision tower) parameter counts."""
    specs = checkpoint_tensors(config)
    vision = sum(s.size for s in specs if s.vision)
    return sum(s.size for s in specs) - vision, vision


def kv_layout(config: dict) -> tuple[int, int, int]:
    """(decoder layers, KV heads, head_dim): the shape of the KV cache per token."""
    text = text_settings(config)
    return text["num_hidden_layers"], text["num_key_value_heads"], _head_dim(text)


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token over every decoder layer."""
    return 2 * math.prod(kv_layout(config)) * dtype_bytes
