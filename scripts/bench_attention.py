#!/usr/bin/env python
"""Packed paged varlen attention vs mlx_lm-style padded attention, on the published case study.

Case study: three prompts of 3,000 + 500 + 1 tokens (`--scale` for the full 30,000 + 5,000 + 10) prefilled in
one forward pass. Padded: `[B, H, T_max, D]` queries/keys/values with a causal + padding mask, as a batched
mlx_lm forward does. Packed: the new tokens on one flat axis over a paged cache (portable MLX path).
Second case: 64 one-token queries over 128- and 2,048-token contexts (decode-like).

Prints median time and peak memory (MLX allocator, inputs + working set) of each, and packed/padded ratios,
all from this one run. Usage: `python scripts/bench_attention.py [--scale] [--repeats 3] [--dtype float32]`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
import numpy as np

from batchjob.metal_backend import paged_attention
from batchjob.metal_backend.probe import make_ragged_batch


def padded_inputs(batch, num_q_heads: int):
    """Left-padded `[B, H, Q_max, D]` queries, `[B, Hkv, T_max, D]` keys/values and a boolean mask (causal with
    each row's context offset, padding hidden), as a batched mlx_lm forward builds them."""
    q_max, t_max, b = max(batch.q_lens), max(batch.context_lens), len(batch.q_lens)
    hkv, d = batch.k_seqs[0].shape[1:]
    q = np.zeros((b, num_q_heads, q_max, d), np.float32)
    k = np.zeros((b, hkv, t_max, d), np.float32)
    v = np.zeros((b, hkv, t_max, d), np.float32)
    mask = np.zeros((b, 1, q_max, t_max), bool)
    mask[:, :, :, -1] = True  # padding query rows see one real key, so they stay finite
    start = 0
    for i, (ql, ctx) in enumerate(zip(batch.q_lens, batch.context_lens)):
        q[i, :, q_max - ql :] = batch.q_host[start : start + ql].transpose(1, 0, 2)
        k[i, :, t_max - ctx :] = batch.k_seqs[i].transpose(1, 0, 2)
        v[i, :, t_max - ctx :] = batch.v_seqs[i].transpose(1, 0, 2)
        pos = np.arange(t_max) - (t_max - ctx)  # key column -> position in the sequence (< 0: padding)
        limit = ctx - ql + np.arange(ql) + 1  # query j sees positions < limit[j]
        mask[i, 0, q_max - ql :] = (pos[None, :] >= 0) & (pos[None, :] < limit[:, None])
        start += ql
    return q, k, v, mask


def measure(fn, inputs_fn, repeats: int):
    """Median seconds and peak bytes (inputs + working set) for `fn(*inputs)`, inputs alone on the device."""
    gc.collect()
    mx.clear_cache()
    inputs = inputs_fn()
    mx.eval(inputs)
    mx.eval(fn(*inputs))  # warm-up
    mx.clear_cache()
    mx.reset_peak_memory()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn(*inputs))
        times.append(time.perf_counter() - t0)
    peak = mx.get_peak_memory()
    del inputs
    return statistics.median(times), peak


def compare(label, lens, cached, args, rng, dtype):
    batch = make_ragged_batch(rng, lens, cached, num_q_heads=args.heads, num_kv_heads=args.kv_heads,
                              head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, spare_blocks=0)
    scale = args.head_dim**-0.5
    host = (np.array(batch.q.astype(mx.float32)), np.array(batch.k_cache.astype(mx.float32)),
            np.array(batch.v_cache.astype(mx.float32)))
    meta = batch.meta
    del batch.q, batch.k_cache, batch.v_cache

    def packed_inputs():
        return [mx.array(a).astype(dtype) for a in host]

    def packed(q, k, v):
        return paged_attention(q, k, v, meta, scale)

    score_bytes = len(lens) * args.heads * max(lens) * max(batch.context_lens) * 4
    if score_bytes > args.max_padded_gib * 2**30:  # the padded baseline materializes B x H x Q x T scores here
        t_pk, m_pk = measure(packed, packed_inputs, args.repeats)
        print(f"| {label} | skipped: needs {score_bytes / 2**30:,.1f} GiB of scores | {t_pk * 1e3:,.1f} | - | - | "
              f"{m_pk / 2**20:,.0f} | - | - |")
        return None, None
    pq, pk, pv, pmask = padded_inputs(batch, args.heads)

    def padded_inputs_fn():
        return [mx.array(pq).astype(dtype), mx.array(pk).astype(dtype), mx.array(pv).astype(dtype), mx.array(pmask)]

    def padded(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    # Same answers first (rows that are real tokens), so the timing compares like with like.
    out_packed = np.array(packed(*packed_inputs()).astype(mx.float32))
    out_padded = np.array(padded(*padded_inputs_fn()).astype(mx.float32))
    start, worst = 0, 0.0
    for i, (ql, ctx) in enumerate(zip(batch.q_lens, batch.context_lens)):
        real = out_padded[i, :, -ql:].transpose(1, 0, 2)
        worst = max(worst, float(np.abs(real - out_packed[start : start + ql]).max()))
        start += ql
    t_pk, m_pk = measure(packed, packed_inputs, args.repeats)
    t_pd, m_pd = measure(padded, padded_inputs_fn, args.repeats)
    print(f"| {label} | {t_pd * 1e3:,.1f} | {t_pk * 1e3:,.1f} | {t_pd / t_pk:.2f}x | {m_pd / 2**20:,.0f} | "
          f"{m_pk / 2**20:,.0f} | {m_pk / m_pd:.2f} | {worst:.1e} |")
    return t_pd / t_pk, m_pk / m_pd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", action="store_true", help="full published case: 30,000 + 5,000 + 10 tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16, help="query heads (Qwen2.5-VL-3B: 16)")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads (Qwen2.5-VL-3B: 2)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="float32 on CPU (half precision has no fast CPU matmul)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--max-padded-gib", type=float, default=8.0,
                    help="skip the padded baseline when its score matrix alone would exceed this (e.g. --scale)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    rng = np.random.default_rng(0)
    lens = [30_000, 5_000, 10] if args.scale else [3_000, 500, 1]
    print(f"device {mx.default_device()}, {args.heads} q heads / {args.kv_heads} KV heads, D={args.head_dim}, "
          f"{args.dtype}, block {args.block_size}, median of {args.repeats}\n")
    print("| case | padded ms | packed ms | speedup | padded MiB | packed MiB | mem ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    speed, mem = compare(" + ".join(f"{n:,}" for n in lens) + " prefill", lens, [0] * len(lens), args, rng, dtype)
    if not args.skip_decode:
        for ctx in (128, 2048):
            compare(f"64 x 1 token over {ctx:,}", [1] * 64, [ctx - 1] * 64, args, rng, dtype)
    if speed is None:
        print("\nacceptance: not evaluated (padded baseline skipped); rerun without --scale")
        return
    ok = speed >= 2 and mem <= 0.5
    print(f"\nacceptance (prefill case: >= 2x faster, <= 0.5x memory): {'PASS' if ok else 'FAIL'} "
          f"({speed:.2f}x, {mem:.2f})")


if __name__ == "__main__":
    main()
