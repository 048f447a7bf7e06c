#!/usr/bin/env python
"""The whole job on a GPU machine, as users run it: a checkpoint on disk, the shipped config, `batchjob run`.

Model (`--model`): random weights in the published shape of the checkpoint the model's shipped config names
(qwen2_5_vl: Qwen2.5-VL-7B, `configs/nextqa.yaml`; qwen3_vl: Qwen3-VL-8B, `configs/nextqa-qwen3vl.yaml`;
`--layers`/`--vision-layers` cut the depth) written once per machine as a real checkpoint directory (safetensors
shards, bf16 on a GPU), so the engine loads it from disk as it loads a downloaded one. Config: that shipped config,
with only the paths, the loader and the job's size changed (the dataset is written in NExT-QA's MC format, which
its adapter reads).

Dataset: synthetic clips shaped like real footage (`benchlib.clips`): 1280x720 and 1920x1080, 30 s and 600 s
long, H.264 and HEVC, 24-30 fps, a keyframe every 2-10 s; `--clips` clips over `--distinct` encoded files (the
rest hard links under their own names: each is its own clip to every method).

Methods, each a fresh process timed from outside, start to exit:
  first_run        pyav_keyframes on `--first-run-clips` clips as on a fresh machine: no compiled CUDA kernels
                   kept, the checkpoint evicted from the page cache
  pyav_keyframes   the shipped config (default memory budget), warm caches: the headline run
  explicit_budget  the same with `model.memory_budget_gb: --explicit-budget-gb` (the budget rule's control)
  cold_cache       pyav_keyframes on `--first-run-clips` clips with the checkpoint evicted from the page cache,
                   compiled kernels kept (a night after other work filled the page cache), beside the time a plain
                   sequential read of the evicted checkpoint takes (the disk's own speed)
  actor_engine     the same with `runtime.engine_placement: actors` (the engine in a Ray actor, loading after
                   Ray's start: the placement's control; the shipped `auto` puts a one-GPU job's engine in the
                   driver's process, loading from launch)
  one_gpu          pyav_keyframes with only the machine's first GPU visible (CUDA_VISIBLE_DEVICES): on a machine
                   with several, the control of the headline run, which uses them all (one engine each); the
                   figure `all_gpus_vs_one_gpu` is their ratio. On a machine with one GPU it repeats the headline run
  opencv, pyav_adaptive   the shipped config with that loader
  baseline         one process: the model loaded once, then per question decode its clip with `opencv` and
                   classify that one question alone (the harness the published study measured against), on the
                   first `--baseline-clips` clips, extrapolated to the job's rows from its own loop rate.
`--in-process-model` (a diagnostic, not the user's path) builds the random model in the engine's process instead.

Figures per method: rows/s end to end and in the streaming phase and their ratio, start-up (launch to first
answer, step by step, from the run's own stats) and the model load in it, the memory budget the engine chose,
GPU busy fraction, overlap, decode ms per clip, cores per GPU, peak host memory (PSS of the run's process tree,
sampled, and each process's own high-water mark), CUDA kernels compiled during the run, mean GPU utilisation.
Written to `<out>/pipeline-<model>-<gpu>-<date>.json` after every method.

    scripts/netns.sh bash -c 'source scripts/env.sh; python scripts/bench_pipeline_gpu.py --smoke --explicit-budget-gb 4'
    python3 scripts/bench_pipeline_gpu.py --out $OUT --cache /tmp/bjcache          # on the GPU machine
    python3 scripts/bench_pipeline_gpu.py --model qwen3_vl --out $OUT --cache /tmp/bjcache
    python3 scripts/bench_pipeline_gpu.py --clips 768 --methods first_run,pyav_keyframes,one_gpu --out $OUT  # 2+ GPUs
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from batchjob.cache_home import cache_home
from benchlib.job_baseline import baseline_worker, run_baseline
from benchlib.job_inputs import checkpoint_pixels, ensure_in_process_model, in_process_config, job_checkpoint, job_data
from benchlib.job_models import MODELS
from benchlib.job_report import environment, results_path, save, table
from benchlib.job_runs import ACTOR_ENGINE, COLD_CACHE, EXPLICIT_BUDGET, FIRST_RUN, ONE_GPU, run_job, run_user

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
LOADERS = ("pyav_keyframes", "opencv", "pyav_adaptive")
METHODS = (FIRST_RUN, "pyav_keyframes", EXPLICIT_BUDGET, COLD_CACHE, ACTOR_ENGINE, ONE_GPU, "opencv", "baseline",
           "pyav_adaptive")
DEFAULT_METHODS = (FIRST_RUN, "pyav_keyframes", EXPLICIT_BUDGET, COLD_CACHE, ACTOR_ENGINE)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=512, help="clips in the job")
    ap.add_argument("--distinct", type=int, default=32, help="clips actually encoded (the rest are hard links)")
    ap.add_argument("--long-fraction", type=float, default=0.25, help="share of 600 s clips (the rest 30 s)")
    ap.add_argument("--hevc-fraction", type=float, default=0.25, help="share of HEVC clips (the rest H.264)")
    ap.add_argument("--questions", type=int, default=3, help="questions per clip")
    ap.add_argument("--segment-s", type=float, default=10.0, help="seconds encoded per clip (repeated to length)")
    ap.add_argument("--model", default="qwen2_5_vl", choices=sorted(MODELS), help="the model family and its "
                    "shipped config: qwen2_5_vl = Qwen2.5-VL-7B, configs/nextqa.yaml; qwen3_vl = Qwen3-VL-8B, "
                    "configs/nextqa-qwen3vl.yaml")
    ap.add_argument("--layers", type=int, default=None, help="text layers (default: the published model's: "
                    "28 for Qwen2.5-VL-7B, 36 for Qwen3-VL-8B)")
    ap.add_argument("--vision-layers", type=int, default=None, help="vision blocks (default: the published "
                    "model's: 32 for Qwen2.5-VL-7B, 27 for Qwen3-VL-8B)")
    ap.add_argument("--first-run-clips", type=int, default=64, help="clips of the first run (cold caches)")
    ap.add_argument("--explicit-budget-gb", type=float, default=60.0, help="model.memory_budget_gb of that run")
    ap.add_argument("--in-process-model", action="store_true", help="diagnostic: build the random model in the "
                    "engine's process (no checkpoint on disk; loader methods only)")
    # The in-process diagnostic and the baseline set these; the user path reads them from the shipped config.
    ap.add_argument("--num-frames", type=int, default=16)
    ap.add_argument("--max-pixels", type=int, default=None, help="default: the shipped config's model.max_pixels, "
                    "in the family's unit (per frame for Qwen2.5-VL, the whole clip for Qwen3-VL)")
    ap.add_argument("--memory-budget-gb", type=float, default=None)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--baseline-clips", type=int, default=4, help="clips the sequential baseline runs")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    ap.add_argument("--run-timeout-s", type=float, default=420.0, help="a method running longer is stopped")
    ap.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPU cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=cache_home() / "bench-gpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--smoke", action="store_true", help="tiny clips and model on any device: checks the script")
    ap.add_argument("--tiny-model", action="store_true", help="real-sized clips, tiny model (a CPU check of the "
                    "clip sizes the GPU run uses)")
    ap.add_argument("--baseline-worker", nargs=3, metavar=("MODEL", "MANIFEST", "CLIPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.workers = args.workers or os.cpu_count() or 2
    job_model = MODELS[args.model]
    published = job_model.dims(False)
    args.layers = args.layers or published["layers"]
    args.vision_layers = args.vision_layers or published["v_depth"]
    args.max_pixels = args.max_pixels or job_model.max_pixels()
    if args.smoke or args.tiny_model:
        args.layers, args.vision_layers = min(args.layers, 2), min(args.vision_layers, 4)
    if args.smoke:
        args.segment_s = min(args.segment_s, 3.0)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}; choose from {','.join(METHODS)}")
    on_disk = {FIRST_RUN, EXPLICIT_BUDGET, COLD_CACHE, ACTOR_ENGINE, ONE_GPU}
    if args.in_process_model and on_disk & set(args.methods.split(",")):
        ap.error(f"--in-process-model has no checkpoint on disk: drop {', '.join(sorted(on_disk))} from --methods")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.baseline_worker:
        model, manifest, clips = args.baseline_worker
        return baseline_worker(model, manifest, int(clips), args)
    job_model = MODELS[args.model]
    dims = job_model.dims(args.smoke or args.tiny_model)
    gpu = shutil.which("nvidia-smi") is not None
    env = environment()
    path = results_path(args.out, env, args.smoke or args.tiny_model, args.model)
    report: dict = {"model": args.model, "shape_of": job_model.hub_id, "dims": dims,
                    "environment": env,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "shipped_config_path": str(job_model.config.relative_to(ROOT)),
                    "shipped_config": job_model.config.read_text(), "methods": {}, "complete": False}
    print(f"# {env['gpu']}, {env['cpus']} CPUs; {args.clips} clips ({args.distinct} encoded, "
          f"{args.long_fraction:.0%} long, {args.hevc_fraction:.0%} HEVC) x {args.questions} questions; model "
          f"{args.model} ({job_model.hub_id}'s shape, {job_model.config.name}) {args.layers}/{args.vision_layers} "
          f"layers {'built in process' if args.in_process_model else 'on disk'}", flush=True)
    data = job_data(args)
    report["dataset"] = data.info
    print(f"dataset: {data.info['clips']} clips, {data.info['rows']} rows, {data.info['encoded']} encoded in "
          f"{data.info['build_s']:.1f} s ({data.info['bytes_total'] / 2**20:.0f} MiB distinct)", flush=True)
    if args.in_process_model:
        model, report["model_write_s"] = ensure_in_process_model(args.cache, dims, args.layers, args.vision_layers,
                                                                 checkpoint_pixels(args), args.model), 0.0
    else:
        model, report["model_write_s"] = job_checkpoint(args, "bfloat16" if gpu else "float32")
        report["checkpoint_bytes"] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: {model} ({report['checkpoint_bytes'] / 2**30:.1f} GiB, written in "
              f"{report['model_write_s']:.1f} s)", flush=True)
    save(report, path)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-gpu-"))
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        if method == "baseline":
            got = run_baseline(HERE, args, model, data, data.info["rows"])
        elif args.in_process_model:
            got = run_job(args, method, in_process_config(args, model, data, method, work / f"out-{method}"), work,
                          data.info["clips"])
        else:
            got = run_user(args, method, model, data, work)
        report["methods"][method] = got
        save(report, path)
        print(f"{method}: {time.perf_counter() - t0:.1f} s; " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()
            if k not in ("stats", "output_tail", "summary", "engine_runtime", "queue_depth")), flush=True)
    report["complete"] = True
    save(report, path)
    shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(report["methods"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
