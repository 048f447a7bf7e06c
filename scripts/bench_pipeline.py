#!/usr/bin/env python
"""Throughput of `batchjob run` versus a baseline in the style of the published harness.

Same machine, same run, same tiny random checkpoint and synthetic clips (mixed lengths, 3 questions each):

  baseline   one request at a time: lossless `opencv` decode of the clip for every question, then one
             classify() call with that single question; nothing overlaps.
  batchjob   the real job path (run_job: local Ray, decode actors with `pyav_keyframes`, engine actor,
             Parquet output), timed end to end including Ray start-up and model load.

Prints medians over --repeats, the speed-up, and the pipeline's overlap efficiency (streaming wall time
over the busiest stage's per-worker busy time; 1.0 = the other stage fully hidden behind it).
Run inside a loopback-only namespace like the tests:
  unshare -rn bash -c 'ip link set lo up; source scripts/env.sh; python scripts/bench_pipeline.py'
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import yaml


def build_assets(cache: Path, clips: int, seed: int) -> tuple[Path, Path]:
    from batchjob.demo import build_synthetic_dataset, ensure_tiny_checkpoint

    model = ensure_tiny_checkpoint(cache / "model")
    data = cache / f"data-{clips}-{seed}"
    if not (data / ".complete").exists():
        print(f"encoding {clips} synthetic clips into {data} ...", flush=True)
        build_synthetic_dataset(data, num_clips=clips, questions_per_clip=3, seconds=(4.0, 40.0),
                                widths=(224, 320), fps=24.0, gop_seconds=2.0, seed=seed)
        (data / ".complete").touch()
    return model, data / "manifest.jsonl"


def job_config(path: Path, model: Path, manifest: Path, num_frames: int, out: Path) -> Path:
    cfg = {
        "job": "bench",
        "dataset": {"adapter": "manifest", "annotation": str(manifest), "video_root": str(manifest.parent / "clips")},
        "model": {"checkpoint": str(model), "engine": "mlx", "dtype": "float32", "memory_budget_gb": 2},
        "loader": {"name": "pyav_keyframes", "num_frames": num_frames},
        "runtime": {"decode_actors": 2, "engine_actors": 1, "decode_cpus": 0.5, "engine_cpus": 2,
                    "frames_in_flight": 8, "clips_per_batch": 4},
        "output": {"directory": str(out), "rows_per_part": 256},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_pipeline(config: Path):
    from batchjob.config import load_config
    from batchjob.pipeline.job import run_job

    t0 = time.perf_counter()
    stats = run_job(load_config(config), restart=True)
    wall = time.perf_counter() - t0
    assert stats.error_rows == 0, f"{stats.error_rows} error rows"
    return wall, stats


def run_baseline(model: Path, manifest: Path, num_frames: int) -> tuple[float, int]:
    """The published harness's shape: per question, decode the clip losslessly, classify alone."""
    from batchjob.config import DatasetConfig
    from batchjob.datasets import load_rows
    from batchjob.engine import Classifier, ClassifyRequest, Clip, EngineConfig
    from batchjob.loaders import load_video

    rows = load_rows(DatasetConfig(adapter="manifest", annotation=str(manifest),
                                   video_root=str(manifest.parent / "clips")))
    clf = Classifier.from_pretrained(model, EngineConfig(dtype="float32", memory_budget_gb=2))  # not timed
    t0 = time.perf_counter()
    for r in rows:
        frames, meta = load_video(r.video, backend="opencv", num_frames=num_frames)
        [res] = clf.classify([ClassifyRequest(r.row_id, Clip(frames, meta, r.video), r.question, r.options)])
        assert res.error is None, res.error
    return time.perf_counter() - t0, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=40)
    ap.add_argument("--num-frames", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache/batchjob"))
                    / "bench")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, manifest = build_assets(args.cache, args.clips, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    config = job_config(work / "bench.yaml", model, manifest, args.num_frames, work / "out")
    base, e2e, steady, startup, overlap = [], [], [], [], []
    for i in range(args.repeats):
        secs, n = run_baseline(model, manifest, args.num_frames)
        base.append(n / secs)
        wall, st = run_pipeline(config)
        e2e.append(st.done_rows / wall)
        steady.append(st.done_rows / st.stream_s)
        startup.append(wall - st.stream_s)
        overlap.append(st.overlap_efficiency)
        print(f"repeat {i}: baseline {n / secs:6.2f} rows/s | batchjob {st.done_rows} rows in {wall:.1f} s, of which "
              f"start-up {wall - st.stream_s:.1f} s (Ray, model load) and streaming {st.stream_s:.2f} s; busy: "
              f"decode {st.decode_busy_s:.2f} s over {st.decoders} decoders, engine {st.engine_busy_s:.2f} s; "
              f"overlap efficiency {st.overlap_efficiency:.2f}", flush=True)
    b, p, s = statistics.median(base), statistics.median(e2e), statistics.median(steady)
    print(f"\nmachine: {platform.platform()}, {os.cpu_count()} CPUs; {args.clips} clips x 3 questions, "
          f"{args.num_frames} frames, tiny Qwen2.5-VL fp32, medians of {args.repeats}")
    print(f"| {'method':44s} | {'rows/s':>7s} | {'vs baseline':>11s} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 13}|")
    print(f"| {'baseline: opencv per question, one request':44s} | {b:7.2f} | {1.0:10.2f}x |")
    print(f"| {'batchjob run, streaming phase (steady state)':44s} | {s:7.2f} | {s / b:10.2f}x |")
    print(f"| {'batchjob run, end to end (incl. start-up)':44s} | {p:7.2f} | {p / b:10.2f}x |")
    up = statistics.median(startup)
    print(f"overlap efficiency (median): {statistics.median(overlap):.2f}; start-up (median) {up:.1f} s")
    if s > 5 * b:   # rows after which end-to-end throughput also passes 5x the baseline
        print(f"end to end passes 5x the baseline from about {up / (1 / (5 * b) - 1 / s):.0f} rows per run")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
