"""Diagnostic: the whole job's engine path alone, per batch, on the whole-job benchmark's clips and checkpoint.

Decodes clips with the shipped config's loader and prepares them as the decoders do (MlxClipPreparer), then
answers them in batches of `runtime.clips_per_batch` through `MlxEngine` (what the driver's engine thread
calls), each batch's uploads and prompts staged on a second thread during the batch before it, as the driver's
engine does (`--no-stage`: each batch does its own). Prints ms per clip per batch with MLX's memory after each
(in use, cached, never-used KV blocks), then the host profile's top functions. `--contend N` keeps N processes
decoding beside the engine, as a job's decoders do, at nice 15 (`--contend-nice`; Ray starts the job's decoders at
its worker niceness, 15, so they yield the cores to the driver's engine thread); `--cache-limit-gb` /
`--clear-each-batch` try other settings of MLX's buffer cache. `--cupti N` answers N more batches under
torch.profiler, with no process decoding beside it, and charges the GPU's idle time in each to the engine's host
phase running then (preparing, scheduling, the vision rows, the forward, results), `--json` keeps that summary.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
GIB = 2**30


_DECODER = None   # this process's decoder (`_start_decoder`)


def _start_decoder(model_cfg, loader_cfg) -> None:
    """The job's decoder, as its Ray actor holds it: the config's loader and the engine's input preparer."""
    global _DECODER
    from batchjob.pipeline.actors import Decoder
    from batchjob.pipeline.mlx_engine import MlxEngine

    _DECODER = Decoder(loader_cfg.name, loader_cfg.num_frames, loader_cfg.kwargs, MlxEngine.input_preparer(model_cfg))


def _decode(path: str):
    """(metadata, prepared input) of one clip, as the job's decoders send them to the engine."""
    status, payload = _DECODER.decode(path)
    if not status.ok:
        raise RuntimeError(f"{path}: {status.error}")
    return status.metadata, payload


def _burn(paths: list[str], decoder_args: tuple, stop, nice: int) -> None:
    os.nice(nice)
    _start_decoder(*decoder_args)
    while not stop.is_set():
        for path in paths:
            if stop.is_set():
                return
            _decode(path)


@contextmanager
def decoders_beside(paths: list[str], decoder_args: tuple, n: int, nice: int):
    """`n` processes decoding and preparing `paths` in a loop while the block runs."""
    stop = mp.Event()
    procs = [mp.Process(target=_burn, args=(paths[i::n], decoder_args, stop, nice), daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    time.sleep(3 if n else 0)
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(30)


def job_inputs(a):
    """The whole-job benchmark's dataset and checkpoint for `a.model` (built once per cache), its shipped config
    pointed at them, and the job's first `a.clips` clips (its rows grouped as the driver groups them) decoded and
    prepared by the job's decoder: (config, clip paths, decoder arguments, [(clip job, (metadata, input))])."""
    import bench_pipeline_gpu as B
    from benchlib.job_inputs import job_checkpoint, job_data, user_config
    from benchlib.job_models import MODELS

    from batchjob.config import JobConfig
    from batchjob.datasets import load_rows
    from batchjob.pipeline.work import group_by_clip

    args = B.parse_args(["--model", a.model, "--cache", str(a.cache), "--clips", str(max(a.clips, 64))]
                        + (["--smoke"] if a.smoke else []))
    data = job_data(args)
    ckpt, _ = job_checkpoint(args, "float32" if a.smoke else "bfloat16")
    cfg = JobConfig.model_validate(user_config(data, ckpt, "pyav_keyframes", Path("/tmp/diag-out"),
                                               shipped=MODELS[a.model].config))
    jobs = [w.job for w in group_by_clip(load_rows(cfg.dataset), set(), cfg.loader.name, cfg.loader.num_frames,
                                         cfg.loader.kwargs)][:a.clips]
    paths, decoder_args = [j.video for j in jobs], (cfg.model, cfg.loader)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(min(14, os.cpu_count() or 1), initializer=_start_decoder, initargs=decoder_args) as pool:
        decoded = list(pool.map(_decode, paths))
    print(f"decoded {len(decoded)} clips in {time.perf_counter() - t0:.1f} s; grid {decoded[0][1].grid_thw}",
          flush=True)
    return cfg, paths, decoder_args, list(zip(jobs, decoded))


def answer_all(engine, batches: list, stage: bool = True, after=None) -> list[float]:
    """Answers the batches in order, as the driver's engine thread does: with `stage`, each next batch is staged
    (`MlxEngine.stage`) on a second thread once the current batch's first pass is queued. `after()` runs after
    each batch, outside its time. Returns ms per batch."""
    ms = []
    for i, batch in enumerate(batches):
        ahead = batches[i + 1] if stage and i + 1 < len(batches) else None
        stager: list[threading.Thread] = []

        def busy(ahead=ahead, stager=stager):
            if ahead is not None and not stager:
                stager.append(threading.Thread(target=engine.stage, args=(ahead,), name="diag-stage"))
                stager[0].start()

        engine.watch_device(busy)
        t = time.perf_counter()
        engine.answer(batch)
        ms.append((time.perf_counter() - t) * 1e3)
        for thread in stager:
            thread.join()
        if after is not None:
            after()
    engine.watch_device(None)
    return ms


def gpu_idle(engine, batches: list, stage: bool = True) -> list[dict]:
    """Each batch answered under torch.profiler (CUPTI), the engine's host phases marked: per call its wall, the
    GPU's busy time and its idle time by phase (`benchlib.cupti.idle_by_phase`). Prints a line per call and the
    medians."""
    import statistics

    from benchlib.cupti import engine_phases, traced_idle

    rows = traced_idle(lambda: answer_all(engine, batches, stage), engine_phases(engine._clf, (engine, "answer")))
    for i, r in enumerate(rows):
        print(f"call {i}: wall {r['wall_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f}, idle by phase {r['idle_ms']}",
              flush=True)
    names = sorted({k for r in rows for k in r["idle_ms"]})
    print("medians: wall {:.1f} ms, busy {:.1f}, idle {}".format(
        statistics.median(r["wall_ms"] for r in rows), statistics.median(r["gpu_busy_ms"] for r in rows),
        {k: round(statistics.median(r["idle_ms"].get(k, 0.0) for r in rows), 2) for k in names}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/bjcache"))
    ap.add_argument("--contend", type=int, default=0, help="processes decoding and preparing clips in a loop "
                    "while the engine answers (as the job's decoders do)")
    ap.add_argument("--contend-nice", type=int, default=15, help="their nice value (Ray starts the job's decoders "
                    "at its worker_niceness, 15)")
    ap.add_argument("--cache-limit-gb", type=float, default=None, help="mx.set_cache_limit after the load")
    ap.add_argument("--clear-each-batch", action="store_true", help="mx.clear_cache() after every batch")
    ap.add_argument("--smoke", action="store_true", help="tiny clips and model: checks the script on a CPU")
    ap.add_argument("--cupti", type=int, default=0, help="batches to run under torch.profiler: the GPU's idle time "
                    "in each, charged to the engine's host phase running then")
    ap.add_argument("--json", type=Path, default=None, help="where the --cupti summary goes")
    ap.add_argument("--no-stage", action="store_true", help="no batch staged during the one before (the job stages)")
    a = ap.parse_args()
    cfg, paths, decoder_args, decoded = job_inputs(a)
    import mlx.core as mx

    from batchjob.contract import EngineClip
    from batchjob.pipeline.mlx_engine import MlxEngine

    engine = MlxEngine.load(cfg.model, cfg.prompt)
    cpb = cfg.runtime.clips_per_batch

    def batches(tag: str) -> list:   # a fresh media id per pass: nothing cached from an earlier one
        clips = [EngineClip(replace(job, media_id=f"{job.media_id}#{tag}"), meta, payload)
                 for job, (meta, payload) in decoded]
        return [clips[i:i + cpb] for i in range(0, len(clips), cpb)]

    stage = not a.no_stage
    answer_all(engine, batches("warm")[:2], stage)
    if a.cache_limit_gb is not None:
        mx.set_cache_limit(int(a.cache_limit_gb * GIB))
    ms, memory = [], []
    with decoders_beside(paths, decoder_args, a.contend, a.contend_nice):
        def after():
            if a.clear_each_batch:
                mx.clear_cache()
            memory.append((round(mx.get_active_memory() / GIB, 1), round(mx.get_cache_memory() / GIB, 1),
                           len(engine._clf.pool._free)))

        timed = batches("timed")
        ms = [t / len(b) for t, b in zip(answer_all(engine, timed, stage, after), timed)]
    print(f"per batch (active GiB, MLX cache GiB, never-used KV blocks): {memory}; memory limit "
          f"{mx.get_memory_limit() / GIB:.1f} GiB, peak {mx.get_peak_memory() / GIB:.1f} GiB", flush=True)
    print(f"{a.model} (contend {a.contend}, nice {a.contend_nice}, cache limit {a.cache_limit_gb} GiB, clear each "
          f"batch {a.clear_each_batch}, staged {stage}): ms per clip per batch: {[round(x) for x in ms]}; median "
          f"{sorted(ms)[len(ms) // 2]:.0f}", flush=True)
    if a.cupti:
        report = gpu_idle(engine, batches("cupti")[:a.cupti], stage)
        if a.json:
            a.json.write_text(json.dumps({"model": a.model, "clips_per_batch": cpb, "staged": stage, "calls": report},
                                         indent=1))
    prof = cProfile.Profile()
    prof.enable()
    answer_all(engine, batches("profiled")[:8], stage)
    prof.disable()
    for key, top in (("cumulative", 35), ("tottime", 20)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(s.getvalue(), flush=True)


if __name__ == "__main__":
    main()
