"""The kernels' index logic (Python twins) against brute force on random ragged batches, exhaustively."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.metal_backend import SeqSlice, build_attention_metadata
from batchjob.metal_backend.kernels import kv_tile_len, THREADGROUP_MEMORY_BYTES
from batchjob.metal_backend.kernels.index_math import (
    find_seq_for_token,
    kv_slot,
    query_block_rows,
    tiled_grid_blocks,
    visible_kv_len,
)


def random_q_lens(rng, bq: int) -> list[int]:
    n = int(rng.integers(1, 12))
    pool = [1, 2, bq - 1, bq, bq + 1, 2 * bq, 3 * bq - 1]
    return [max(1, int(rng.choice(pool)) if rng.random() < 0.6 else int(rng.integers(1, 4 * bq))) for _ in range(n)]


@pytest.mark.parametrize("trial", range(40))
def test_token_to_sequence_search_matches_brute_force(rng, trial):
    q_lens = random_q_lens(rng, 16)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    owner = np.repeat(np.arange(len(q_lens)), q_lens)  # brute force: who owns each token
    for t in range(int(cu[-1])):
        assert find_seq_for_token(cu, len(q_lens), t) == owner[t], (q_lens, t)


@pytest.mark.parametrize("bq", [1, 2, 4, 16, 32])
@pytest.mark.parametrize("trial", range(12))
def test_tiled_query_blocks_cover_every_row_exactly_once(rng, bq, trial):
    q_lens = random_q_lens(rng, bq)
    cu = [0, *np.cumsum(q_lens).tolist()]
    covered: dict[tuple[int, int], int] = {}
    surplus = 0
    for g in range(tiled_grid_blocks(cu[-1], len(q_lens), bq)):
        got = query_block_rows(cu, len(q_lens), g, bq)
        if got is None:
            surplus += 1
            continue
        seq, first_row, rows = got
        assert 1 <= rows <= bq and first_row % bq == 0 and first_row + rows <= q_lens[seq]
        for r in range(first_row, first_row + rows):
            covered[(seq, r)] = covered.get((seq, r), 0) + 1
    expected = {(s, r) for s, n in enumerate(q_lens) for r in range(n)}
    assert set(covered) == expected and set(covered.values()) == {1}, q_lens
    # the grid wastes at most one threadgroup per sequence
    assert surplus <= len(q_lens)
    assert surplus == tiled_grid_blocks(cu[-1], len(q_lens), bq) - sum(-(-n // bq) for n in q_lens)


@pytest.mark.parametrize("trial", range(10))
def test_kv_slots_and_visibility_match_the_metadata(rng, trial):
    bs = int(rng.choice([16, 32]))
    perm, slices, used = [int(b) for b in rng.permutation(300)], [], 0
    for _ in range(int(rng.integers(1, 8))):
        computed, new = int(rng.integers(0, 80)), int(rng.integers(1, 50))
        n = -(-(computed + new) // bs)
        slices.append(SeqSlice(perm[used : used + n], computed, new))
        used += n
    meta = build_attention_metadata(slices, bs)
    t = 0
    for s, sl in enumerate(slices):
        row = meta.block_tables_host[s]
        for j in range(sl.num_new):
            # the new token's own KV slot is where write_kv put it, and it is the last position it may see
            pos = sl.num_computed + j
            assert kv_slot(row, pos, bs) == meta.slot_mapping_host[t]
            assert visible_kv_len(sl.num_computed + sl.num_new, sl.num_new, j) == pos + 1
            t += 1


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 512])
def test_kv_tile_fits_threadgroup_memory(head_dim):
    bk = kv_tile_len(head_dim)
    assert bk >= 1 and 2 * bk * head_dim * 4 <= THREADGROUP_MEMORY_BYTES
