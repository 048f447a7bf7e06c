"""The harness-style baseline the published study measured against: one process, the model loaded once, then per
question decode its clip with `opencv` and classify that one question alone. `baseline_worker` runs in a child
process started through the benchmark script's `--baseline-worker` flag (so it parses the same arguments)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .job_inputs import Dataset
from .measure import run_measured


def run_baseline(script: Path, args, model: Path, data: Dataset, job_rows: int) -> dict:
    """`script --baseline-worker ...` (the benchmark's command line, which calls `baseline_worker`) timed from
    outside, its rate extrapolated to the job's `job_rows` rows."""
    cmd = [sys.executable, str(script), "--baseline-worker", str(model), str(data.manifest), str(args.baseline_clips),
           "--model", args.model]
    for flag in ("device", "dtype", "max_pixels", "memory_budget_gb", "num_frames"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.in_process_model:
        cmd.append("--in-process-model")
    got = run_measured(cmd, args.run_timeout_s)
    lines = [ln for ln in got["output_tail"].splitlines() if ln.startswith("{")]
    if got["returncode"] != 0 or not lines:
        print(f"baseline: FAILED (exit {got['returncode']}):\n{got['output_tail']}", flush=True)
        return {"error": f"exit {got['returncode']}", **got}
    w = json.loads(lines[-1])
    loop_rate = w["rows"] / w["loop_s"]
    startup = got["wall_s"] - w["loop_s"]
    extrapolated_wall = startup + job_rows / loop_rate
    return {"rows": w["rows"], "clips": w["clips"], "wall_s": got["wall_s"], "loop_s": w["loop_s"],
            "startup_s": startup, "rows_per_s_streaming": loop_rate,
            "rows_per_s": job_rows / extrapolated_wall, "job_wall_s_extrapolated": extrapolated_wall,
            "decode_ms_per_clip": w["decode_ms_per_request"], "engine_ms_per_request": w["engine_ms_per_request"],
            "gpu_busy": w["engine_s"] / w["loop_s"], "peak_host_mb_sampled": got["peak_host_mb"],
            "gpu_util_mean": got["gpu_util_mean"], "gpu": got["gpu"], "engine_runtime": w.get("engine_runtime")}


def baseline_worker(model: str, manifest: str, clips: int, args) -> None:
    """The harness: model loaded once, then one question at a time: decode its clip (opencv), classify it."""
    t0 = time.perf_counter()
    from batchjob.config import DatasetConfig, ModelConfig, PromptConfig
    from batchjob.datasets import load_rows
    from batchjob.engine import Classifier, ClassifyRequest, Clip
    from batchjob.loaders import load_video
    from batchjob.pipeline.mlx_engine import engine_config
    from batchjob.synthetic.random_engine import random_classifier

    rows = load_rows(DatasetConfig(adapter="manifest", annotation=manifest,
                                   video_root=str(Path(manifest).parent / "clips")))
    videos = list(dict.fromkeys(r.video for r in rows))[:clips]
    rows = [r for r in rows if r.video in set(videos)]
    mcfg = ModelConfig(checkpoint=model, device=args.device, dtype=args.dtype, max_pixels=args.max_pixels,
                       memory_budget_gb=args.memory_budget_gb)
    config = engine_config(mcfg, PromptConfig())
    clf = random_classifier(model, config) if args.in_process_model else Classifier.from_pretrained(model, config)
    t1 = time.perf_counter()
    decode_s = engine_s = 0.0
    for r in rows:
        a = time.perf_counter()
        frames, meta = load_video(r.video, backend="opencv", num_frames=args.num_frames)
        b = time.perf_counter()
        [res] = clf.classify([ClassifyRequest(r.row_id, Clip(frames, meta, r.video), r.question, r.options)])
        engine_s += time.perf_counter() - b
        decode_s += b - a
        if res.error is not None:
            raise SystemExit(f"baseline: {r.row_id}: {res.error}")
    loop = time.perf_counter() - t1
    print(json.dumps({"rows": len(rows), "clips": len(videos), "load_s": t1 - t0, "loop_s": loop,
                      "decode_ms_per_request": decode_s * 1000 / len(rows), "engine_s": engine_s,
                      "engine_ms_per_request": engine_s * 1000 / len(rows), "engine_runtime": clf.runtime.as_dict()}))

