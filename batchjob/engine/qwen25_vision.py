"""Qwen2.5-VL's vision tower on the engine's hot path: the window-index fix and packed window attention.

Two things differ from running mlx-vlm's `VisionModel.__call__` (0.7.10) as it is:

- **Window index patch.** `get_window_index` pads each frame's merged-patch grid by a whole window even when
  its side is already a multiple of the window, so its `cu_window_seqlens` repeats boundaries (zero-length
  windows: 72 of 200 at 16 frames 448x448). `__call__` tries to drop repeats but compares MLX scalars by
  identity, which never matches. Zero-length windows are harmless on CPU and Metal but MLX CUDA's SDPA fails
  on an empty query (see docs/upstream.md). `patch_window_index` wraps the tower's method at load so repeated
  boundaries are dropped; on CPU that is bit-identical (an empty window contributes nothing).
- **Packed attention.** mlx-vlm splits q/k/v on `cu_seqlens.tolist()` in every layer (a host sync per layer)
  and runs one SDPA per window. Here the split is planned once per tower call: windows of equal length (all
  of them, for sizes that are multiples of 112 pixels) run as one batched SDPA call, and uneven leftovers run
  as one call per distinct length. No layer touches the host.

Model-family knowledge for Qwen2.5-VL's tower only; Qwen2-VL keeps mlx-vlm's own tower forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_PATCHED = "_batchjob_window_index_patched"


def drop_repeated_boundaries(cu_seqlens: np.ndarray) -> np.ndarray:
    """Cumulative boundaries with repeats removed (no zero-length segments); the input must be non-decreasing."""
    cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
    if cu.size and np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    if cu.size == 0:
        return cu
    keep = np.concatenate([[True], np.diff(cu) > 0])
    return cu[keep]


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


@dataclass(frozen=True)
class SegmentGroup:
    """`count` segments of `length` tokens each; `gather` picks their tokens (None: contiguous, in order)."""

    length: int
    count: int
    gather: mx.array | None


@dataclass(frozen=True)
class SegmentPlan:
    """How one attention pattern over a packed token axis runs as few SDPA calls as possible."""

    groups: tuple[SegmentGroup, ...]
    restore: mx.array | None  # permutation back to token order after concatenating the groups; None = identity


def segment_plan(cu_seqlens: np.ndarray) -> SegmentPlan:
    """Group the segments `[cu[i], cu[i+1])` by length; empty segments are skipped (nothing to attend)."""
    cu = drop_repeated_boundaries(cu_seqlens)
    lengths = np.diff(cu)
    if lengths.size == 0:
        return SegmentPlan((), None)
    if np.all(lengths == lengths[0]):
        return SegmentPlan((SegmentGroup(int(lengths[0]), int(lengths.size), None),), None)
    groups, order = [], []
    for length in np.unique(lengths):
        starts = cu[:-1][lengths == length]
        tokens = (starts[:, None] + np.arange(length)[None, :]).reshape(-1)
        groups.append(SegmentGroup(int(length), int(starts.size), mx.array(tokens.astype(np.int32))))
        order.append(tokens)
    restore = np.argsort(np.concatenate(order), kind="stable").astype(np.int32)
    return SegmentPlan(tuple(groups), mx.array(restore))


def packed_attention(attn: nn.Module, x: mx.array, plan: SegmentPlan, rotary: mx.array) -> mx.array:
    """mlx-vlm's vision `Attention` (same weights, same math) with the segments of `plan`, no host sync."""
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    tokens = x.shape[0]
    heads, head_dim = attn.num_heads, attn.head_dim
    qkv = attn.qkv(x).reshape(tokens, 3, heads, head_dim)
    q = apply_rope(qkv[:, 0][None], rotary)[0]
    k = apply_rope(qkv[:, 1][None], rotary)[0]
    v = qkv[:, 2]
    outs = []
    for g in plan.groups:
        parts = [t if g.gather is None else t[g.gather] for t in (q, k, v)]
        qg, kg, vg = (t.reshape(g.count, g.length, heads, head_dim).transpose(0, 2, 1, 3) for t in parts)
        o = mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=attn.scale, mask=None)
        outs.append(o.transpose(0, 2, 1, 3).reshape(g.count * g.length, heads * head_dim))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if plan.restore is not None:
        out = out[plan.restore]
    return attn.proj(out)


def frame_boundaries(grid_thw: list[tuple[int, int, int]]) -> np.ndarray:
    """Full-attention segments: one per temporal patch of each clip (`h * w` patches each)."""
    sizes = [h * w for t, h, w in grid_thw for _ in range(t)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


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
    rotary = rotary.reshape(seq // unit, unit, -1)[index].reshape(seq, -1)
    windows = segment_plan(np.array(cu_window))
    frames = segment_plan(frame_boundaries(grid_thw))
    full = set(tower.fullatt_block_indexes)
    for i, block in enumerate(tower.blocks):
        plan = frames if i in full else windows
        hidden = hidden + packed_attention(block.attn, block.norm1(hidden), plan, rotary)
        hidden = hidden + block.mlp(block.norm2(hidden))
    hidden = tower.merger(hidden)
    return hidden[mx.array(np.argsort(window_index).astype(np.int32))]
