"""Qwen2-VL's vision tower on the engine's hot path: full attention per frame as one packed call.

mlx-vlm's `VisionModel.__call__` (0.7.10) splits q/k/v per frame on `cu_seqlens.tolist()` in every block (a
host sync per block). The same weights and math run here with the frame plan built once per tower call
(`vision_attention.py`): all frames of a clip have the same size, so every block is one batched SDPA call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .vision_attention import frame_boundaries, packed_attention, rope_tables, segment_plan


def encode_qwen2(tower: nn.Module, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
    """The tower's output `[merged tokens, out_hidden]`, equal to mlx-vlm's `VisionModel.__call__`."""
    hidden = tower.patch_embed(pixel_values)
    rope = rope_tables(tower.rot_pos_emb(mx.array([list(g) for g in grid_thw])))
    frames = segment_plan(frame_boundaries(grid_thw))
    for block in tower.blocks:
        hidden = hidden + packed_attention(block.attn, block.norm1(hidden), frames, rope)
        hidden = hidden + block.mlp(block.norm2(hidden))
    return tower.merger(hidden)
