"""Qwen2.5-VL's vision tower on the engine's hot path: the window-index fix and packed window attention.

Two things differ from running mlx-vlm's `VisionModel.__call__` (0.7.10) as it is:

- **Window index patch.** `get_window_index` pads each frame's merged-patch grid by a whole window even when
  its side is already a multiple of the window, so its `cu_window_seqlens` repeats boundaries (zero-length
  windows: 72 of 200 at 16 frames 448x448). `__call__` tries to drop repeats but compares MLX scalars by
  identity, which never matches. Zero-length windows are harmless on CPU and Metal but MLX CUDA's SDPA fails
  on an empty query (see docs/upstream.md). `patch_window_index` wraps the tower's method at load so repeated
  boundaries are dropped; on CPU that is bit-identical (an empty window contributes nothing).
- **Packed attention** (`vision_attention.py`): mlx-vlm splits q/k/v on `cu_seqlens.tolist()` in every layer
  (a host sync per layer) and runs one SDPA per window. Here windows of equal length (all of them, for sizes
  that are multiples of 112 pixels) run as one batched SDPA call, and rotary tables are applied to q and k in
  one fused kernel.
- **Planned once per clip shape** (`vision_plan.py`): window order, rotary tables and segment plans come from
  host arithmetic on the grid, cached per grid, where mlx-vlm recomputes them with host syncs on every call;
  the patch embedding is one matmul (`patch_embed.py`).
- **Fused MLP** (`vision_mlp.py`): the blocks' gate/up/down linears become one zero-padded matmul pair at
  load (`fix_model` calls `fuse_gated_mlps`), so the intermediate width is a multiple of the GEMM tile.

Model-family knowledge for Qwen2.5-VL's tower only (Qwen2-VL's is in qwen2_vision.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .vision_attention import drop_repeated_boundaries, frame_boundaries, segment_plan
from .vision_plan import TowerPlan, as_grid, cached_plan, merge_block_positions, rotary_tables, run_blocks, window_order

_PATCHED = "_batchjob_window_index_patched"


def patch_window_index(tower: nn.Module) -> None:
    """Make `tower.get_window_index` return boundaries without repeats (idempotent, this instance only)."""
    if getattr(tower, _PATCHED, False):
        return
    original = tower.get_window_index

    def get_window_index(grid_thw):
        window_index, cu_window_seqlens = original(grid_thw)
        return window_index, mx.array(drop_repeated_boundaries(np.array(cu_window_seqlens)).astype(np.int32))

    object.__setattr__(tower, "get_window_index", get_window_index)
    object.__setattr__(tower, _PATCHED, True)


def plan_qwen25(tower: nn.Module, grid_thw) -> TowerPlan:
    """The tower's plan for this clip shape (built on the first clip of the shape, then reused)."""
    grid = as_grid(grid_thw)

    def build() -> TowerPlan:
        merge = tower.spatial_merge_size
        unit = merge * merge
        order, cu_window = window_order(grid, tower.window_size, merge, tower.patch_size)
        positions = merge_block_positions(grid, merge)
        positions = positions.reshape(-1, unit, 2)[order].reshape(-1, 2)   # patches in window order
        windows, frames = segment_plan(cu_window), segment_plan(frame_boundaries(grid))
        full = set(tower.fullatt_block_indexes)
        return TowerPlan(rope=rotary_tables(positions, tower.rotary_pos_emb),
                         segments=tuple(frames if i in full else windows for i in range(len(tower.blocks))),
                         order=mx.array(order.astype(np.int32)),
                         restore=mx.array(np.argsort(order).astype(np.int32)))

    return cached_plan(tower, ("qwen2_5_vl", grid), build)


def encode_qwen25(tower: nn.Module, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
    """The tower's output `[merged tokens, out_hidden]`, equal to mlx-vlm's `VisionModel.__call__`."""
    plan = plan_qwen25(tower, grid_thw)
    hidden = tower.patch_embed(pixel_values)
    unit = tower.spatial_merge_unit
    seq = hidden.shape[0]
    hidden = hidden.reshape(seq // unit, unit, -1)[plan.order].reshape(seq, -1)
    hidden, _ = run_blocks(tower.blocks, hidden, plan)
    return tower.merger(hidden)[plan.restore]
