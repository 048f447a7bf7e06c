"""One layer's attention alone on the batches the engine meets: the engine's attention against SDPA baselines."""
from __future__ import annotations

import gc
import time

import numpy as np

from .flops import lm_attention_flops
from .timing import ms_per_call

# name -> (new tokens per sequence, cached tokens per sequence, clips whose cached prefix blocks the sequences
# share, in equal runs; 0: none shared)
CASES = {"packed_prefill": ([2100] * 4, [0] * 4, 0), "mixed_30000_5000_10": ([30000, 5000, 10], [0, 0, 0], 0),
         # questions over one clip's cached prefix, as the engine lays them out (shared blocks) and as before (not)
         "follower": ([40] * 12, [2100] * 12, 1), "follower_unshared": ([40] * 12, [2100] * 12, 0),
         # a step's followers: three questions over each of eight clips
         "follower_8_clips": ([40] * 24, [2100] * 24, 8)}
SMALL = {"packed_prefill": ([21] * 4, [0] * 4, 0), "mixed_30000_5000_10": ([300, 50, 1], [0, 0, 0], 0),
         "follower": ([6] * 12, [64] * 12, 1), "follower_unshared": ([6] * 12, [64] * 12, 0),
         "follower_8_clips": ([6] * 24, [64] * 24, 8)}


def attention_cases(dtype, engine_attention, repeats: int, shape: dict, small: bool = False) -> dict:
    """Rows per case (each time the median per call of ten calls queued per sync): `sdpa_per_sequence_ms` (the portable
    path as it was before grouping: one SDPA per sequence, 512-row chunks, K/V gathered from the cache),
    `engine_attention_ms` (the engine's attention function called as a layer calls it, new K/V included, its
    plan built inside every timed call as in a one-layer forward), `engine_attention_planned_ms` (the plan
    already built, as in layers 2..N), `engine_attention_first_call_ms` (its very first call on these shapes:
    plan, compilation, cuDNN graph build), `engine_attention_sdpa_calls`, and `sdpa_padded_ms` (one SDPA over
    the batch padded to its longest query and context, K/V already gathered: what a padded engine pays for
    attention alone)."""
    rng = np.random.default_rng(0)
    out = {}
    for name, (q_lens, cached, clips) in (SMALL if small else CASES).items():
        out[name] = _case(rng, dtype, engine_attention, repeats, shape, q_lens, cached, clips)
        gc.collect()   # the case's cache and padded copies go before the next one's
    return out


def case_batch(rng, q_lens, cached, clips: int, heads: tuple[int, int, int], dtype, *, shuffle_blocks: bool,
               block_size: int = 16):
    """A case's batch over a paged cache: with `clips`, the sequences in equal runs share their clip's cached
    prefix blocks, as a clip's followers do in the engine's pool."""
    from batchjob.metal_backend.probe import make_ragged_batch

    hq, hkv, d = heads
    return make_ragged_batch(rng, q_lens, cached, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size,
                             dtype=dtype, shuffle_blocks=shuffle_blocks,
                             prefix_groups=[i * clips // len(q_lens) if clips else -1 for i in range(len(q_lens))],
                             shared_blocks=min(cached) // block_size if clips else 0)


def padded_batch(q_lens, cached, heads: tuple[int, int, int], dtype):
    """q, k, v `[sequences, heads, length, head_dim]` padded to the batch's longest query and context, random: the
    inputs of the padded SDPA baseline (one call, K/V already gathered)."""
    import mlx.core as mx

    hq, hkv, d = heads
    lq, lc = max(q_lens), max(q + c for q, c in zip(q_lens, cached))
    return tuple(mx.random.normal((len(q_lens), h, n, d)).astype(dtype) for h, n in ((hq, lq), (hkv, lc), (hkv, lc)))


def _case(rng, dtype, engine_attention, repeats: int, shape: dict, q_lens, cached, clips: int) -> dict:
    import mlx.core as mx

    from batchjob.metal_backend import paged_attention
    from batchjob.metal_backend.attention_plan import AttentionPlan

    hq, hkv, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    b = case_batch(rng, q_lens, cached, clips, (hq, hkv, d), dtype, shuffle_blocks=False)
    scale = d ** -0.5
    row = {"flops": sum(lm_attention_flops(q, c, {"heads": hq, "head_dim": d}) for q, c in zip(q_lens, cached))}

    def bench(fn):   # ten calls queued per sync, as a forward's layers queue them (a sync per call timed the
        return ms_per_call(fn, inner=10, repeats=repeats)   # launch-and-wait round trip of sub-ms calls instead)

    row["sdpa_per_sequence_ms"] = bench(lambda: paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale,
                                                                group_rows=1))
    new_kv = tuple(c.reshape(-1, hkv, d)[b.meta.slot_mapping] for c in (b.k_cache, b.v_cache))
    mx.eval(new_kv)

    def engine(replan: bool):
        if replan:
            b.meta.plan_cache.clear()
        return engine_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, new_kv=new_kv)

    try:
        b.meta.plan_cache.clear()
        t0 = time.perf_counter()
        mx.eval(engine(True))
        row["engine_attention_first_call_ms"] = (time.perf_counter() - t0) * 1e3
        row["engine_attention_ms"] = bench(lambda: engine(True))
        row["engine_attention_planned_ms"] = bench(lambda: engine(False))
        plans = [v for v in b.meta.plan_cache.values() if isinstance(v, AttentionPlan)]
        if plans:
            row["engine_attention_sdpa_calls"] = plans[0].num_calls
            row["engine_attention_folded_calls"] = sum(c.key_slots is not None for c in plans[0].calls)
    except Exception as exc:
        row["engine_attention_error"] = f"{type(exc).__name__}: {exc}"[:300]
    qp, kp, vp = padded_batch(q_lens, cached, (hq, hkv, d), dtype)
    try:
        row["sdpa_padded_ms"] = bench(lambda: mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=scale,
                                                                                   mask="causal"))
    except Exception as exc:
        row["sdpa_padded_error"] = f"{type(exc).__name__}: {exc}"[:300]
    best = min(row[k] for k in ("sdpa_per_sequence_ms", "engine_attention_ms") if k in row)
    row["best_paged_ms"] = best
    row["best_tflops"] = row["flops"] / best / 1e9
    return row
