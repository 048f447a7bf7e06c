"""Portable paged varlen attention, written with MLX ops: runs on CPU, CUDA and Metal, and is the oracle
the Metal kernels are checked against.

Each sequence reads only its own blocks and attends with its own causal offset, so the cost of a batch
stays within `PAD_SLACK` of the sum over sequences of `q_len * context_len`, never `batch x longest` as with
a padded cache; sequences of equal shape share one SDPA call (`attention_plan`), since on a GPU a call's
fixed cost outweighs the arithmetic of a short sequence.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .attention_plan import PAD_SLACK, AttentionPlan, SdpaCall, plan_attention
from .attention_plan import decode_groups  # noqa: F401  (re-exported: it lived here first)
from .metadata import AttentionMetadata


def check_attention_inputs(q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata) -> None:
    """Shape checks shared by every backend (pure host-side work on shapes, no sync)."""
    if q.ndim != 3 or q.shape[0] != meta.num_tokens:
        raise ValueError(f"paged_attention: q must be [num_tokens={meta.num_tokens}, Hq, D], got {q.shape}")
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(
            f"paged_attention: K and V caches must both be [num_blocks, block_size, Hkv, D], "
            f"got {k_cache.shape} and {v_cache.shape}"
        )
    _, bs, hkv, d = k_cache.shape
    if q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(
            f"paged_attention: q {q.shape} does not fit the cache {k_cache.shape}: head_dim must match and the "
            f"number of query heads must be a multiple of the number of KV heads"
        )
    if bs != meta.block_size:
        raise ValueError(f"paged_attention: metadata built for block_size {meta.block_size}, cache has {bs}")


def gather_rows(tables: np.ndarray, length: int, block_size: int, num_kv_heads: int,
                context_lens: np.ndarray | None = None) -> mx.array | tuple[int, int]:
    """How to read KV positions `[0, length)` of sequences through `tables` (host, `[n, >= ceil(length / bs)]`):
    `(first block, number of blocks)` when one sequence's blocks are an ascending run (a fresh pool hands them
    out that way), else the row indices `[n, Hkv, length]` into the cache viewed as `[slots * Hkv, D]`.
    Positions at or past a sequence's `context_lens` entry read its last position instead (padding that the
    caller masks or never lets a query see): finite values, never another sequence's blocks."""
    n = tables.shape[0]
    if n == 1 and (context_lens is None or length <= int(context_lens[0])):
        num_blocks = -(-length // block_size)
        if num_blocks == 1 or bool(np.all(np.diff(tables[0, :num_blocks]) == 1)):
            return int(tables[0, 0]), num_blocks
    pos = np.broadcast_to(np.arange(length)[None, :], (n, length))
    if context_lens is not None:
        pos = np.minimum(pos, np.asarray(context_lens).reshape(n, 1) - 1)
    slots = np.take_along_axis(tables, pos // block_size, axis=1) * block_size + pos % block_size
    rows = slots[:, None, :] * num_kv_heads + np.arange(num_kv_heads)[None, :, None]
    return mx.array(rows.astype(np.int32))


def gather_heads_major(cache: mx.array, tables: np.ndarray, length: int, dtype: mx.Dtype,
                       rows: mx.array | tuple[int, int] | None = None, contiguous: bool = True) -> mx.array:
    """KV of sequences as `[n, Hkv, length, D]` (what SDPA wants), read through block tables.

    An ascending run of blocks is sliced and transposed; scattered blocks are gathered row by row straight into
    the head-major layout, one copy instead of gather-then-transpose. With `contiguous` the slice is copied too:
    handed a transposed view, MLX's CPU path copied K/V once per query head under GQA, several times the time
    and memory of one copy; fused GPU kernels read the view as it is. `rows` is `gather_rows`' plan when the
    caller has it (planned once per forward pass, shared by K, V and every layer).
    """
    nb, bs, hkv, d = cache.shape
    plan = gather_rows(tables, length, bs, hkv) if rows is None else rows
    if isinstance(plan, tuple):
        first, num_blocks = plan
        kv = cache[first : first + num_blocks].reshape(1, num_blocks * bs, hkv, d)[:, :length]
        kv = kv.transpose(0, 2, 1, 3).astype(dtype)
        return mx.contiguous(kv) if contiguous else kv
    return take_rows(cache.reshape(nb * bs * hkv, d), plan).astype(dtype)


def take_rows(x: mx.array, indices: mx.array) -> mx.array:
    """`mx.take(x, indices, axis=0)` of a row-contiguous `x` (else it is copied first), its rows moved as 64-bit
    words where their bytes allow: the same bits, a quarter of the elements for a half-precision row (MLX's CUDA
    gather moves one element per thread). Not on Metal, where 8-byte words were never measured (MLX's GPU
    scatter refuses them, so the KV write stays at 32-bit words everywhere)."""
    if not _rows_are_words(x):
        return mx.take(x, indices, axis=0)
    return mx.take(x.view(mx.uint64), indices, axis=0).view(x.dtype)


def _rows_are_words(x: mx.array) -> bool:
    """Whether `take_rows` moves `x`'s rows as 64-bit words (whole words a row, not on Metal)."""
    return (x.shape[-1] * x.dtype.size) % 8 == 0 and not mx.metal.is_available()


def _memo(meta: AttentionMetadata, key: tuple, build):
    """A value derived from the metadata, built by the first layer and reused by the rest of the forward."""
    value = meta.plan_cache.get(key)
    if value is None:
        value = meta.plan_cache[key] = build()
    return value


class PackedRows:
    """A packed `[T, H, D]` array (q, or this layer's new K or V) whose rows one layer's SDPA calls read.

    Its rows are usually heads of a stacked projection: a strided view, which MLX gathers one element per
    thread. Where a call gathers (padded groups), the array is copied row-contiguous once for all the layer's
    calls and its rows gathered as 64-bit words (`take_rows`); views of contiguous runs copy nothing. On Metal,
    and for rows that make no whole words, the view is gathered as it is (`mx.take`)."""

    def __init__(self, x: mx.array):
        self.x = x
        self._contiguous: mx.array | None = None

    def rows(self, start: int | None, tokens: np.ndarray, n: int, length: int, memo) -> mx.array:
        """Rows as `[n, H, length, D]`: a view of the run `[start, start + n * length)`, else a gather of
        `tokens` (the index array built once per forward through `memo`).

        The view keeps the token-major layout (strides independent of T); fused SDPA reads it as it is and
        writes its output in the same layout, so turning the output back into packed rows is free as well."""
        _, h, d = self.x.shape
        if start is not None:
            rows = self.x[start : start + n * length]
        else:
            rows = self._take(memo(lambda: mx.array(tokens)))
        return rows.reshape(n, length, h, d).transpose(0, 2, 1, 3)

    def _take(self, indices: mx.array) -> mx.array:
        if not _rows_are_words(self.x):
            return mx.take(self.x, indices, axis=0)
        if self._contiguous is None:
            self._contiguous = mx.contiguous(self.x)
        return take_rows(self._contiguous, indices)


def _call_keys(call: SdpaCall, index: int, plan_key: tuple, k_cache, v_cache, meta, dtype, fresh, contiguous):
    """K and V `[n, Hkv, k_len, D]` of one call: this layer's new K/V when nothing is cached, else the cache."""
    if fresh is not None and call.key_tokens is not None:
        memo = lambda build: _memo(meta, plan_key + (index, "key_tokens"), build)  # noqa: E731
        k, v = (x.rows(call.k_start, call.key_tokens, call.n, call.k_len, memo) for x in fresh)
        return (mx.contiguous(k), mx.contiguous(v)) if contiguous else (k, v)
    seqs = list(call.seqs)
    tables = meta.block_tables_host[seqs]
    hkv = k_cache.shape[2]
    if call.key_slots is not None:   # a folded call: its keys' slots, gathered once for all its sequences
        rows = _memo(meta, plan_key + (index, "key_rows", hkv), lambda: mx.array(
            (call.key_slots.reshape(call.batch, 1, call.k_len).astype(np.int64) * hkv
             + np.arange(hkv)[None, :, None]).astype(np.int32)))
    else:
        rows = _memo(meta, plan_key + (index, "key_rows", hkv),
                     lambda: gather_rows(tables, call.k_len, meta.block_size, hkv, meta.context_lens_host[seqs]))
    return (gather_heads_major(k_cache, tables, call.k_len, dtype, rows, contiguous),
            gather_heads_major(v_cache, tables, call.k_len, dtype, rows, contiguous))


def _plan_key(query_chunk: int, group_rows: int, pad_slack: float, fold: bool, buckets: int) -> tuple:
    """The memo key of a forward's plan; the per-call index arrays derived from it extend this key."""
    return ("attention_plan", query_chunk, group_rows, pad_slack, fold, buckets)


def planned_attention(meta: AttentionMetadata, query_chunk: int, group_rows: int,
                      pad_slack: float = PAD_SLACK, fold: bool = False, buckets: int = 0) -> AttentionPlan:
    """`plan_attention` for this forward pass, built by the first layer and shared by every other one."""
    return _memo(meta, _plan_key(query_chunk, group_rows, pad_slack, fold, buckets),
                 lambda: plan_attention(meta.cu_seqlens_q_host, meta.context_lens_host, query_chunk=query_chunk,
                                        group_rows=group_rows, pad_slack=pad_slack,
                                        block_tables=meta.block_tables_host if fold else None,
                                        block_size=meta.block_size, buckets=buckets))


def paged_attention(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    meta: AttentionMetadata,
    scale: float,
    query_chunk: int = 512,
    *,
    group_rows: int | None = None,
    pad_slack: float = PAD_SLACK,
    contiguous_kv: bool = True,
    fold_followers: bool = False,
    new_kv: tuple[mx.array, mx.array] | None = None,
    shape_buckets: int = 0,
) -> mx.array:
    """Attention of the packed new tokens `q [T, Hq, D]` over each sequence's cached + new KV -> `[T, Hq, D]`.

    Query token j of sequence s sees KV positions `< context_lens[s] - q_len[s] + j + 1`: MLX's "causal"
    mask is aligned lower-right, which is exactly that offset. GQA is native to `scaled_dot_product_attention`
    (K/V are not tiled), and its softmax runs in fp32 whatever the input dtype.

    The calls come from `plan_attention` (once per forward): sequences with the same cached prefix share one
    call, padded at the end within `pad_slack`, at most `group_rows` query rows (default `query_chunk`, which
    bounds the score matrix of unfused SDPA as chunking does); longer sequences run alone in `query_chunk`-row
    chunks; one-token sequences in length-sorted groups. `new_kv` (this layer's new K and V `[T, Hkv, D]`, as
    written to the caches) lets sequences with nothing cached read their keys without a gather. `contiguous_kv`
    copies K/V views for the CPU's unfused SDPA (see `gather_heads_major`). `fold_followers` folds the
    followers of a clip into one call over their shared cached context, gathered once (`attention_plan`).
    `shape_buckets` pads calls to lengths that repeat across passes (`attention_plan.bucketed`).
    Python-level work uses the host copies in `meta`, so this stays lazy.
    """
    check_attention_inputs(q, k_cache, v_cache, meta)
    if query_chunk < 1:
        raise ValueError(f"paged_attention: query_chunk must be >= 1, got {query_chunk}")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if new_kv is not None and any(x.shape != (meta.num_tokens, hkv, d) for x in new_kv):
        raise ValueError(f"paged_attention: new_kv must be K and V [num_tokens={meta.num_tokens}, {hkv}, {d}], got "
                         f"{[x.shape for x in new_kv]}")
    rows = query_chunk if group_rows is None else group_rows
    plan = planned_attention(meta, query_chunk, rows, pad_slack, fold_followers, shape_buckets)
    plan_key = _plan_key(query_chunk, rows, pad_slack, fold_followers, shape_buckets)
    hq = q.shape[1]
    fresh = None
    if new_kv is not None:  # the values the cache holds (cast to its dtype), then to the compute dtype, as a read
        fresh = tuple(PackedRows(x.astype(k_cache.dtype).astype(q.dtype)) for x in new_kv)
    q_rows = PackedRows(q)
    pieces = []
    for i, call in enumerate(plan.calls):
        memo = lambda build, i=i: _memo(meta, plan_key + (i, "q_tokens"), build)  # noqa: E731
        q_g = q_rows.rows(call.q_start, call.q_tokens, call.batch, call.q_len, memo)
        k, v = _call_keys(call, i, plan_key, k_cache, v_cache, meta, q.dtype, fresh, contiguous_kv)
        mask = call.mask
        if mask == "keys":
            ctx = meta.context_lens_host[list(call.seqs)]
            mask = _memo(meta, plan_key + (i, "key_mask"),
                         lambda: mx.array(np.arange(call.k_len)[None, :] < ctx[:, None])[:, None, None, :])
        elif mask == "visible":   # additive, in the compute dtype, built once per forward (CUDA's SDPA takes
            # no boolean mask: MLX would convert one in every layer)
            mask = _memo(meta, plan_key + (i, "visible", q.dtype), lambda: mx.where(
                mx.array(call.visible), mx.array(0.0, q.dtype), mx.array(-float("inf"), q.dtype))[:, None])
        o = mx.fast.scaled_dot_product_attention(q_g, k, v, scale=scale, mask=mask)  # [batch, Hq, q_len, D]
        pieces.append(o.transpose(0, 2, 1, 3).reshape(call.batch * call.q_len, hq, d))
    out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
    if plan.inverse is not None:   # the pieces are row-contiguous (concatenated, or SDPA's output reshaped)
        out = take_rows(out, _memo(meta, plan_key + ("inverse",), lambda: mx.array(plan.inverse)))
    return out
