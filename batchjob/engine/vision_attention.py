"""Packed attention for the Qwen2-VL-family vision towers: a segment plan built once per tower call.

mlx-vlm's vision attention (Qwen2-VL and Qwen2.5-VL alike) splits q/k/v on `cu_seqlens.tolist()` in every
layer, a host sync per layer, and runs one SDPA per segment (a frame, or a window). Here the segments are
grouped by length once per tower call: segments of equal length run as one batched SDPA call (all windows of
a clip whose sides are multiples of the window; all frames of a clip), other lengths one call each, then one
permutation restores token order. Empty segments are dropped (MLX CUDA's SDPA fails on an empty query).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cuda_fused import active as active_fused_kernels
from .fused_ops import RotaryTables, pairs_suit, rope_pairs, rotate_half_rope
from .vision_rope import vision_rope_suits


def drop_repeated_boundaries(cu_seqlens: np.ndarray) -> np.ndarray:
    """Cumulative boundaries with repeats removed (no zero-length segments); the input must be non-decreasing."""
    cu = np.asarray(cu_seqlens).astype(np.int64).reshape(-1)
    if cu.size and np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    if cu.size == 0:
        return cu
    keep = np.concatenate([[True], np.diff(cu) > 0])
    return cu[keep]


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


@dataclass(frozen=True)
class RopeTables:
    """The vision rotary embedding's cos/sin, `[tokens, 1, 1, head_dim]` in fp32: built once per clip shape
    (mlx-vlm recomputes them, and tiles them, for q and for k in every block)."""

    cos: mx.array
    sin: mx.array
    pairs: RotaryTables | None = None   # the same split for `rope_pairs`, where that form is the faster one
    halves: tuple[mx.array, mx.array] | None = None   # cos, sin `[tokens, head_dim / 2]` in fp32 (vision_rope.py)


def rope_tables(freqs: mx.array) -> RopeTables:
    """From the tower's `rot_pos_emb` output `[tokens, head_dim / 2]` (the halves repeat, as in mlx-vlm)."""
    def table(x):
        return mx.concatenate([x, x], axis=-1)[:, None, None, :]

    c, s = mx.cos(freqs), mx.sin(freqs)
    cos, sin = table(c), table(s)
    halves = (c.astype(mx.float32), s.astype(mx.float32))
    if not pairs_suit(cos.shape[-1]):
        return RopeTables(cos, sin, halves=halves)
    # the halves repeat by construction: one cos half serves both (a smaller table to read in every block)
    return RopeTables(cos, sin, RotaryTables(c[:, None, None, None, :], mx.stack([-s, s], axis=-2)[:, None, None]),
                      halves=halves)


def rotated_qkv(qkv: mx.array, heads: int, head_dim: int, rope: RopeTables) -> tuple[mx.array, mx.array, mx.array]:
    """q and k rotated, and v, from the stacked projection's output `[tokens, 3 * heads * head_dim]`, each
    `[tokens, heads, head_dim]` (views of one rotated array and of the projection)."""
    tokens = qkv.shape[0]
    kernel = active_fused_kernels().vision_rope
    if kernel is not None and rope.halves is not None and vision_rope_suits(qkv.dtype, head_dim):   # one CUDA kernel
        qk = kernel(qkv, heads, head_dim, *rope.halves)
    elif rope.pairs is not None:
        qk = rope_pairs(qkv.reshape(tokens, 3, heads, 2, head_dim // 2)[:, :2], rope.pairs)
        qk = qk.reshape(tokens, 2, heads, head_dim)
    else:
        qk = rotate_half_rope(qkv.reshape(tokens, 3, heads, head_dim)[:, :2], rope.cos, rope.sin)
    return qk[:, 0], qk[:, 1], qkv.reshape(tokens, 3, heads, head_dim)[:, 2]


METAL_FUSED_HEAD_DIMS = (64, 80, 128)   # what MLX's fused Metal SDPA takes (cuDNN takes any multiple of 8)


@functools.cache
def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:   # an MLX build without the metal module
        return False


def _on_metal() -> bool:
    return _metal_available() and mx.default_device().type == mx.gpu


def _fused_sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """SDPA; on Metal a head_dim its fused kernel lacks (Qwen3-VL's 72) is zero-padded to the next one it has,
    as mlx-vlm does (zeros add nothing to q.k, and the padded output columns are dropped)."""
    d = q.shape[-1]
    if _on_metal() and d < METAL_FUSED_HEAD_DIMS[-1] and d not in METAL_FUSED_HEAD_DIMS:
        pad = [(0, 0)] * (q.ndim - 1) + [(0, next(t for t in METAL_FUSED_HEAD_DIMS if t > d) - d)]
        return mx.fast.scaled_dot_product_attention(mx.pad(q, pad), mx.pad(k, pad), mx.pad(v, pad), scale=scale,
                                                    mask=None)[..., :d]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)


def packed_attention(attn: nn.Module, x: mx.array, plan: SegmentPlan, rope: RopeTables | mx.array) -> mx.array:
    """mlx-vlm's vision `Attention` (same weights, same math) with the segments of `plan`, no host sync.

    `rope`: tables from `rope_tables` (build them once per tower call), or the raw rotary frequencies."""
    if not isinstance(rope, RopeTables):
        rope = rope_tables(rope)
    heads, head_dim = attn.num_heads, attn.head_dim
    q, k, v = rotated_qkv(attn.qkv(x), heads, head_dim, rope)
    outs = []
    for g in plan.groups:
        parts = [t if g.gather is None else t[g.gather] for t in (q, k, v)]
        qg, kg, vg = (t.reshape(g.count, g.length, heads, head_dim).transpose(0, 2, 1, 3) for t in parts)
        o = _fused_sdpa(qg, kg, vg, attn.scale)
        outs.append(o.transpose(0, 2, 1, 3).reshape(g.count * g.length, heads * head_dim))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if plan.restore is not None:
        out = out[plan.restore]
    return attn.proj(out)


def rotary_heads(tower: nn.Module) -> tuple[int, int] | None:
    """(heads, head size) of the tower's attention, as its blocks run it (after any padding at load); None for a
    tower without blocks."""
    blocks = getattr(tower, "blocks", None)
    if not blocks:
        return None
    return int(blocks[0].attn.num_heads), int(blocks[0].attn.head_dim)


def frame_boundaries(grid_thw: list[tuple[int, int, int]]) -> np.ndarray:
    """Full-attention segments: one per temporal patch of each clip (`h * w` patches each)."""
    sizes = [h * w for t, h, w in grid_thw for _ in range(t)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
