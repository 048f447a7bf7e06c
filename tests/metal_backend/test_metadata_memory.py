"""Attention metadata against a brute-force walk, and KV memory planning."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchjob.metal_backend import SeqSlice, build_attention_metadata


def test_metadata_matches_brute_force(rng):
    bs = int(rng.choice([16, 32]))
    perm = [int(b) for b in rng.permutation(200)]
    slices, used = [], 0
    for _ in range(int(rng.integers(1, 9))):
        computed, new = int(rng.integers(0, 100)), int(rng.integers(1, 70))
        nblk = -(-(computed + new) // bs) + int(rng.integers(0, 2))  # sometimes a spare block at the end
        slices.append(SeqSlice(perm[used : used + nblk], computed, new))
        used += nblk
    meta = build_attention_metadata(slices, bs)
    slots, starts = [], [0]
    for s in slices:
        for pos in range(s.num_computed, s.num_computed + s.num_new):
            slots.append(s.block_table[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + s.num_new)
    np.testing.assert_array_equal(np.array(meta.slot_mapping), slots)
    np.testing.assert_array_equal(np.array(meta.cu_seqlens_q), starts)
    np.testing.assert_array_equal(np.array(meta.context_lens), [s.num_computed + s.num_new for s in slices])
    tables = np.array(meta.block_tables)
    for i, s in enumerate(slices):
        assert list(tables[i, : len(s.block_table)]) == s.block_table
        assert not tables[i, len(s.block_table) :].any()
    assert meta.num_tokens == starts[-1] and meta.max_q_len == max(s.num_new for s in slices)
    assert meta.max_context_len == max(s.num_computed + s.num_new for s in slices)
    assert meta.slot_mapping.dtype == meta.block_tables.dtype == meta.cu_seqlens_q.dtype == mx.int32
    assert len(set(slots)) == len(slots)


def test_metadata_rejects_bad_slices():
    with pytest.raises(ValueError, match="at least one sequence"):
        build_attention_metadata([], 16)
    with pytest.raises(ValueError, match="at least one new token"):
        build_attention_metadata([SeqSlice([0], 3, 0)], 16)
    with pytest.raises(ValueError, match="do not fit its 1 blocks"):
        build_attention_metadata([SeqSlice([0], 10, 7)], 16)
