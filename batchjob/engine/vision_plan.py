"""What a Qwen-VL vision tower needs besides its weights, planned once per clip shape, and the block loop that
uses it: no host sync per call, no per-frame or per-window Python work.

mlx-vlm's towers (0.7.10) rebuild positions, rotary tables, window indices and position-embedding
interpolation on every call, with `.tolist()` / `.item()` / `np.where` on device arrays in between (each one
waits for the GPU) and small per-frame graphs. All of it depends only on the clip's grid `(t, h, w)` and the
tower's settings, and a job's clips mostly share one grid, so here it is computed on the host in numpy (pure
functions, tested against mlx-vlm's own), uploaded once and kept per grid on the tower (`cached_plan`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .vision_attention import RopeTables, SegmentPlan, drop_repeated_boundaries, packed_attention, rope_tables

Grid = tuple[tuple[int, int, int], ...]
PLANS_PER_TOWER = 16  # grids kept per tower (a job's clips mostly share one)
_CACHE = "_batchjob_plans"


def as_grid(grid_thw: Sequence[Sequence[int]]) -> Grid:
    return tuple((int(t), int(h), int(w)) for t, h, w in grid_thw)


def cached_plan(tower: nn.Module, key: tuple, build: Callable[[], object]):
    """`build()` once per key and tower (LRU of PLANS_PER_TOWER); stored beside the module's parameters."""
    cache = getattr(tower, _CACHE, None)
    if cache is None:
        cache = OrderedDict()
        object.__setattr__(tower, _CACHE, cache)   # a plain attribute: not a parameter or a child module
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = build()
    while len(cache) > PLANS_PER_TOWER:
        cache.popitem(last=False)
    return value


def merge_block_positions(grid: Grid, merge: int) -> np.ndarray:
    """`[patches, 2]` (row, col) of every patch in the towers' token order: clip by clip, frame by frame, merge
    block by merge block (row-major), then within the block (row-major) -- the order pixel rows arrive in."""
    out = []
    for t, h, w in grid:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = [a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
                  for a in (rows, cols)]
        out.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def rotary_tables(positions: np.ndarray, rotary: nn.Module, head_dim: int | None = None) -> RopeTables:
    """cos/sin tables of the towers' 2-D rotary embedding for patches at `positions` ([n, 2] rows, cols).

    Same arithmetic as mlx-vlm's `VisionRotaryEmbedding` (`rotary.dim`, `rotary.theta`; a table
    `outer(arange, inv_freq)` gathered by row and by column): one product per entry, so a position times
    the inverse frequency equals the gathered table entry exactly. `head_dim`: the attention's head size where
    its rotary halves were padded (vision_heads.py): zero frequencies fill each half."""
    dim, theta = rotary.dim, rotary.theta
    inv_freq = 1.0 / (theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    pos = mx.array(positions.astype(np.float32))
    freqs = (pos[:, :, None] * inv_freq[None, None, :]).reshape(positions.shape[0], -1)
    if head_dim is not None and head_dim // 2 > freqs.shape[-1]:
        freqs = mx.pad(freqs, [(0, 0), (0, head_dim // 2 - freqs.shape[-1])])
    return rope_tables(freqs)


def window_order(grid: Grid, window: int, merge: int, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window partition: (merge units in window order `[patches / merge**2]`, window boundaries
    over patches without repeats). mlx-vlm's `get_window_index` computes the same with device ops and host
    syncs, and pads a whole extra window where a side is already a multiple of it (empty windows, dropped)."""
    side = window // merge // patch   # merge units per window side
    unit = merge * merge
    order, cu, base = [], [0], 0
    for t, h, w in grid:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = -lh % side, -lw % side
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (lh + pad_h) // side, (lw + pad_w) // side
        windows = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
        sizes = (windows >= 0).sum(axis=1)
        order.append(windows[windows >= 0] + base)
        cu.extend((np.cumsum(sizes) * unit + cu[-1]).tolist())
        base += t * lh * lw
    return np.concatenate(order).astype(np.int64), drop_repeated_boundaries(np.array(cu))


def interpolation_plan(grid: Grid, side: int) -> tuple[mx.array, mx.array]:
    """Qwen3-VL's learned position embedding (a `side x side` grid) bilinearly resized to each clip's
    `h x w`: (indices `[4, sum h*w]` int32, weights `[4, sum h*w]` fp32) of the four neighbours.

    Device ops as in mlx-vlm's `fast_pos_embed_interpolate` (same `linspace`, floors and products, so the
    weights are the same floats), without its `.tolist()` round trip through the host."""
    indices, weights = [], []
    for _, h, w in grid:
        h_idx, w_idx = mx.linspace(0, side - 1, h), mx.linspace(0, side - 1, w)
        h_lo, w_lo = h_idx.astype(mx.int32), w_idx.astype(mx.int32)
        h_hi, w_hi = mx.minimum(h_lo + 1, side - 1), mx.minimum(w_lo + 1, side - 1)
        dh, dw = h_idx - h_lo.astype(mx.float32), w_idx - w_lo.astype(mx.float32)
        row_lo, row_hi = h_lo * side, h_hi * side
        corners = [(row_lo, w_lo, (1 - dh), (1 - dw)), (row_lo, w_hi, (1 - dh), dw),
                   (row_hi, w_lo, dh, (1 - dw)), (row_hi, w_hi, dh, dw)]
        indices.append(mx.stack([(r[:, None] + c[None, :]).flatten() for r, c, _, _ in corners]))
        weights.append(mx.stack([(a[:, None] * b[None, :]).flatten() for _, _, a, b in corners]))
    return mx.concatenate(indices, axis=1).astype(mx.int32), mx.concatenate(weights, axis=1)


def interpolated_rows(grid: Grid, merge: int) -> np.ndarray:
    """For every patch in token order, its row in the clip's `[h * w]` interpolated embedding (offset by the
    clip's start when several clips are planned together): mlx-vlm tiles the embedding over frames and
    reorders it into merge blocks, which is this one gather."""
    out, base = [], 0
    for t, h, w in grid:
        pos = merge_block_positions(((t, h, w),), merge)
        out.append(base + pos[:, 0] * w + pos[:, 1])
        base += h * w
    return np.concatenate(out).astype(np.int64)


@dataclass(frozen=True)
class TowerPlan:
    """One clip shape's plan: rotary tables in attention order, the attention segments of each block, and
    the permutations into and out of that order (None: the pixel rows' own order)."""

    rope: RopeTables
    segments: tuple[SegmentPlan, ...]   # one per block
    order: mx.array | None = None       # merge units in attention order (Qwen2.5-VL's windows)
    restore: mx.array | None = None     # merged tokens back to the pixel rows' order


def run_blocks(blocks, hidden: mx.array, plan: TowerPlan, taps: dict[int, Callable] | None = None):
    """The blocks over `hidden` with the plan's segments; `taps[i](hidden)` is collected after block i
    (Qwen3-VL's DeepStack mergers). Returns (hidden, tapped outputs in block order)."""
    tapped = []
    for i, block in enumerate(blocks):
        hidden = hidden + packed_attention(block.attn, block.norm1(hidden), plan.segments[i], plan.rope)
        hidden = hidden + block.mlp(block.norm2(hidden))
        if taps and i in taps:
            tapped.append(taps[i](hidden))
    return hidden, tapped
