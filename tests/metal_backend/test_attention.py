"""Portable paged attention and the KV write against an independent float64 dense reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import (SeqSlice, StackedHeads, build_attention_metadata, head_rows, paged_attention,
                                    write_kv)
from batchjob.metal_backend.attention import decode_groups
from batchjob.metal_backend.probe import make_ragged_batch


def ragged_lengths(rng: np.random.Generator, block_size: int, num_seqs: int) -> tuple[list[int], list[int]]:
    """Query lengths with 1 and block-boundary cases; cached prefixes both block-aligned (prefix hit) and not
    (chunked prefill), so contexts are often longer than queries."""
    q_choices = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, int(rng.integers(2, 3 * block_size))]
    q_lens = [1] + [int(rng.choice(q_choices)) for _ in range(num_seqs - 1)]
    cached = []
    for _ in range(num_seqs):
        kind = rng.integers(3)
        cached.append(0 if kind == 0 else int(rng.integers(1, 5)) * block_size if kind == 1 else int(rng.integers(1, 90)))
    order = rng.permutation(num_seqs)
    return [q_lens[i] for i in order], [cached[i] for i in order]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_portable_matches_dense_reference_fp32(rng, dense_reference, gqa, head_dim, block_size):
    num_kv_heads = int(rng.choice([1, 2]))
    q_lens, cached = ragged_lengths(rng, block_size, num_seqs=int(rng.integers(3, 7)))
    shuffle = bool(rng.random() < 0.75)  # ascending tables take the slicing path instead of the gather
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=gqa * num_kv_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=block_size, shuffle_blocks=shuffle)
    scale = head_dim**-0.5
    chunk = int(rng.choice([1, 7, block_size, 512]))  # small chunks exercise the long-prompt chunking
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, query_chunk=chunk)
    assert out.dtype == mx.float32 and out.shape == batch.q.shape
    ref = dense_reference(batch, scale)
    err = np.abs(np.array(out).astype(np.float64) - ref).max()
    assert err < 1e-5, f"max abs error {err} for q_lens={q_lens} cached={cached} chunk={chunk} shuffled={shuffle}"


@pytest.mark.parametrize("gqa", [1, 4])
def test_many_one_token_sequences_grouped_match_reference(rng, dense_reference, gqa):
    """Decode-like batches: many one-token queries over varied contexts, mixed with a few prefills."""
    n = int(rng.integers(5, 40))
    q_lens = [1] * n + [int(x) for x in rng.integers(2, 40, size=int(rng.integers(0, 3)))]
    cached = [int(rng.choice([0, 1, 15, 16, 17])) if rng.random() < 0.3 else int(rng.integers(0, 300))
              for _ in q_lens]
    order = rng.permutation(len(q_lens))
    q_lens, cached = [q_lens[i] for i in order], [cached[i] for i in order]
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=2 * gqa, num_kv_heads=2, head_dim=64, block_size=16)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    err = np.abs(np.array(out).astype(np.float64) - dense_reference(batch, 0.125)).max()
    assert err < 1e-5, f"max abs error {err} for q_lens={q_lens} cached={cached}"


def test_decode_groups_partition_and_bound_padding(rng):
    lens = [int(x) for x in rng.integers(1, 3000, size=int(rng.integers(1, 200)))]
    groups = decode_groups(lens, slack=1.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        padded, real = len(g) * max(lens[i] for i in g), sum(lens[i] for i in g)
        assert padded <= 1.25 * real + 1e-9
    assert len(decode_groups([128] * 64)) == 1  # equal contexts: one batch


@pytest.mark.parametrize("dtype,tol", [(mx.float16, 4e-3), (mx.bfloat16, 3e-2)])
def test_portable_half_precision_within_dtype_tolerance(rng, dense_reference, dtype, tol):
    block_size, head_dim, gqa = 16, int(rng.choice([64, 80, 128])), int(rng.choice([1, 2, 4, 8]))
    q_lens, cached = ragged_lengths(rng, block_size, num_seqs=4)
    batch = make_ragged_batch(rng, q_lens, cached, num_q_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim,
                              block_size=block_size, dtype=dtype)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, head_dim**-0.5)
    assert out.dtype == dtype
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - dense_reference(batch, head_dim**-0.5)).max()
    assert err < tol, f"{dtype}: max abs error {err} for q_lens={q_lens} cached={cached} D={head_dim}"


def test_write_kv_scatters_into_slots_and_leaves_the_rest(rng):
    nb, bs, hkv, d = 12, 16, 2, 64
    perm = [int(b) for b in rng.permutation(nb)]
    slices = [SeqSlice(perm[0:3], 7, 30), SeqSlice(perm[3:4], 0, 1), SeqSlice(perm[4:8], 33, 16)]
    meta = build_attention_metadata(slices, bs)
    k0 = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    v0 = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    k_new = rng.standard_normal((meta.num_tokens, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((meta.num_tokens, hkv, d)).astype(np.float32)
    k, v = write_kv(mx.array(k0), mx.array(v0), mx.array(k_new), mx.array(v_new), meta)
    expect_k, expect_v, t = k0.copy(), v0.copy(), 0
    for s in slices:  # independent scatter: walk positions one by one through the block table
        for pos in range(s.num_computed, s.num_computed + s.num_new):
            blk, off = s.block_table[pos // bs], pos % bs
            expect_k[blk, off], expect_v[blk, off] = k_new[t], v_new[t]
            t += 1
    np.testing.assert_array_equal(np.array(k), expect_k)
    np.testing.assert_array_equal(np.array(v), expect_v)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("head_dim", [64, 5])
def test_write_kv_from_stacked_heads_equals_the_walk(rng, dtype, head_dim):
    """K and V named as heads of the q/k/v stack they are views of (what the engine's layers pass) land in the
    same slots, bit for bit, as a walk through the block tables writes them; half-precision rows move as words
    only where a head is whole words (head_dim 64, not 5)."""
    nb, bs, hq, hkv = 10, 16, int(rng.integers(1, 5)), int(rng.integers(1, 3))
    perm = [int(b) for b in rng.permutation(nb)]
    slices = [SeqSlice(perm[0:2], int(rng.integers(0, 16)), int(rng.integers(1, 17))),
              SeqSlice(perm[2:6], 16, int(rng.integers(1, 48)))]
    meta = build_attention_metadata(slices, bs)
    cache0 = rng.standard_normal((2, nb, bs, hkv, head_dim)).astype(np.float32)
    stack = rng.standard_normal((meta.num_tokens, hq + 2 * hkv, head_dim)).astype(np.float32)
    stack_mx = mx.array(stack).astype(dtype)
    k, v = write_kv(mx.array(cache0[0]).astype(dtype), mx.array(cache0[1]).astype(dtype),
                    StackedHeads(stack_mx, hq, hkv), StackedHeads(stack_mx, hq + hkv, hkv), meta)
    rows = head_rows(StackedHeads(stack_mx, hq, hkv), dtype)
    assert rows.dtype == (mx.uint32 if dtype != mx.float32 and head_dim % 2 == 0 else dtype)
    stack_back = np.array(stack_mx.astype(mx.float32))   # the values in `dtype`, exactly
    expect = np.array(mx.array(cache0).astype(dtype).astype(mx.float32))
    t = 0
    for s in slices:
        for pos in range(s.num_computed, s.num_computed + s.num_new):
            blk, off = s.block_table[pos // bs], pos % bs
            expect[0, blk, off], expect[1, blk, off] = stack_back[t, hq:hq + hkv], stack_back[t, hq + hkv:]
            t += 1
    np.testing.assert_array_equal(np.array(k.astype(mx.float32)), expect[0])
    np.testing.assert_array_equal(np.array(v.astype(mx.float32)), expect[1])
    assert k.dtype == v.dtype == dtype


def test_write_kv_rejects_heads_of_the_wrong_shape(rng):
    meta = build_attention_metadata([SeqSlice([0], 0, 5)], 16)
    cache = mx.zeros((2, 16, 2, 8))
    stack = mx.zeros((5, 6, 8))
    with pytest.raises(ValueError, match=r"num_kv_heads=2"):
        write_kv(cache, cache, StackedHeads(stack, 2, 3), StackedHeads(stack, 5, 1), meta)
    for first, count in ((5, 2), (-1, 2), (0, 0)):   # past the stack's heads, before them, none
        with pytest.raises(ValueError, match=r"StackedHeads: heads"):
            StackedHeads(stack, first, count)


def test_chunked_prefill_equals_single_pass(rng):
    """Two chunks through write_kv + paged_attention give the same outputs as one pass over the prompt."""
    bs, hq, hkv, d, n, split = 16, 4, 2, 64, 75, int(rng.integers(1, 74))
    table = [int(b) for b in rng.permutation(8)[:5]]
    q = mx.array(rng.standard_normal((n, hq, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((n, hkv, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((n, hkv, d)).astype(np.float32))
    empty = mx.zeros((8, bs, hkv, d))

    meta = build_attention_metadata([SeqSlice(table, 0, n)], bs)
    kc, vc = write_kv(empty, empty, k, v, meta)
    whole = paged_attention(q, kc, vc, meta, d**-0.5)

    kc, vc, parts = empty, empty, []
    for lo, hi in [(0, split), (split, n)]:
        meta = build_attention_metadata([SeqSlice(table, lo, hi - lo)], bs)
        kc, vc = write_kv(kc, vc, k[lo:hi], v[lo:hi], meta)
        parts.append(paged_attention(q[lo:hi], kc, vc, meta, d**-0.5))
    err = mx.abs(mx.concatenate(parts) - whole).max().item()
    assert err < 1e-5, f"split at {split}: max abs diff {err}"


def test_bad_shapes_are_named(rng):
    meta = build_attention_metadata([SeqSlice([0, 1], 0, 20)], 16)
    cache = mx.zeros((2, 16, 2, 64))
    with pytest.raises(ValueError, match="num_tokens=20"):
        paged_attention(mx.zeros((19, 4, 64)), cache, cache, meta, 0.125)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        paged_attention(mx.zeros((20, 3, 64)), cache, cache, meta, 0.125)
    with pytest.raises(ValueError, match="block_size 16, cache has 32"):
        paged_attention(mx.zeros((20, 4, 64)), mx.zeros((2, 32, 2, 64)), mx.zeros((2, 32, 2, 64)), meta, 0.125)
    with pytest.raises(ValueError, match="query_chunk must be >= 1"):
        paged_attention(mx.zeros((20, 4, 64)), cache, cache, meta, 0.125, query_chunk=0)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        write_kv(cache, cache, mx.zeros((20, 1, 64)), mx.zeros((20, 1, 64)), meta)
