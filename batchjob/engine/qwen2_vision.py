"""Qwen2-VL's vision tower on the engine's hot path: full attention per frame as one packed call.

mlx-vlm's `VisionModel.__call__` (0.7.10) splits q/k/v per frame on `cu_seqlens.tolist()` in every block (a
host sync per block) and rebuilds its rotary positions on every call. The same weights and math run here
with the plan built once per clip shape (`vision_plan.py`): all frames of a clip have the same size, so every
block is one batched SDPA call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .vision_attention import frame_boundaries, segment_plan
from .vision_plan import TowerPlan, as_grid, cached_plan, merge_block_positions, rotary_tables, run_blocks


def plan_qwen2(tower: nn.Module, grid_thw) -> TowerPlan:
    grid = as_grid(grid_thw)

    def build() -> TowerPlan:
        frames = segment_plan(frame_boundaries(grid))
        positions = merge_block_positions(grid, tower.spatial_merge_size)
        return TowerPlan(rope=rotary_tables(positions, tower.rotary_pos_emb), segments=(frames,) * len(tower.blocks))

    return cached_plan(tower, ("qwen2_vl", grid), build)


def encode_qwen2(tower: nn.Module, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
    """The tower's output `[merged tokens, out_hidden]`, equal to mlx-vlm's `VisionModel.__call__`."""
    hidden, _ = run_blocks(tower.blocks, tower.patch_embed(pixel_values), plan_qwen2(tower, grid_thw))
    return tower.merger(hidden)
