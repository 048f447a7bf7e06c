"""Diagnostic: where one layer's attention time goes on a ragged batch (prompts of different lengths over a shared
cached system-prompt block), piece by piece, on the device MLX runs on.

The engine's plan pads such prompts into groups (`pad_slack`): each call's query rows gathered (`mx.take`), its
keys gathered from the paged cache, the outputs concatenated and put back in token order with another gather.
MLX's CUDA gather moves one element per thread, two bytes at a time for bf16. This times the engine's attention
(`gpu_portable_attention`), every prompt in a call of its own instead (query rows a view, nothing padded), both
alone and queued behind a layer's gate/up GEMM (as a forward queues them), then each piece of the engine's plan
alone, and its gathers done as `mx.take` of bf16 elements against 64-bit words of the same bytes (`take_rows`).
Lengths: bench_gpu's ragged batch (Qwen2.5-VL-7B or Qwen3-VL-8B head shapes) or `--lengths`.

    python3 scripts/diag_ragged_attention.py [--model qwen2_5_vl|qwen3_vl] [--repeats 5] [--small] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.timing import ms_per_call  # noqa: E402

HEADS = {"qwen2_5_vl": (28, 4, 128), "qwen3_vl": (32, 8, 128)}
RAGGED = {"qwen2_5_vl": [2119, 1863, 1607, 1351, 1095, 839, 2119, 1863],
          "qwen3_vl": [1737, 1527, 1317, 1107, 897, 687, 1737, 1527]}
PREFIX = 16   # the cached system-prompt block every prompt shares


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(HEADS), default="qwen2_5_vl")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="short prompts (a CPU smoke run)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="other prompt lengths (new tokens)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    from batchjob.metal_backend.attention import (gather_heads_major, gather_rows, paged_attention,
                                                  planned_attention, take_rows)
    from batchjob.metal_backend.probe import make_ragged_batch
    from batchjob.metal_backend.selection import GPU_GROUP_ROWS, GPU_QUERY_CHUNK, gpu_portable_attention

    hq, hkv, d = HEADS[a.model]
    q_lens = a.lengths or ([n // 8 for n in RAGGED[a.model]] if a.small else RAGGED[a.model])   # > FOLD_MAX_Q
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    rng = np.random.default_rng(0)
    b = make_ragged_batch(rng, q_lens, [PREFIX] * len(q_lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                          block_size=16, dtype=dtype, shuffle_blocks=False, prefix_groups=[0] * len(q_lens),
                          shared_blocks=PREFIX // 16)
    t = b.meta.num_tokens
    qk = mx.random.normal((t, hq + hkv, d)).astype(dtype)   # q as the layer hands it over: heads of a stacked array
    q = qk[:, :hq]
    new_kv = tuple(c.reshape(-1, hkv, d)[b.meta.slot_mapping] for c in (b.k_cache, b.v_cache))
    mx.eval(qk, new_kv)
    attention = gpu_portable_attention(dtype)
    scale = d ** -0.5
    plan = planned_attention(b.meta, GPU_QUERY_CHUNK, GPU_GROUP_ROWS, fold=True)   # the engine's plan
    time_ = lambda fn: ms_per_call(fn, inner=10, repeats=a.repeats)  # noqa: E731
    row: dict = {"model": a.model, "q_lens": q_lens, "prefix": PREFIX, "heads": [hq, hkv, d], "dtype": str(dtype),
                 "calls": [{"seqs": len(c.seqs), "q_len": c.q_len, "k_len": c.k_len, "q_view": c.q_start is not None}
                           for c in plan.calls], "inverse": plan.inverse is not None}
    row["engine_ms"] = time_(lambda: attention(q, b.k_cache, b.v_cache, b.meta, scale, new_kv=new_kv))
    # Behind a layer's worth of matmul (the gate/up GEMM at these tokens), as a forward queues attention: the host
    # builds the calls while the device multiplies, so what counts is their device time, not their launch cost.
    x, w = (mx.random.normal(shape).astype(dtype) for shape in ((t, 4096), (4096, 12288)))
    mx.eval(x, w)
    row["matmul_ms"] = time_(lambda: x @ w)
    row["engine_behind_matmul_ms"] = time_(lambda: [x @ w, attention(q, b.k_cache, b.v_cache, b.meta, scale,
                                                                      new_kv=new_kv)]) - row["matmul_ms"]
    # the alternative plan: every prompt its own call (query rows a view, nothing padded, outputs in token order)
    def per_sequence():
        return paged_attention(q, b.k_cache, b.v_cache, b.meta, scale, query_chunk=GPU_QUERY_CHUNK, group_rows=1,
                               contiguous_kv=False, new_kv=new_kv)

    row["engine_per_sequence_ms"] = time_(per_sequence)
    row["engine_per_sequence_behind_matmul_ms"] = time_(lambda: [x @ w, per_sequence()]) - row["matmul_ms"]

    # the pieces, as the plan makes them
    nb, bs = b.k_cache.shape[:2]
    q_idx, kv_rows, prepared = [], [], []
    for c in plan.calls:
        q_idx.append(None if c.q_start is not None else mx.array(c.q_tokens))
        tables = b.meta.block_tables_host[list(c.seqs)]
        kv_rows.append(gather_rows(tables, c.k_len, bs, hkv, b.meta.context_lens_host[list(c.seqs)]))
    flat_k, flat_v = (x.reshape(nb * bs * hkv, d) for x in (b.k_cache, b.v_cache))

    def q_take(as_words: bool):
        out = []
        for c, idx in zip(plan.calls, q_idx):
            if idx is None:
                continue
            if as_words:   # from the stacked parent (contiguous), then the q heads
                out.append(take_rows(qk, idx)[:, :hq])
            else:
                out.append(mx.take(q, idx, axis=0))
        return out

    def kv_take(as_words: bool):
        out = []
        for rows in kv_rows:
            if isinstance(rows, tuple):   # an ascending run of blocks: a slice, no gather
                continue
            for flat in (flat_k, flat_v):
                out.append(take_rows(flat, rows) if as_words else mx.take(flat, rows, axis=0))
        return out

    row["q_take_ms"] = time_(lambda: q_take(False))
    row["q_take_words_ms"] = time_(lambda: q_take(True))
    row["kv_take_ms"] = time_(lambda: kv_take(False))
    row["kv_take_words_ms"] = time_(lambda: kv_take(True))
    for c, idx, rows in zip(plan.calls, q_idx, kv_rows):   # each call's inputs made once: SDPA alone
        qg = (q[c.q_start:c.q_start + c.n * c.q_len] if idx is None else mx.take(q, idx, axis=0))
        qg = qg.reshape(c.n, c.q_len, hq, d).transpose(0, 2, 1, 3)
        tables = b.meta.block_tables_host[list(c.seqs)]
        kg, vg = (gather_heads_major(cache, tables, c.k_len, dtype, rows, contiguous=False)
                  for cache in (b.k_cache, b.v_cache))
        prepared.append((qg, kg, vg, c))
    mx.eval([x for p in prepared for x in p[:3]])

    def sdpa_only():
        return [mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=scale, mask=c.mask)
                for qg, kg, vg, c in prepared]

    row["sdpa_only_ms"] = time_(sdpa_only)
    outs = [o.transpose(0, 2, 1, 3).reshape(-1, hq, d) for o in sdpa_only()]
    mx.eval(outs)
    inverse = mx.array(plan.inverse) if plan.inverse is not None else None

    def put_back(as_words: bool):
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        if inverse is None:
            return out
        return take_rows(out, inverse) if as_words else mx.take(out, inverse, axis=0)

    row["concat_inverse_ms"] = time_(lambda: put_back(False))
    row["concat_inverse_words_ms"] = time_(lambda: put_back(True))
    same = mx.array_equal(put_back(True), put_back(False)).item() and all(
        mx.array_equal(x, y).item() for x, y in zip(q_take(True), q_take(False))) and all(
        mx.array_equal(x, y).item() for x, y in zip(kv_take(True), kv_take(False)))
    row["words_bit_identical"] = bool(same)
    for key, value in row.items():
        print(f"{key}: {round(value, 4) if isinstance(value, float) else value}")
    if a.json:
        a.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
