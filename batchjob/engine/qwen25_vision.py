"""Qwen2.5-VL's vision tower on the engine's hot path: the window-index fix and packed window attention.

Two things differ from running mlx-vlm's `VisionModel.__call__` (0.7.10) as it is:

- **Window index patch.** `get_window_index` pads each frame's merged-patch grid by a whole window even when
  its side is already a multiple of the window, so its `cu_window_seqlens` repeats boundaries (zero-length
  windows: 72 of 200 at 16 frames 448x448). `__call__` tries to drop repeats but compares MLX scalars by
  identity, which never matches. Zero-length windows are harmless on CPU and Metal but MLX CUDA's SDPA fails
  on an empty query (see docs/upstream.md). `patch_window_index` wraps the tower's method at load so repeated
  boundaries are dropped; on CPU that is bit-identical (an empty window contributes nothing).
- **Packed attention** (`vision_attention.py`): mlx-vlm splits q/k/v on `cu_seqlens.tolist()` in every layer
  (a host sync per layer) and runs one SDPA per window. Here the split is planned once per tower call: windows
  of equal length (all of them, for sizes that are multiples of 112 pixels) run as one batched SDPA call;
  the rotary tables are built once per call and applied to q and k in one fused kernel.
- **Fused MLP** (`vision_mlp.py`): the blocks' gate/up/down linears become one zero-padded matmul pair at
  load (`fix_model` calls `fuse_gated_mlps`), so the intermediate width is a multiple of the GEMM tile.

Model-family knowledge for Qwen2.5-VL's tower only (Qwen2-VL's is in qwen2_vision.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .vision_attention import (drop_repeated_boundaries, frame_boundaries, packed_attention, rope_tables,
                               segment_plan)

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


def encode_qwen25(tower: nn.Module, pixel_values: mx.array, grid_thw: list[tuple[int, int, int]]) -> mx.array:
    """The tower's output `[merged tokens, out_hidden]`, equal to mlx-vlm's `VisionModel.__call__`."""
    patch_window_index(tower)
    grid = mx.array([list(g) for g in grid_thw])
    hidden = tower.patch_embed(pixel_values)
    rotary = tower.rot_pos_emb(grid)
    window_index, cu_window = tower.get_window_index(grid)
    window_index = np.array(window_index).astype(np.int32)
    unit = tower.spatial_merge_unit
    seq = hidden.shape[0]
    index = mx.array(window_index)
    hidden = hidden.reshape(seq // unit, unit, -1)[index].reshape(seq, -1)
    rope = rope_tables(rotary.reshape(seq // unit, unit, -1)[index].reshape(seq, -1))
    windows = segment_plan(np.array(cu_window))
    frames = segment_plan(frame_boundaries(grid_thw))
    full = set(tower.fullatt_block_indexes)
    for i, block in enumerate(tower.blocks):
        plan = frames if i in full else windows
        hidden = hidden + packed_attention(block.attn, block.norm1(hidden), plan, rope)
        hidden = hidden + block.mlp(block.norm2(hidden))
    hidden = tower.merger(hidden)
    return hidden[mx.array(np.argsort(window_index).astype(np.int32))]
