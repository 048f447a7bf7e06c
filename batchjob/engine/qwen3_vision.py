"""Qwen3-VL's vision tower on the engine's hot path: one planned forward with packed attention and DeepStack.

mlx-vlm's `VisionModel.__call__` (0.7.10) interpolates the learned position embedding with `.tolist()` round
trips through the host, rebuilds rotary positions per call (`.item()`), and splits q/k/v per frame on
`cu_seqlens.tolist()` in every block, one SDPA per frame. Here the same weights and math run with the plan
built once per clip shape (`vision_plan.py`): every block is one SDPA call over all frames of the clip, the
interpolation weights are device arrays kept per grid, and the DeepStack mergers tap the blocks named by
`deepstack_visual_indexes`. Its two GELU variants are the ones `families/qwen3.fix_model` sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .vision_attention import frame_boundaries, segment_plan
from .vision_plan import (TowerPlan, as_grid, cached_plan, interpolated_rows, interpolation_plan,
                          merge_block_positions, rotary_tables, run_blocks)


@dataclass(frozen=True)
class Qwen3Plan:
    blocks: TowerPlan
    pos_indices: mx.array   # int32 [4, sum h*w]: the four neighbours in the learned position grid
    pos_weights: mx.array   # fp32 [4, sum h*w]: their bilinear weights
    pos_rows: mx.array      # int32 [patches]: each patch's row of the interpolated embedding


def plan_qwen3(tower: nn.Module, grid_thw) -> Qwen3Plan:
    grid = as_grid(grid_thw)

    def build() -> Qwen3Plan:
        merge = tower.spatial_merge_size
        frames = segment_plan(frame_boundaries(grid))
        blocks = TowerPlan(rope=rotary_tables(merge_block_positions(grid, merge), tower.rotary_pos_emb,
                                              tower.blocks[0].attn.head_dim),   # padded heads: vision_heads.py
                           segments=(frames,) * len(tower.blocks))
        indices, weights = interpolation_plan(grid, tower.num_grid_per_side)
        return Qwen3Plan(blocks, indices, weights, mx.array(interpolated_rows(grid, merge).astype(np.int32)))

    return cached_plan(tower, ("qwen3_vl", grid), build)


def position_embedding(tower: nn.Module, plan: Qwen3Plan) -> mx.array:
    """The learned position embedding, interpolated to the clip and laid out in token order `[patches, C]`."""
    neighbours = tower.pos_embed(plan.pos_indices)   # [4, h*w, C]
    weighted = neighbours * plan.pos_weights.astype(neighbours.dtype)[:, :, None]
    interpolated = weighted[0] + weighted[1] + weighted[2] + weighted[3]
    return interpolated[plan.pos_rows]


def encode_qwen3(tower: nn.Module, pixel_values: mx.array,
                 grid_thw: list[tuple[int, int, int]]) -> tuple[mx.array, list[mx.array]]:
    """(merged features `[merged tokens, out_hidden]`, one DeepStack feature set per tapped block), equal to
    mlx-vlm's `VisionModel.__call__`."""
    plan = plan_qwen3(tower, grid_thw)
    hidden = tower.patch_embed(pixel_values) + position_embedding(tower, plan)
    taps = {layer: tower.deepstack_merger_list[i] for i, layer in enumerate(tower.deepstack_visual_indexes)}
    hidden, deepstack = run_blocks(tower.blocks, hidden, plan.blocks, taps)
    return tower.merger(hidden), deepstack
