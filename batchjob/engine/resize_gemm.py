"""PyTorch's uint8 antialiased bicubic (aa_filter.py), bit for bit, as banded matrix products on BLAS.

Why it is exact: a pass sums pixel x int16-weight products, then adds a rounding constant, shifts and clips.
Every integer below 2**24 is a float32, so a matrix product whose operands are integers (weights scaled
by 2**-precision, which is exact) and whose every possible partial sum stays under that bound is exact
in whatever order BLAS adds. Centring the pixels (x - 128) halves the range of those sums. Where the
bound still fails (precision 17: downscales of about 4x to 8x, e.g. 1080p to 252 rows) each output's
taps are split into two groups, each summed exactly in its own column, and the two are added last: that
addition may round only where the result lies outside [-128, 128), which the clip maps to the same byte
either way. Precisions above 17 (downscales beyond about 8x) run in float64. The floor, clip and
clip-to-uint8 between the passes are PyTorch's.

Why banded blocks: an output reads a window of about 4 x scale inputs, so a dense product would spend
almost all its work on zeros. A block of BLOCK consecutive outputs multiplies only the input span its
taps touch. The horizontal pass reads the frame in strips of STRIP_ROWS rows, each copied once into a
planar float buffer that stays in cache; both passes hold one frame at a time.

Why one BLAS thread: the products are small and many, and decoders already fill the machine's cores one
process each. A multi-threaded BLAS pool beside other busy processes waits for its threads at every call:
on a loaded 2-core machine that made a 16-frame 1080p clip take 40 s instead of a fraction of a second.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .aa_filter import aa_taps, fixed_point

OFFSET = 128               # pixels are centred: x - 128 lies in [-128, 127]
F32_INTEGERS = 1 << 24     # float32 holds every integer up to here
BLOCK = 16                 # outputs per banded block
STRIP_ROWS = 128           # input rows per horizontal strip


@dataclass(frozen=True, eq=False)
class AxisPlan:
    """One axis's pass as banded blocks: block i maps inputs spans[i] to outputs [i*BLOCK, (i+1)*BLOCK)."""

    out_size: int
    precision: int
    groups: int                              # 1, or 2 when one exact sum per output cannot hold the taps
    spans: tuple[tuple[int, int], ...]
    weights: tuple[np.ndarray, ...]          # [span, groups * BLOCK]: int16 weights * 2**-precision
    bias: np.ndarray                         # [blocks, BLOCK]: rounding constant and centring, * 2**-precision

    @property
    def dtype(self) -> np.dtype:
        return self.weights[0].dtype


def _choose_sums(coef: np.ndarray, precision: int, bias: np.ndarray) -> tuple[int, np.ndarray, type]:
    """(groups, group of each tap, dtype) that keep every partial sum exact (see the module docstring)."""
    live = coef != 0
    rank = np.cumsum(live, axis=1) - 1
    magnitude = OFFSET * np.abs(coef)
    if precision <= 17:
        if magnitude.sum(1).max() <= F32_INTEGERS:
            return 1, np.zeros_like(rank), np.float32
        group = rank % 2                      # alternate taps: each group holds about half the weight
        first = np.where(group == 0, magnitude, 0).sum(1) + np.abs(bias)   # the bias joins the first sum
        second = np.where(group == 1, magnitude, 0).sum(1)
        if max(first.max(), second.max()) <= F32_INTEGERS:
            return 2, group, np.float32
    return 1, np.zeros_like(rank), np.float64


@functools.lru_cache(maxsize=64)
def axis_plan(in_size: int, out_size: int) -> AxisPlan:
    index, weight = aa_taps(in_size, out_size)
    coef, precision = fixed_point(weight)
    # floor((sum(x * c) + 2**(p-1)) / 2**p) - 128 = floor((sum((x - 128) * c) + bias) / 2**p)
    bias = OFFSET * (coef.sum(1) - (1 << precision)) + (1 << (precision - 1))
    groups, group, dtype = _choose_sums(coef, precision, bias)
    blocks = -(-out_size // BLOCK)
    outputs, taps = np.nonzero(coef)
    inputs, block = index[outputs, taps], outputs // BLOCK
    lo, hi = np.full(blocks, in_size), np.zeros(blocks, np.int64)
    np.minimum.at(lo, block, inputs)
    np.maximum.at(hi, block, inputs + 1)
    dense = np.zeros((blocks, int((hi - lo).max()), groups * BLOCK))
    np.add.at(dense, (block, inputs - lo[block], group[outputs, taps] * BLOCK + outputs % BLOCK),
              coef[outputs, taps] * 2.0 ** -precision)
    dense = dense.astype(dtype)
    spans = tuple((int(a), int(b)) for a, b in zip(lo, hi))
    weights = tuple(dense[b, :hi[b] - lo[b]] for b in range(blocks))
    padded = np.zeros(blocks * BLOCK)
    padded[:out_size] = bias * 2.0 ** -precision
    return AxisPlan(out_size, precision, groups, spans, weights,
                    padded.reshape(blocks, BLOCK).astype(dtype))


def _settle(sums: np.ndarray, plan: AxisPlan, bias: np.ndarray, out: np.ndarray) -> np.ndarray:
    """sums [..., blocks, groups*BLOCK, ...] -> floored in `out` [..., blocks, BLOCK, ...] (the caller clips).
    The bias joins the first group before the second is added (see _choose_sums)."""
    np.add(sums[:, :, :BLOCK], bias, out=out)
    if plan.groups == 2:
        np.add(out, sums[:, :, BLOCK:], out=out)
    return np.floor(out, out=out)


class _Horizontal:
    """Buffers for the horizontal pass over frames of one size (reused frame after frame)."""

    def __init__(self, plan: AxisPlan, channels: int, width: int):
        self.plan, self.channels = plan, channels
        rows = channels * STRIP_ROWS
        self.strip = np.empty((channels, STRIP_ROWS, width), plan.dtype)
        self.sums = np.empty((rows, len(plan.spans), plan.groups * BLOCK), plan.dtype)
        self.settled = np.empty((rows, len(plan.spans), BLOCK), plan.dtype)

    def __call__(self, frame: np.ndarray, out: np.ndarray) -> None:
        """uint8 [H, W, C] -> centred planar `out` [C, H, out_size]."""
        plan, c = self.plan, self.channels
        for r0 in range(0, frame.shape[0], STRIP_ROWS):
            n = min(frame.shape[0] - r0, STRIP_ROWS)
            strip = self.strip[:, :n]
            for ch in range(c):            # planar, so each block's input is a plain strided matrix
                np.copyto(strip[ch], frame[r0:r0 + n, :, ch], casting="unsafe")
            strip -= OFFSET
            a, sums = strip.reshape(c * n, -1), self.sums[:c * n]   # (a copy for the last, shorter strip)
            for b, (lo, hi) in enumerate(plan.spans):
                np.matmul(a[:, lo:hi], plan.weights[b], out=sums[:, b])
            settled = _settle(sums, plan, plan.bias, self.settled[:c * n])
            np.clip(settled.reshape(c, n, -1)[:, :, :plan.out_size], -OFFSET, OFFSET - 1, out=out[:, r0:r0 + n])


def _vertical(y: np.ndarray, plan: AxisPlan) -> np.ndarray:
    """Centred planar [C, H, W] -> centred planar [C, out_size, W]."""
    c, _, w = y.shape
    sums = np.empty((c, len(plan.spans), plan.groups * BLOCK, w), plan.dtype)
    for b, (lo, hi) in enumerate(plan.spans):
        np.matmul(plan.weights[b].T, y[:, lo:hi], out=sums[:, b])
    settled = np.empty((c, len(plan.spans), BLOCK, w), plan.dtype)
    _settle(sums, plan, plan.bias[:, :, None], settled)
    return np.clip(settled, -OFFSET, OFFSET - 1, out=settled).reshape(c, -1, w)[:, :plan.out_size]


@functools.lru_cache(maxsize=1)
def _blas():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()   # built once (finding the loaded libraries is the slow part)


def gemm_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, C] -> uint8 [T, height, width, C], equal byte for byte to PyTorch's uint8
    antialiased bicubic (horizontal pass first; an axis whose size does not change is not filtered)."""
    t, h_in, w_in, c = frames.shape
    horizontal = axis_plan(w_in, width) if width != w_in else None
    vertical = axis_plan(h_in, height) if height != h_in else None
    dtype = (vertical or horizontal).dtype if (vertical or horizontal) else np.float32
    out = np.empty((t, height, width, c), np.uint8)
    h_pass = _Horizontal(horizontal, c, w_in) if horizontal else None
    y = np.empty((c, h_in, width), dtype)
    with _blas().limit(limits=1, user_api="blas"):
        for i, frame in enumerate(frames):
            _resize_frame(frame, h_pass, vertical, y, out[i])
    return out


def _resize_frame(frame: np.ndarray, h_pass: _Horizontal | None, vertical: AxisPlan | None, y: np.ndarray,
                  out: np.ndarray) -> None:
    """uint8 [H, W, C] -> `out` uint8 [height, width, C]; `y` is the centred planar buffer between the passes."""
    if h_pass is not None:
        h_pass(frame, y)
    else:
        for ch in range(frame.shape[2]):
            np.copyto(y[ch], frame[:, :, ch], casting="unsafe")
        y -= OFFSET
    z = _vertical(y, vertical) if vertical else y
    for ch in range(frame.shape[2]):     # channel by channel: long inner loops, unlike a transposed copy
        np.add(z[ch], OFFSET, out=out[:, :, ch], casting="unsafe")
