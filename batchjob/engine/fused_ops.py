"""Elementwise steps of the hot path compiled into one kernel each (`mx.compile`).

Written op by op, a rotary embedding is six kernels and as many passes over q or k (two slices, a negation, a
concatenation, two products, a sum, a cast); compiled, fewer. Same ops in the same order as mlx-vlm's, so the
values are those of its uncompiled code.

Rotary embedding, two exact forms of `x * cos + rotate_half(x) * sin`:
- `rotate_half_rope`: the concatenation as written (compilation cannot fuse a concatenation, so it stays a
  kernel of its own);
- `rope_pairs`: x viewed as `[..., 2, half]`, the halves swapped by a reversed view and sin's first half
  negated once in the tables (`RotaryTables`): `x1 * c1 + x2 * (-s1)` is `x1 * c1 + (-x2) * s1` bit for bit.
  One kernel; on GPUs its reversed view reads fast only when a half is whole 16-byte words of bf16
  (`pairs_suit`: head_dim 80 and 128 do, Qwen3-VL's vision head_dim 72 does not), so the concatenation
  form stays for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

PAIR_ALIGN = 8   # elements of a half that make its rows whole 16-byte words in bf16


@mx.compile
def rotate_half_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """`x * cos + rotate_half(x) * sin` in the input's dtype (mlx-vlm's `_apply_rotary_embedding` and
    `apply_rotary_pos_emb_vision`, cos/sin broadcast over heads by the caller's shapes)."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return ((x * cos) + (rotated * sin)).astype(x.dtype)


def pairs_suit(head_dim: int) -> bool:
    """Whether `rope_pairs` is the faster form for this head size (module docstring)."""
    return head_dim % 2 == 0 and (head_dim // 2) % PAIR_ALIGN == 0


@dataclass(frozen=True)
class RotaryTables:
    """cos and signed sin split for `rope_pairs`: `[..., 2, half]` each, sin's first half negated."""

    cos: mx.array
    sin: mx.array


def split_tables(cos: mx.array, sin: mx.array) -> RotaryTables:
    """From rotate-half tables `[..., head_dim]` (no assumption that their halves repeat)."""
    half = cos.shape[-1] // 2
    sign = mx.array([[-1.0], [1.0]], dtype=sin.dtype)
    return RotaryTables(cos.reshape(*cos.shape[:-1], 2, half), sin.reshape(*sin.shape[:-1], 2, half) * sign)


@mx.compile
def _rope_pairs(x: mx.array, cos: mx.array, signed_sin: mx.array) -> mx.array:
    return ((x * cos) + (x[..., ::-1, :] * signed_sin)).astype(x.dtype)


def rope_pairs(x: mx.array, tables: RotaryTables) -> mx.array:
    """`rotate_half_rope` on `x` viewed as `[..., 2, half]` (a view of a stacked projection is fine); returns
    `[..., 2, half]`, contiguous."""
    return _rope_pairs(x, tables.cos, tables.sin)


def rope_heads(x: mx.array, count: int, cos: mx.array, sin: mx.array,
               tables: RotaryTables | None = None) -> mx.array:
    """RoPE of the first `count` heads of a contiguous `x [tokens, heads, head_dim]` (q, or q and k stacked),
    `[tokens, count, head_dim]`; cos/sin `[tokens, 1, head_dim]`. `tables`: `split_tables(cos, sin)` made once
    by the caller when many layers share them."""
    tokens, _, d = x.shape
    if not pairs_suit(d):
        return rotate_half_rope(x[:, :count], cos, sin)
    tables = tables or split_tables(cos, sin)
    return rope_pairs(x.reshape(tokens, -1, 2, d // 2)[:, :count], tables).reshape(tokens, count, d)


# Whether `linear_plus` adds the residual inside the GEMM (`mx.addmm`) rather than as a pass of its own.
RESIDUAL_IN_GEMM = True


def folds_residual(linear: nn.Module) -> bool:
    """Whether `linear_plus` adds a residual inside this projection's GEMM."""
    return RESIDUAL_IN_GEMM and type(linear) is nn.Linear and "bias" not in linear


def linear_plus(linear: nn.Module, x: mx.array, residual: mx.array | None) -> mx.array:
    """`residual + linear(x)` (just `linear(x)` without a residual). For a plain bias-free `nn.Linear` the sum is
    the GEMM's own epilogue (`mx.addmm`, rounded once), instead of a separate pass that reads the projection's
    output and the residual and writes their sum; quantized or biased projections keep the separate add."""
    if residual is None:
        return linear(x)
    if folds_residual(linear) and x.ndim >= 2:
        flat = x.reshape(-1, x.shape[-1])
        return mx.addmm(residual.reshape(flat.shape[0], -1), flat, linear.weight.T).reshape(residual.shape)
    return residual + linear(x)


@mx.compile
def swiglu_halves(gate_up: mx.array) -> mx.array:
    """`silu(gate) * up` for gate and up stacked on the last axis (one GEMM's output)."""
    half = gate_up.shape[-1] // 2
    return nn.silu(gate_up[..., :half]) * gate_up[..., half:]


@mx.compile
def _gelu_tanh(x: mx.array) -> mx.array:
    xf = x.astype(mx.float32)
    return (0.5 * xf * (1 + mx.tanh(0.7978845608028654 * (xf + 0.044715 * (xf * xf * xf))))).astype(x.dtype)


class GeluTanh(nn.Module):
    """`gelu_pytorch_tanh` as PyTorch computes it (in fp32, rounded once to the input's dtype), one kernel.
    MLX's `nn.GELU(approx="tanh")` writes the cube as a power, which its CUDA kernels evaluate slowly."""

    def __call__(self, x: mx.array) -> mx.array:
        return _gelu_tanh(x)
