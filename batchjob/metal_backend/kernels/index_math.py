"""Host-side twins of the kernels' index logic (paged_attention_common.metal), for exhaustive testing.

The Metal kernels cannot run on the machines where most of this code is developed, so the part most likely
to be wrong there, which threadgroup owns which query rows and where a KV position lives, is mirrored here
statement for statement and checked against brute force on random ragged batches.
"""

from __future__ import annotations

from typing import Sequence


def find_seq_for_token(cu_seqlens_q: Sequence[int], num_seqs: int, token: int) -> int:
    """Largest s with cu_seqlens_q[s] <= token (twin of the Metal function of the same name)."""
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cu_seqlens_q[mid] <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_seq_for_query_block(cu_seqlens_q: Sequence[int], num_seqs: int, block: int, bq: int) -> int:
    """Largest s with cu_seqlens_q[s] // bq + s <= block (sequence s's virtual blocks start there)."""
    lo, hi = 0, num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cu_seqlens_q[mid] // bq + mid <= block:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tiled_grid_blocks(num_tokens: int, num_seqs: int, bq: int) -> int:
    """Virtual query blocks the tiled kernel launches: enough for every sequence, computable without a scan."""
    return num_tokens // bq + num_seqs


def query_block_rows(cu_seqlens_q: Sequence[int], num_seqs: int, block: int, bq: int) -> tuple[int, int, int] | None:
    """(sequence, first row within it, number of rows) a tiled threadgroup handles, or None when surplus."""
    seq = find_seq_for_query_block(cu_seqlens_q, num_seqs, block, bq)
    q_start = cu_seqlens_q[seq]
    q_len = cu_seqlens_q[seq + 1] - q_start
    local_block = block - (q_start // bq + seq)
    if local_block * bq >= q_len:
        return None
    first_row = local_block * bq
    return seq, first_row, min(bq, q_len - first_row)


def visible_kv_len(context_len: int, q_len: int, row: int) -> int:
    """KV positions query row `row` of a sequence may attend to (causal with the cached-context offset)."""
    return context_len - q_len + row + 1


def kv_slot(table_row: Sequence[int], pos: int, block_size: int) -> int:
    """Flat cache slot of KV position `pos` through a block-table row."""
    return table_row[pos // block_size] * block_size + pos % block_size
