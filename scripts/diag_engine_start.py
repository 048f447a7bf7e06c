"""Diagnostic: where the engine's load spends its time, in fresh processes on the whole-job benchmark's checkpoint
and shipped config (`MlxEngine.load`, as the driver's engine thread loads it).

Each run prints the load's steps (`StepClock`) and splits the step `attention_select` (the fused kernels'
selection on CUDA) into: waiting for device work queued before it (`mx.synchronize()`), building the q/k kernel
object, its start-up check, and the same check again (what a second check costs once everything is loaded), and
the towers' rotary kernel's check (its compile, or its read from the kernel cache, happens inside it).

    python3 scripts/diag_engine_start.py --model qwen3_vl [--runs 3] [--json F]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(config_path: Path) -> dict:
    """One load in this process, timed as the module docstring says."""
    t_start = time.perf_counter()
    import mlx.core as mx

    from batchjob.config import JobConfig
    from batchjob.engine import classifier as classifier_module
    from batchjob.engine import cuda_fused, vision_rope
    from batchjob.pipeline.mlx_engine import MlxEngine

    cfg = JobConfig.model_validate(json.loads(config_path.read_text()))
    split: dict = {}
    real_select, real_check, real_with = (classifier_module.select_fused_kernels, cuda_fused.check_qk_norm_rope,
                                          cuda_fused.qk_norm_rope_with)
    real_vision_check = vision_rope.check_vision_rope

    def timed_with(kernel):
        t = time.perf_counter()
        out = real_with(kernel)
        split["build_s"] = time.perf_counter() - t
        return out

    def timed_check(kernel, dtype, heads=cuda_fused.CHECK_HEADS, seed=0):
        t = time.perf_counter()
        problem = real_check(kernel, dtype, heads, seed)
        split["check_s"] = time.perf_counter() - t
        t = time.perf_counter()
        real_check(kernel, dtype, heads, seed + 1)
        split["second_check_s"] = time.perf_counter() - t
        return problem

    def timed_vision_check(kernel, dtype, heads=vision_rope.CHECK_HEADS, seed=0):   # the towers' kernel: its build
        t = time.perf_counter()                                                     # is inside its first check
        problem = real_vision_check(kernel, dtype, heads, seed)
        split["vision_check_s"] = time.perf_counter() - t
        return problem

    def timed_select(*args, **kwargs):
        t = time.perf_counter()
        mx.synchronize()
        split["pending_device_work_s"] = time.perf_counter() - t
        t = time.perf_counter()
        out = real_select(*args, **kwargs)
        split["select_s"] = time.perf_counter() - t
        return out

    classifier_module.select_fused_kernels = timed_select
    cuda_fused.check_qk_norm_rope = timed_check
    cuda_fused.qk_norm_rope_with = timed_with
    vision_rope.check_vision_rope = timed_vision_check
    t = time.perf_counter()
    engine = MlxEngine.load(cfg.model, cfg.prompt)
    load_s = time.perf_counter() - t
    steps = {step.name: step.seconds for step in engine._clf.startup}
    return {"process_s": time.perf_counter() - t_start, "load_s": load_s, "steps": steps,
            "attention_select": split, "fused_kernels": engine._clf.fused_kernels.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_vl")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/bjcache"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny clips and model: checks the script on a CPU")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.child)), flush=True)
        return

    import bench_pipeline_gpu as B
    from benchlib.job_inputs import job_checkpoint, job_data, user_config
    from benchlib.job_models import MODELS

    args = B.parse_args(["--model", a.model, "--cache", str(a.cache), "--clips", "64"]
                        + (["--smoke"] if a.smoke else []))
    data = job_data(args)
    ckpt, _ = job_checkpoint(args, "float32" if a.smoke else "bfloat16")
    config = user_config(data, ckpt, "pyav_keyframes", Path("/tmp/diag-out"), shipped=MODELS[a.model].config)
    config_path = Path("/tmp/diag-engine-start-config.json")
    config_path.write_text(json.dumps(config, default=str))
    runs = []
    for i in range(a.runs):
        out = subprocess.run([sys.executable, __file__, "--child", str(config_path)], capture_output=True, text=True,
                             timeout=300)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"run {i}: no result\n{out.stderr[-2000:]}", flush=True)
            continue
        result = json.loads(line[0][len("RESULT "):])
        runs.append(result)
        steps = {k: round(v, 2) for k, v in result["steps"].items()}
        split = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result["attention_select"].items()}
        print(f"run {i}: load {result['load_s']:.2f} s; steps {steps}; attention_select {split}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
