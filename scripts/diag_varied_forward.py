"""Diagnostic: what a forward over a batch it has never seen costs, against the same forward again.

`diag_classify_overhead.py --vary` found engine calls of varied questions slower than the forward alone, even with
the attention's shapes bucketed; `diag_shape_costs.py` put the ops' own first-call costs far below that. This
runs the engine's forward the way a job meets it: for each of `--batches` fresh batches (questions 0-7 words
longer, drawn anew), the same scheduled batch `--repeats` + 1 times. Each forward is split at its first
`mx.eval`: unpaced (`--lag 0`) that is the one closing the pass, so `build` is Python building the lazy graph (plan,
metadata, uploads, every layer's ops) and `eval` MLX encoding and running it; paced (runner.LAYER_LAG), the first
wait for a layer. Per forward: peak memory, MLX's buffer cache after it and the CUDA memory pool's reserve.
`--cache-limit-gb`, `--pool-keep` (the pool keeps what is freed) and `--lag` try the allocator's settings and the
pacing. With `--cupti` the first and second forward of one batch run under torch.profiler (CUPTI sees every
kernel in the process, MLX's included): GPU busy time, kernel count, and the host time of the CUDA runtime and
driver calls by name (cudaFree, which waits for the whole device, among them).

    python3 scripts/diag_varied_forward.py [--model qwen3_vl] [--batches 4] [--repeats 2] [--buckets N]
        [--cupti] [--cache-limit-gb G] [--pool-keep] [--lag N] [--clips N] [--smoke] [--json F]
Environment knobs are MLX's own (MLX_USE_CUDA_GRAPHS, MLX_CUDA_GRAPH_CACHE_SIZE, MLX_MAX_OPS_PER_BUFFER).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.workload import add_diag_arguments  # noqa: E402


def timed_forward(mx, run) -> dict:
    """ms of one forward, split at the first `mx.eval` it calls (`count_host_syncs` records it); its memory
    figures."""
    from benchlib.syncs import count_host_syncs

    mx.synchronize()
    mx.reset_peak_memory()
    with count_host_syncs() as log:
        run()
    mx.synchronize()
    total = time.perf_counter() - log.start
    at = total if log.first_eval_s is None else log.first_eval_s
    reserved = pool_attribute(RESERVED_MEM_CURRENT) / 2**30 if mx.default_device() == mx.gpu else 0.0
    return {"build": at * 1e3, "eval": (total - at) * 1e3, "total": total * 1e3, "evals": log.evals,
            "peak_gb": mx.get_peak_memory() / 2**30, "cache_gb": mx.get_cache_memory() / 2**30,
            "pool_reserved_gb": reserved}


RELEASE_THRESHOLD, RESERVED_MEM_CURRENT = 4, 5   # CUmemPool_attribute


def default_pool(device: int = 0):
    """(driver, the device's default memory pool: where MLX's stream-ordered allocations come from)."""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    if driver.cuDeviceGet(ctypes.byref(dev), device) or driver.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev):
        raise RuntimeError("no default memory pool")
    return driver, pool


def pool_attribute(attr: int, value: int | None = None) -> int:
    """Read (or set, then read) a 64-bit attribute of the default pool."""
    import ctypes

    driver, pool = default_pool()
    v = ctypes.c_uint64(0 if value is None else value)
    if value is not None and driver.cuMemPoolSetAttribute(pool, attr, ctypes.byref(v)):
        raise RuntimeError(f"cuMemPoolSetAttribute({attr}) refused")
    if driver.cuMemPoolGetAttribute(pool, attr, ctypes.byref(v)):
        raise RuntimeError(f"cuMemPoolGetAttribute({attr}) refused")
    return v.value


def profiled(mx, run, tmp: Path, tag: str) -> dict:
    """`timed_forward` under torch.profiler's CUDA activity; the plain timing, with the reason, where torch or its
    profiler cannot run here."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            times = timed_forward(mx, run)
        trace = tmp / f"{tag}.json"
        prof.export_chrome_trace(str(trace))
        from benchlib.cupti import cupti_summary

        return {**times, **cupti_summary(trace)}
    except Exception as e:  # a diagnostic: say why and go on with what can be timed
        print(f"--cupti: {type(e).__name__}: {e}")
        return {**timed_forward(mx, run), "cupti_error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_diag_arguments(ap)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cupti", action="store_true", help="profile batch 1's first and second forward (torch)")
    ap.add_argument("--cache-limit-gb", type=float, default=None, help="mx.set_cache_limit after the engine's own")
    ap.add_argument("--pool-keep", action="store_true",
                    help="the default memory pool keeps freed memory (release threshold: all) instead of trimming it")
    ap.add_argument("--lag", type=int, default=None, help="runner.LAYER_LAG (layers queued ahead; 0: unpaced)")
    ap.add_argument("--clips", type=int, default=8,
                    help="clips in the equal batch (its first step holds at most the engine's token budget)")
    a = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    from batchjob.engine import runner
    from benchlib.profile_lm import _one_forward_batch
    from benchlib.workload import cache_features, diag_engine, drop_features, equal_and_ragged, fresh, vary_questions

    diag = diag_engine(a.model, smoke=a.smoke, layers=a.layers, buckets=a.buckets, tag="varied")
    bench = diag.bench
    clf, ckpt = bench.classifier, bench.checkpoint
    traces = Path(tempfile.mkdtemp(prefix="bj-cupti-"))
    if a.cache_limit_gb is not None:
        mx.set_cache_limit(int(a.cache_limit_gb * 2**30))   # raised or lowered: the engine's cap only lowers
    if a.lag is not None:
        runner.LAYER_LAG = a.lag
    if a.pool_keep:
        print("pool release threshold:", pool_attribute(RELEASE_THRESHOLD, 2**64 - 1))
    cache_limit = clf.buffer_cache_bytes if a.cache_limit_gb is None else int(a.cache_limit_gb * 2**30)
    memory = {**clf.memory.as_dict(), "max_num_batched_tokens": clf.max_num_batched_tokens,
              "buffer_cache_gb": cache_limit / 2**30, "active_gb": mx.get_active_memory() / 2**30}
    print("memory:", {k: v for k, v in memory.items() if not k.endswith("_bytes")})
    rng = np.random.default_rng(0)
    batches = equal_and_ragged(diag, rng, a.clips)
    knobs = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    report: dict = {"model": a.model, "buckets": diag.buckets, "mlx_env": knobs, "memory": memory,
                    "layer_lag": runner.LAYER_LAG}
    print(f"buckets {report['buckets']}, MLX env {knobs}")
    for name, reqs in batches.items():
        rows = []
        for b in range(a.batches + 1):   # batch 0 warms what any forward builds once: not kept
            call = vary_questions(fresh(reqs, f"{name}{b}"), rng)
            cache_features(bench, call)
            with mx.stream(clf._device):
                scheduler, batch = _one_forward_batch(clf, call)
                try:
                    video = clf._video_rows(batch, call)

                    def run():
                        runner.forward(ckpt.model, batch, clf.kv_cache, clf._attention, video,
                                       ckpt.family.num_deepstack)
                    tokens = sum(s.num_new for s in batch)
                    if a.cupti and b == 1:
                        forwards = [profiled(mx, run, traces, f"{name}-first"),
                                    profiled(mx, run, traces, f"{name}-again")]
                        forwards += [timed_forward(mx, run) for _ in range(a.repeats - 1)]
                    else:
                        forwards = [timed_forward(mx, run) for _ in range(a.repeats + 1)]
                finally:
                    scheduler.abort_all()
            drop_features(bench, call)
            if b:
                rows.append({"tokens": tokens, "first": forwards[0], "again": forwards[1:]})
                print(f"{name} batch {b} ({tokens} tokens): first "
                      + " ".join(f"{k} {v:.1f}" for k, v in forwards[0].items() if isinstance(v, (int, float)))
                      + " | again " + ", ".join(f"{f['total']:.1f} (build {f['build']:.1f})" for f in forwards[1:]))
                print(f"  peak {forwards[0]['peak_gb']:.2f} GiB, cache after {forwards[-1]['cache_gb']:.2f} GiB, pool "
                      f"reserved {forwards[-1]['pool_reserved_gb']:.2f} GiB")
                for f in forwards[:2]:
                    if "host_calls" in f:
                        print(f"  cupti: busy {f['gpu_busy_ms']:.1f} ms span {f['gpu_span_ms']:.1f} kernels "
                              f"{f['kernels']} cudaFree by thread {f['cuda_free_ms_by_thread']} host {f['host_calls']}")

        def med(key, part, rows=rows):
            vals = [r["first"][part] if key == "first" else statistics.median(x[part] for x in r["again"])
                    for r in rows]
            return statistics.median(vals)
        summary = {f"{key}_{part}_ms": med(key, part) for key in ("first", "again") for part in ("build", "eval",
                                                                                                  "total")}
        report[name] = {"batches": rows, "median": summary}
        print(f"{name} medians: " + " ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
