"""Diagnostic: what one engine call costs beyond its forward pass, call by call.

bench_gpu's LM prefill of a ragged batch (eight prompts of different lengths, their vision features already
computed) took 35-56 ms more per `classify` call than the same forward repeated alone, and its median moved by
10% from machine to machine. This builds bench_gpu's model (random weights in the published shape), then runs
`--calls` calls of the equal batch and of the ragged batch in turn, each under fresh media ids, timing in every
call: preparing the requests, scheduling, the vision rows, the forward (graph build to logits on the host), the
results, the scheduler's bookkeeping after the step, releasing the clips' features (a clip's tail kept), and the
rest; Python's garbage collections during the call are counted. The forward alone, repeated over one
scheduled batch, is the reference. `--gc-off`: the same with the collector disabled. `--vary`: each call's
questions a few words longer or shorter (as a job's calls are), so every call meets shapes it has not seen
(cuDNN graphs, compiled kernels, GEMM plans are cached per shape). `--buckets N`: the attention's calls padded to
N lengths per octave (`attention_plan.bucketed`; 0 = exact shapes) instead of the engine's setting.

    python3 scripts/diag_classify_overhead.py [--model qwen3_vl] [--calls 8] [--gc-off] [--vary] [--buckets N]
        [--smoke] [--json F]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.workload import add_diag_arguments  # noqa: E402

PHASES = ("prepare", "schedule", "video_rows", "forward", "results", "finish_step", "release_features")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_diag_arguments(ap)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--gc-off", action="store_true")
    ap.add_argument("--vary", action="store_true",
                    help="every call's questions a few words longer or shorter, as a job's are: new shapes each call")
    a = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    from batchjob.engine import classifier as classifier_module
    from batchjob.engine import runner
    from batchjob.engine.scheduler import Scheduler
    from benchlib.gpu_monitor import GpuMonitor
    from benchlib.profile_lm import _one_forward_batch
    from benchlib.workload import cache_features, diag_engine, drop_features, equal_and_ragged, fresh, vary_questions

    diag = diag_engine(a.model, smoke=a.smoke, layers=a.layers, buckets=a.buckets, tag="overhead")
    bench, buckets = diag.bench, diag.buckets
    clf, ckpt = bench.classifier, bench.checkpoint
    rng = np.random.default_rng(0)
    batches = equal_and_ragged(diag, rng)

    phase_s: dict = {}

    def timed(name, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phase_s[name] = phase_s.get(name, 0.0) + time.perf_counter() - t0
        return wrapped

    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))
    clf._prepare = timed("prepare", clf._prepare)
    clf._video_rows = timed("video_rows", clf._video_rows)
    Scheduler.schedule = timed("schedule", Scheduler.schedule)
    Scheduler.finish_step = timed("finish_step", Scheduler.finish_step)
    classifier_module.forward = timed("forward", classifier_module.forward)
    classifier_module._result = timed("results", classifier_module._result)
    clf._features.release_clip = timed("release_features", clf._features.release_clip)
    if a.gc_off:
        gc.disable()
    report: dict = {"model": a.model, "gc_off": a.gc_off, "vary": a.vary, "calls": a.calls, "buckets": buckets}
    print(f"attention's shape buckets: {buckets} per octave")
    gpu = GpuMonitor().start()   # each batch's clocks: runs of this script on one machine are compared
    for name, reqs in batches.items():
        batch_start = time.perf_counter()
        rows = []
        for i in range(a.calls + 1):   # the first call of each batch builds its shapes' kernels: not kept
            call = fresh(reqs, f"{name}{i}")
            if a.vary:   # 0-7 extra words per question: the prompts' lengths (and the attention's shapes) change
                call = vary_questions(call, rng)
            cache_features(bench, call)
            phase_s.clear()
            collections[0] = 0
            t0 = time.perf_counter()
            results = clf.classify(call)
            total = time.perf_counter() - t0
            assert all(r.error is None for r in results), [r.error for r in results if r.error][:2]
            row = {k: phase_s.get(k, 0.0) * 1e3 for k in PHASES}
            row["total"] = total * 1e3
            row["rest"] = row["total"] - sum(row[k] for k in PHASES)
            row["gc_collections"] = collections[0]
            if i:
                rows.append(row)
        # the reference: the forward alone, repeated over one scheduled batch
        alone = fresh(reqs, f"{name}-alone")
        cache_features(bench, alone)
        with mx.stream(clf._device):
            scheduler, batch = _one_forward_batch(clf, alone)
            try:
                video = clf._video_rows(batch, alone)
                times = []
                for _ in range(a.calls + 1):
                    t0 = time.perf_counter()
                    runner.forward(ckpt.model, batch, clf.kv_cache, clf._attention, video, ckpt.family.num_deepstack)
                    times.append((time.perf_counter() - t0) * 1e3)
            finally:
                scheduler.abort_all()
        drop_features(bench, alone)
        report[name] = {"calls_ms": rows, "forward_alone_ms": times[1:],
                        "median_ms": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
                        "forward_alone_median_ms": statistics.median(times[1:])}
        gpu.record(name, batch_start)
        print(f"{name}: forward alone {statistics.median(times[1:]):.1f} ms (runs {[round(t, 1) for t in times[1:]]})")
        for row in rows:
            print("  " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    gpu.stop()
    report["gpu_monitor"] = gpu.as_dict()
    for name in batches:
        report[name]["gpu"] = report["gpu_monitor"]["sections"][name]
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
