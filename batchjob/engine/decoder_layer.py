"""A decoder layer as the engine runs it.

mlx-vlm's Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE layers are the same pre-norm block: `h = x +
attention(norm(x))`, then `h + mlp(norm(h))`. The engine runs that block itself so that each residual add can
be the epilogue of the GEMM that ends its branch (the output projection, the MLP's down projection:
`fused_ops.linear_plus`), rather than a pass of its own over the hidden states; an MLP without a stacked
down projection (MoE experts) keeps the separate add.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .vision_mlp import FusedGatedMLP


def run_layer(layer: nn.Module, x: mx.array, position_embeddings) -> mx.array:
    """The layer's output for hidden states `x` `[1, T, hidden]` (the attention must be the engine's
    `PagedAttention`, which takes the residual)."""
    h = layer.self_attn(layer.input_layernorm(x), position_embeddings=position_embeddings, residual=x)
    normed = layer.post_attention_layernorm(h)
    if isinstance(layer.mlp, FusedGatedMLP):
        return layer.mlp(normed, residual=h)
    return h + layer.mlp(normed)
