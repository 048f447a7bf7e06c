"""The compiled elementwise steps (engine/fused_ops.py) against independent references: a float64 NumPy rotary
embedding written from its definition, and PyTorch's own tanh GELU; both rotary forms must agree bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from batchjob.engine.fused_ops import (GeluTanh, pairs_suit, rope_heads, rope_pairs, rotate_half_rope,
                                       split_tables)

DTYPES = {"float32": (mx.float32, 2e-6), "bfloat16": (mx.bfloat16, 1.6e-2)}


def _reference_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """`x * cos + rotate_half(x) * sin` in float64, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("head_dim", [16, 64, 72, 80, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rope_heads_matches_definition_and_both_forms_agree(head_dim, dtype):
    rng = np.random.default_rng(head_dim * 7 + len(dtype))
    tokens, heads, rotated = 37, 6, 4    # rotate the first 4 of 6 heads (q and k stacked before v)
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    # tables whose halves differ (M-RoPE's do not, but nothing may assume it)
    angles = rng.uniform(-8, 8, (tokens, 1, head_dim)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    mdtype, tol = DTYPES[dtype]
    xm = mx.array(x).astype(mdtype)
    got = rope_heads(xm, rotated, mx.array(cos), mx.array(sin))
    ref = _reference_rope(np.array(xm.astype(mx.float32)).astype(np.float64)[:, :rotated], cos, sin)
    assert got.shape == (tokens, rotated, head_dim) and got.dtype == mdtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), ref, atol=tol * 4, rtol=tol)
    # the two exact forms: the concatenation and the pair swap give the same bits
    concat = rotate_half_rope(xm[:, :rotated], mx.array(cos), mx.array(sin))
    pairs = rope_pairs(xm.reshape(tokens, heads, 2, head_dim // 2)[:, :rotated],
                       split_tables(mx.array(cos), mx.array(sin))).reshape(tokens, rotated, head_dim)
    assert mx.array_equal(concat, pairs).item()


def test_rope_heads_uses_given_tables_and_views_of_a_stacked_projection():
    """The vision tower's layout: q, k, v stacked on an axis of 3, tables built once and reused."""
    rng = np.random.default_rng(3)
    tokens, heads, d = 20, 2, 80
    qkv = mx.array(rng.standard_normal((tokens, 3, heads, d)).astype(np.float32))
    freqs = rng.uniform(0, 5, (tokens, d // 2)).astype(np.float32)
    cos = np.concatenate([np.cos(freqs)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(freqs)] * 2, -1)[:, None, :]
    tables = split_tables(mx.array(cos), mx.array(sin))
    got = rope_heads(qkv.reshape(tokens, 3 * heads, d), 2 * heads, mx.array(cos), mx.array(sin), tables)
    ref = _reference_rope(np.array(qkv).reshape(tokens, 3 * heads, d)[:, :2 * heads].astype(np.float64), cos, sin)
    np.testing.assert_allclose(np.array(got), ref, atol=1e-5, rtol=1e-5)


def test_pairs_suit_rule():
    assert [pairs_suit(d) for d in (16, 64, 80, 128)] == [True] * 4
    assert [pairs_suit(d) for d in (72, 24, 7, 0 + 2)] == [False] * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gelu_tanh_equals_pytorch(dtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((64, 300)) * 3).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 30.0, -30.0, 1e-4, -6.0]
    mdtype, _ = DTYPES[dtype]
    xm = mx.array(x).astype(mdtype)
    got = np.array(GeluTanh()(xm).astype(mx.float32))
    tdtype = getattr(torch, dtype)
    ref = torch.nn.functional.gelu(torch.from_numpy(np.array(xm.astype(mx.float32))).to(tdtype),
                                   approximate="tanh").float().numpy()
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=2e-6)
    else:   # both compute in fp32 and round once: at most one bf16 step apart where the fp32 values straddle
        assert np.mean(got == ref) > 0.99
        np.testing.assert_allclose(got, ref, rtol=8e-3, atol=1e-6)
