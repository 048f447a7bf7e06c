"""Random ragged batches over a paged cache with scattered blocks: the kernel probe, tests and benchmarks.

Why in the package: the backend selector checks a custom kernel against the portable path on exactly such a
batch at start, and the benchmark script needs the same construction. The contiguous per-sequence K/V are kept
alongside so a reference can be computed without going through the block tables at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from .metadata import AttentionMetadata, SeqSlice, build_attention_metadata


@dataclass
class RaggedBatch:
    q: mx.array  # [T, Hq, D]
    k_cache: mx.array  # [num_blocks, block_size, Hkv, D]
    v_cache: mx.array
    meta: AttentionMetadata
    q_host: np.ndarray  # float64 copies of the inputs and of each sequence's contiguous K/V
    k_seqs: list[np.ndarray]  # [context_len, Hkv, D] per sequence
    v_seqs: list[np.ndarray]
    q_lens: list[int]
    context_lens: list[int]


def make_ragged_batch(
    rng: np.random.Generator,
    q_lens: Sequence[int],
    cached_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: mx.Dtype = mx.float32,
    spare_blocks: int = 3,
    shuffle_blocks: bool = True,
    prefix_groups: Sequence[int] | None = None,
    shared_blocks: int = 0,
) -> RaggedBatch:
    """Sequences with `cached_lens[i]` tokens already cached and `q_lens[i]` new ones, blocks shuffled
    (or handed out in ascending order, as a fresh pool does, with `shuffle_blocks=False`).

    Sequences with the same `prefix_groups` entry (>= 0) share the physical blocks of their first
    `shared_blocks` logical blocks, as the followers of one clip share its cached video prefix in the pool.

    Spare blocks are filled with large garbage so any read outside a sequence's own blocks shows up as a
    wrong answer rather than passing silently. Values are rounded to `dtype` before the host copies are taken,
    so a reference computed from the copies sees exactly what the device sees.
    """
    if len(q_lens) != len(cached_lens):
        raise ValueError(f"q_lens ({len(q_lens)}) and cached_lens ({len(cached_lens)}) must have equal length")
    ctx = [int(q) + int(c) for q, c in zip(q_lens, cached_lens)]
    groups = list(prefix_groups) if prefix_groups is not None else [-1] * len(ctx)
    if len(groups) != len(ctx) or any(g >= 0 and c < shared_blocks * block_size for g, c in zip(groups, cached_lens)):
        raise ValueError(f"prefix_groups must name one group per sequence, and sharing sequences must have at least "
                         f"shared_blocks x block_size = {shared_blocks * block_size} cached tokens")
    need = [-(-c // block_size) for c in ctx]
    num_groups = len({g for g in groups if g >= 0})
    num_blocks = sum(n - (shared_blocks if g >= 0 else 0) for n, g in zip(need, groups)) \
        + num_groups * shared_blocks + spare_blocks
    perm = rng.permutation(num_blocks) if shuffle_blocks else np.arange(num_blocks)
    tables, used, shared = [], 0, {}
    for n, g in zip(need, groups):
        table = []
        if g >= 0:
            if g not in shared:
                shared[g] = [int(b) for b in perm[used : used + shared_blocks]]
                used += shared_blocks
            table = list(shared[g])
        tables.append(table + [int(b) for b in perm[used : used + n - len(table)]])
        used += n - len(table)

    def rounded(values: np.ndarray):
        """Device copy in `dtype` and the float64 host copy of exactly what the device holds."""
        a = mx.array(values.astype(np.float32)).astype(dtype)
        return a, np.array(a.astype(mx.float32)).astype(np.float64)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_values, v_values = rng.standard_normal(shape), rng.standard_normal(shape)
    spare = perm[used:]  # spare blocks: garbage that would dominate any wrongly included score
    k_values[spare], v_values[spare] = 30.0, 1e3   # exact in every dtype, so rounding once is the same
    k_dev, k_all = rounded(k_values)
    v_dev, v_all = rounded(v_values)
    k_seqs, v_seqs = [], []
    for table, c in zip(tables, ctx):
        k_seqs.append(k_all[table].reshape(-1, num_kv_heads, head_dim)[:c])
        v_seqs.append(v_all[table].reshape(-1, num_kv_heads, head_dim)[:c])
    q_dev, q_host = rounded(rng.standard_normal((int(sum(q_lens)), num_q_heads, head_dim)))
    slices = [SeqSlice(t, int(c), int(q)) for t, c, q in zip(tables, cached_lens, q_lens)]
    meta = build_attention_metadata(slices, block_size)
    return RaggedBatch(q_dev, k_dev, v_dev, meta, q_host, k_seqs, v_seqs, list(map(int, q_lens)), ctx)

