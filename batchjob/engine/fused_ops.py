"""Elementwise steps of the hot path compiled into one kernel each (`mx.compile`).

Written op by op, a rotary embedding is six kernels and as many passes over q or k (two slices, a negation, a
concatenation, two products, a sum, a cast); compiled, one. Same ops in the same order as mlx-vlm's, so the
values are those of its uncompiled code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


@mx.compile
def rotate_half_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """`x * cos + rotate_half(x) * sin` in the input's dtype (mlx-vlm's `_apply_rotary_embedding` and
    `apply_rotary_pos_emb_vision`, cos/sin broadcast over heads by the caller's shapes)."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return ((x * cos) + (rotated * sin)).astype(x.dtype)


@mx.compile
def swiglu_halves(gate_up: mx.array) -> mx.array:
    """`silu(gate) * up` for gate and up stacked on the last axis (one GEMM's output)."""
    half = gate_up.shape[-1] // 2
    return nn.silu(gate_up[..., :half]) * gate_up[..., half:]
