#!/usr/bin/env python
"""The Hopper paged attention kernel (engine/cuda_attention.py) against the engine's portable path, one layer.

For each batch (bench_gpu's equal and ragged prefills and its attention cases, longer ragged prompts around
`LONG_PROMPT`, questions over cached clips, small probe batches): the largest and mean error of the kernel and of
the portable path in half precision against an fp32 reference (the portable path on fp32 copies of the same
values), and the median time (ten calls per sync) of the portable path, the kernel, the engine's choice between
them (`HopperAttention`), and one SDPA call over the batch padded to its longest query and context (bench_gpu's
baseline for followers).

Usage (an NVIDIA Hopper GPU): `python scripts/diag_cuda_attention.py [--heads 32 8 128] [--json F]`.
"""
from __future__ import annotations

import argparse
import json
import zlib

import numpy as np

from benchlib.attention_cases import CASES, case_batch, padded_batch
from benchlib.flops import lm_attention_flops
from benchlib.timing import ms_per_call

# name -> (new tokens per sequence, cached tokens per sequence, clips whose cached prefix the sequences share)
BATCHES = {"equal_8x2119": ([2119] * 8, [0] * 8, 0),
           "ragged_8": ([int(x) for x in np.linspace(839, 2119, 8)], [16] * 8, 1),
           **CASES,
           # questions over cached clips in other counts than bench_gpu's (which one clip's 12 are, above)
           "follower_1": ([40], [2100], 1), "follower_4": ([40] * 4, [2100] * 4, 1),
           "follower_24": ([40] * 24, [2100] * 24, 1), "follower_3_clips": ([40] * 9, [2100] * 9, 3),
           "follower_long_clip": ([40] * 12, [6000] * 12, 1),
           "ragged_3x4096": ([4096, 3000, 2000], [16] * 3, 1),
           "ragged_2x8192": ([8192, 6000], [16] * 2, 1),
           "equal_4x4096": ([4096] * 4, [0] * 4, 0),
           "one_8192": ([8192], [0], 0), "one_16384": ([16384], [0], 0),
           "probe_prefill": ([1, 16, 37, 5, 64, 150, 70], [31, 0, 32, 3, 16, 0, 40], 0),
           "probe_decode": ([1, 1, 1, 1], [0, 15, 16, 70], 0)}


def run_case(mx, engine, name, q_lens, cached, clips, heads, dtype, repeats):
    from batchjob.metal_backend import paged_attention

    hq, hkv, d = heads
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    b = case_batch(rng, q_lens, cached, clips, heads, dtype, shuffle_blocks=True)
    scale = d ** -0.5
    new_kv = tuple(c.reshape(-1, hkv, d)[b.meta.slot_mapping] for c in (b.k_cache, b.v_cache))
    want = paged_attention(*[x.astype(mx.float32) for x in (b.q, b.k_cache, b.v_cache)], b.meta, scale)
    row = {"q_lens": q_lens, "cached": cached, "clips": clips,
           "flops": sum(lm_attention_flops(q, c, {"heads": hq, "head_dim": d}) for q, c in zip(q_lens, cached))}
    fns = {"portable": lambda: engine.portable(b.q, b.k_cache, b.v_cache, b.meta, scale, new_kv=new_kv),
           "kernel": lambda: engine.kernel(b.q, b.k_cache, b.v_cache, b.meta, scale),
           "engine": lambda: engine(b.q, b.k_cache, b.v_cache, b.meta, scale, new_kv=new_kv)}
    for tag, fn in fns.items():
        got = fn().astype(mx.float32)
        err = mx.abs(got - want)
        row[f"{tag}_max_err"] = float(err.max().item())
        row[f"{tag}_mean_err"] = float(err.mean().item())
        row[f"{tag}_finite"] = bool(mx.all(mx.isfinite(got)).item())
        row[f"{tag}_ms"] = ms_per_call(fn, inner=10, repeats=repeats)
        row[f"{tag}_tflops"] = row["flops"] / row[f"{tag}_ms"] / 1e9
    row["engine_chose"] = "portable" if b.meta.plan_cache.get("hopper_prefers_portable") else "kernel"
    lq, lc = max(q_lens), max(q + c for q, c in zip(q_lens, cached))
    if len(q_lens) * hq * lq * lc <= 2 ** 31:   # the padded baseline's scores fit (the long prompts' would not)
        qp, kp, vp = padded_batch(q_lens, cached, heads, dtype)
        row["sdpa_padded_ms"] = ms_per_call(lambda: mx.fast.scaled_dot_product_attention(qp, kp, vp, scale=scale,
                                                                                         mask="causal"),
                                            inner=10, repeats=repeats)
        row["engine_vs_padded"] = row["sdpa_padded_ms"] / row["engine_ms"]
    row["kernel_vs_portable"] = row["portable_ms"] / row["kernel_ms"]
    row["engine_vs_portable"] = row["portable_ms"] / row["engine_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs=3, default=[28, 4, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--cases", nargs="*", default=list(BATCHES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import mlx.core as mx

    from batchjob.engine.cuda_attention import select_hopper_attention
    from batchjob.metal_backend.selection import gpu_portable_attention

    dtype = getattr(mx, args.dtype)
    engine, why = select_hopper_attention(dtype, tuple(args.heads), 16, gpu_portable_attention(dtype))
    print(why, flush=True)
    if engine is None:
        return 2
    rows = {}
    print("| case | portable ms | kernel ms | kernel vs portable | engine chose | kernel TFLOP/s | "
          "max err portable / kernel | padded SDPA ms | engine vs padded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        rows[name] = r = run_case(mx, engine, name, *BATCHES[name], tuple(args.heads), dtype, args.repeats)
        padded = (f"{r['sdpa_padded_ms']:.3f} | {r['engine_vs_padded']:.2f}x" if "sdpa_padded_ms" in r
                  else "- | -")
        print(f"| {name} | {r['portable_ms']:.3f} | {r['kernel_ms']:.3f} | {r['kernel_vs_portable']:.2f}x | "
              f"{r['engine_chose']} | {r['kernel_tflops']:.0f} | {r['portable_max_err']:.1e} / "
              f"{r['kernel_max_err']:.1e} | {padded} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heads": args.heads, "dtype": args.dtype, "selection": why, "cases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
