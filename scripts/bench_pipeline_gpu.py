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
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import benchlib.env
from benchlib.clips import SMOKE_SHAPE, ClipSpec, Shape, encode_clips, job_clip_names, plan_clips
from benchlib.job_models import MODELS
from benchlib.measure import run_measured

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
LOADERS = ("pyav_keyframes", "opencv", "pyav_adaptive")
METHODS = ("pyav_keyframes", "opencv", "baseline", "pyav_adaptive")   # the headline figures first
TARGETS = {"keyframes_vs_opencv": 2.0, "keyframes_vs_baseline": 3.0, "gpu_busy": 0.85, "overlap": 1.15,
           "cores_per_gpu": 2.0}


@dataclass(frozen=True)
class Dataset:
    """One job's files: the clips (hard links to the encoded files), the same questions as a NExT-QA MC
    annotation (what the shipped config reads) and as a manifest (the in-process methods and the baseline)."""
    root: Path
    annotation: Path
    manifest: Path
    info: dict

    @property
    def clips_dir(self) -> Path:
        return self.root / "clips"


def build_dataset(cache: Path, specs: list[ClipSpec], clips: int, questions: int, segment_s: float,
                  workers: int, seed: int, long_s: float) -> Dataset:
    """Encode the distinct clips in parallel, link the job's names, write the questions in both formats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    times, build_s = encode_clips(cache / "clips", specs, segment_s, workers)
    root = cache / f"job-{clips}-{len(specs)}-{questions}q-{seed}"
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records, nextqa = [], []
    for i, (name, spec) in enumerate(job_clip_names(specs, clips)):
        link = root / "clips" / name
        if not link.exists():
            os.link(cache / "clips" / spec.name, link)
        for q in range(questions):
            question, options, answer = f"Question {q} about clip {i}?", [f"option {k}" for k in range(5)], \
                int(rng.integers(0, 5))
            records.append({"id": f"c{i:05d}q{q}", "video": name, "question": question, "options": options,
                            "answer": answer})
            nextqa.append({"video": name.removesuffix(".mp4"), "qid": q, "type": "CW", "question": question,
                           **{f"a{k}": o for k, o in enumerate(options)}, "answer": answer})
    manifest, annotation = root / "manifest.jsonl", root / "nextqa_mc.parquet"
    tmp = root / "manifest.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(manifest)
    pq.write_table(pa.Table.from_pylist(nextqa), root / "nextqa_mc.tmp")
    (root / "nextqa_mc.tmp").rename(annotation)
    sizes = [(cache / "clips" / s.name).stat().st_size for s in dict.fromkeys(specs)]
    info = {"build_s": build_s, "encoded": len(times), "distinct": len(set(specs)), "clips": clips,
            "rows": len(records), "encode_s": times, "bytes_total": int(sum(sizes)),
            "long_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.seconds >= long_s),
            "hevc_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.codec == "hevc")}
    return Dataset(root, annotation, manifest, info)


# --- models -------------------------------------------------------------------------------------------------
SHIPPED_CONFIG = MODELS["qwen2_5_vl"].config
IN_PROCESS_ENGINE = "batchjob.synthetic.random_engine:RandomWeightsEngine"
KERNEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchjob" / "mlx-cuda-kernels"


def ensure_checkpoint(cache: Path, dims: dict, layers: int, vision_layers: int, max_pixels: int | None,
                      dtype: str, model_type: str = "qwen2_5_vl") -> tuple[Path, float]:
    """The model as users have it: a `model_type` checkpoint directory on disk (safetensors shards) in `dims`'
    shape, its processor's default `max_pixels` (None: the hub's), written once per machine by a child process
    (this one never holds the GPU). Returns its path and the seconds spent."""
    path = cache / f"checkpoint-{model_type}-h{dims['hidden']}-L{layers}-V{vision_layers}-p{max_pixels or 'hub'}-{dtype}"
    if (path / ".complete").exists():
        return path, 0.0
    t0 = time.perf_counter()
    code = ("import json, sys; from batchjob.synthetic.random_engine import write_random_checkpoint as w; "
            "w(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "
            "max_pixels=json.loads(sys.argv[5]), dtype=sys.argv[6], model_type=sys.argv[7])")
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(dims), str(layers), str(vision_layers),
                    json.dumps(max_pixels), dtype, model_type], check=True)
    (path / ".complete").touch()
    return path, time.perf_counter() - t0


def ensure_in_process_model(cache: Path, dims: dict, layers: int, vision_layers: int, max_pixels: int | None,
                            model_type: str = "qwen2_5_vl") -> Path:
    """A tiny checkpoint naming the shape to build in the engine's process (`--in-process-model`, a diagnostic)."""
    from batchjob.synthetic.random_engine import scaled_config, tiny_spec, write_random_config
    from batchjob.synthetic.tiny_model import write_tiny_checkpoint

    path = cache / f"model-{model_type}-h{dims['hidden']}-L{layers}-V{vision_layers}-p{max_pixels or 'hub'}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        write_tiny_checkpoint(path, tiny_spec(model_type, max_pixels))
        tiny = json.loads((path / "config.json").read_text())
        write_random_config(path, scaled_config(tiny, dims, layers, vision_layers))
        (path / ".complete").touch()
    return path


def job_data(args) -> Dataset:
    """The job's clips and questions as `args` asks (encoded once per cache)."""
    shape = SMOKE_SHAPE if args.smoke else Shape()
    specs = plan_clips(args.distinct, long_fraction=args.long_fraction, hevc_fraction=args.hevc_fraction,
                       seed=args.seed, shape=shape)
    return build_dataset(args.cache, specs, args.clips, args.questions, args.segment_s, args.workers, args.seed,
                         shape.long_s)


def checkpoint_pixels(args) -> int | None:
    """The checkpoint's own processor default: Qwen2.5-VL's as before (the config's per-frame value), Qwen3-VL's as
    published (None: the shipped config sets the job's whole-clip budget over it)."""
    return None if MODELS[args.model].clip_budget else args.max_pixels


def job_checkpoint(args, dtype: str) -> tuple[Path, float]:
    """`ensure_checkpoint` for `args`' model, depth and size: (its path, seconds spent writing it)."""
    dims = MODELS[args.model].dims(args.smoke or args.tiny_model)
    return ensure_checkpoint(args.cache, dims, args.layers, args.vision_layers, checkpoint_pixels(args), dtype,
                             args.model)


def user_config(data: Dataset, checkpoint: Path, loader: str, out: Path, *, limit: int | None = None,
                budget_gb: float | None = None, shipped: Path = SHIPPED_CONFIG) -> dict:
    """The model's shipped config (configs/nextqa.yaml, nextqa-qwen3vl.yaml) as shipped: only the paths, the loader
    and the job's size change (and, for the explicit-budget run, `model.memory_budget_gb`)."""
    import yaml

    cfg = yaml.safe_load(shipped.read_text())
    cfg["dataset"].update(annotation=str(data.annotation), video_root=str(data.clips_dir), limit=limit)
    cfg["model"]["checkpoint"] = str(checkpoint)
    cfg["loader"]["name"] = loader
    cfg["output"]["directory"] = str(out)
    if budget_gb is not None:
        cfg["model"]["memory_budget_gb"] = budget_gb
    return cfg


def in_process_config(args, model: Path, data: Dataset, loader: str, out: Path) -> dict:
    """The diagnostic job of `--in-process-model`: the random model built in the engine's process."""
    return {
        "job": f"bench-{loader}",
        "dataset": {"adapter": "manifest", "annotation": str(data.manifest), "video_root": str(data.clips_dir)},
        "model": {"checkpoint": str(model), "engine": IN_PROCESS_ENGINE, "dtype": args.dtype, "device": args.device,
                  "max_pixels": args.max_pixels, "memory_budget_gb": args.memory_budget_gb},
        "loader": {"name": loader, "num_frames": args.num_frames},
        "output": {"directory": str(out)},
    }


def evict_from_page_cache(folder: Path) -> int:
    """Ask the kernel to drop `folder`'s files from the page cache (no root needed); bytes asked for."""
    total = 0
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += f.stat().st_size
            finally:
                os.close(fd)
    return total


def count_files(folder: Path) -> int:
    return sum(1 for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


# --- methods ------------------------------------------------------------------------------------------------
# User-path runs besides one per loader: the job's first run on a fresh machine (no compiled kernels, the
# checkpoint out of the page cache), and the shipped config with an explicit memory budget.
FIRST_RUN, EXPLICIT_BUDGET, ACTOR_ENGINE, COLD_CACHE = "first_run", "explicit_budget", "actor_engine", "cold_cache"


def timed_read(folder: Path) -> tuple[float, int]:
    """Seconds and bytes to read `folder`'s files once, sequentially, in 16 MiB chunks (evicted first)."""
    evict_from_page_cache(folder)
    t0, total = time.perf_counter(), 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(16 * 2**20):
                    total += len(chunk)
    return time.perf_counter() - t0, total


def run_job(args, name: str, cfg: dict, work: Path, job_clips: int) -> dict:
    """`batchjob run CONFIG --stats-json S`, timed and sampled from outside."""
    import yaml

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stats_path = work / f"{name}.stats.json"
    stats_path.unlink(missing_ok=True)
    kernels = count_files(KERNEL_CACHE)
    got = run_measured([sys.executable, "-m", "batchjob.cli", "run", str(cfg_path), "--stats-json", str(stats_path)],
                       args.run_timeout_s)
    errors = error_samples(Path(cfg["output"]["directory"]))
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    if got["returncode"] != 0 or stats is None:
        print(f"{name}: FAILED (exit {got['returncode']}{', timed out' if got['timed_out'] else ''}):\n"
              f"{got['output_tail']}\nerror rows: {errors}", flush=True)
        return {"error": f"exit {got['returncode']}", "error_samples": errors, "stats": stats, **got}
    clips = min(job_clips, -(-cfg["dataset"]["limit"] // args.questions)) if cfg["dataset"].get("limit") else job_clips
    return {**summarize_run(stats, got["wall_s"], clips), "peak_host_mb_sampled": got["peak_host_mb"],
            "gpu_util_mean": got["gpu_util_mean"], "kernels_compiled": count_files(KERNEL_CACHE) - kernels,
            "error_samples": errors, "summary": got["output_tail"][-2500:], "stats": stats}


def error_samples(output: Path, limit: int = 5) -> dict[str, int]:
    """The run's distinct error messages (first `limit`) and how many rows each: a failed run says why."""
    import pyarrow.dataset as ds

    try:
        table = ds.dataset(str(output), format="parquet").to_table(columns=["error"])
    except Exception as exc:    # no output at all: the run's own tail says why
        return {f"(no output: {type(exc).__name__})": 0}
    counts: dict[str, int] = {}
    for e in table.column("error").to_pylist():
        if e:
            counts[e[:500]] = counts.get(e[:500], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:limit])


def run_user(args, name: str, checkpoint: Path, data: Dataset, work: Path) -> dict:
    loader, limit, budget = name, None, None
    if name == FIRST_RUN:
        loader, limit = "pyav_keyframes", args.first_run_clips * args.questions
        shutil.rmtree(KERNEL_CACHE, ignore_errors=True)
        evicted = evict_from_page_cache(checkpoint)
        print(f"{name}: kernel cache emptied, {evicted / 2**30:.1f} GiB of checkpoint evicted from the page cache",
              flush=True)
    elif name == EXPLICIT_BUDGET:
        loader, budget = "pyav_keyframes", args.explicit_budget_gb
    elif name == ACTOR_ENGINE:
        loader = "pyav_keyframes"
    elif name == COLD_CACHE:
        loader, limit = "pyav_keyframes", args.first_run_clips * args.questions
        read_s, read_bytes = timed_read(checkpoint)
        evicted = evict_from_page_cache(checkpoint)
        print(f"{name}: a plain read of the evicted checkpoint took {read_s:.1f} s ({read_bytes / read_s / 2**30:.2f} "
              f"GiB/s); {evicted / 2**30:.1f} GiB evicted again", flush=True)
    cfg = user_config(data, checkpoint, loader, work / f"out-{name}", limit=limit, budget_gb=budget,
                      shipped=MODELS[args.model].config)
    if name == ACTOR_ENGINE:
        cfg["runtime"]["engine_placement"] = "actors"
    got = {"loader": loader, "explicit_budget_gb": budget, **run_job(args, name, cfg, work, data.info["clips"])}
    if name == COLD_CACHE:
        got["plain_read_s"] = read_s
        if got.get("startup_s") is not None:
            got["startup_over_plain_read_s"] = got["startup_s"] - read_s
    return got


def summarize_run(stats: dict, wall_s: float, job_clips: int | None = None) -> dict:
    """One `batchjob run`'s figures from its --stats-json and the outside wall time.

    Per-clip costs are means (busy time / clips): that is what sets throughput and the cores a GPU needs on
    a mixed job; the pipeline's own per-clip figures are medians and are kept beside them. Start-up is the run's
    own breakdown (launch to first answer) when it has one."""
    done, stream = stats.get("done_rows", 0), stats.get("stream_s") or float("nan")
    clips = stats.get("done_clips") or job_clips
    engines = stats.get("engines") or 1
    decode_ms = engine_ms = None
    if clips:
        if stats.get("decode_busy_s") is not None:
            decode_ms = stats["decode_busy_s"] * 1000 / clips      # decode + input preparation, all decoders
        if stats.get("engine_busy_s") is not None:
            engine_ms = stats["engine_busy_s"] * 1000 / clips      # one GPU's time per clip
    gpu_busy = stats.get("gpu_busy")
    if gpu_busy is None and stats.get("engine_busy_s") is not None and stream == stream and stream > 0:
        gpu_busy = stats["engine_busy_s"] / engines / stream      # the engine's busy share of the streaming phase
    startup = stats.get("startup") or {}
    rate = done / wall_s if wall_s else None
    streaming = done / stream if stream == stream and stream > 0 else None
    return {
        "rows": done, "error_rows": stats.get("error_rows"), "wall_s": wall_s, "rows_per_s": rate,
        "rows_per_s_streaming": streaming, "rows_per_s_vs_streaming": rate / streaming if rate and streaming else None,
        "startup_s": startup.get("total_s", wall_s - stream if stream == stream else None),
        "startup_steps": startup.get("steps"), "engine_load_steps": startup.get("engine_load"),
        "startup_overlapped": startup.get("overlapped"),
        "engine_placement": (stats.get("engine_runtime") or {}).get("placement"),
        "load_s": (startup.get("steps") or {}).get("engine_load"), "memory": stats.get("memory"),
        "gpu_busy": gpu_busy, "overlap": stats.get("overlap_efficiency"),
        "decode_ms_per_clip": decode_ms, "engine_ms_per_clip": engine_ms,
        "decode_ms_per_clip_median": stats.get("decode_ms_per_clip"),
        "engine_ms_per_clip_median": stats.get("engine_ms_per_clip"),
        "cores_per_gpu": cores_per_gpu(decode_ms, engine_ms),
        "bound_by": stats.get("bound_by"), "queue_depth": stats.get("queue_depth"),
        "peak_rss_mb": stats.get("peak_rss_mb"), "host_peak_mb": stats.get("host_peak_mb"),
        "decoder_rss_mb": (stats.get("actor_peak_rss_mb") or {}).get("decoders"),
        "engine_rss_mb": (stats.get("actor_peak_rss_mb") or {}).get("engines"),
        "decoders": stats.get("decoders"), "engines": stats.get("engines"), "clips": clips,
    }


def cores_per_gpu(decode_ms_per_clip: float | None, engine_ms_per_clip: float | None) -> float | None:
    """CPU cores that keep one GPU busy: decode ms per clip x the engine's clips/s (1000 / engine ms per clip)."""
    if not decode_ms_per_clip or not engine_ms_per_clip:
        return None
    return decode_ms_per_clip / engine_ms_per_clip


def run_baseline(args, model: Path, data: Dataset, job_rows: int) -> dict:
    cmd = [sys.executable, str(HERE), "--baseline-worker", str(model), str(data.manifest), str(args.baseline_clips),
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
            "gpu_util_mean": got["gpu_util_mean"], "engine_runtime": w.get("engine_runtime")}


def baseline_worker(model: str, manifest: str, clips: int, args) -> None:
    """The harness: model loaded once, then one question at a time: decode its clip (opencv), classify it."""
    t0 = time.perf_counter()
    from batchjob.config import DatasetConfig, ModelConfig, PromptConfig
    from batchjob.datasets import load_rows
    from batchjob.engine import Classifier, ClassifyRequest, Clip
    from batchjob.loaders import load_video
    from batchjob.pipeline.mlx_engine import engine_config
    from batchjob.synthetic.random_engine import random_classifier

    rows = load_rows(DatasetConfig(adapter="manifest", annotation=manifest, video_root=str(Path(manifest).parent / "clips")))
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


# --- report -------------------------------------------------------------------------------------------------
TARGETS = {"keyframes_vs_opencv": 2.0, "keyframes_vs_baseline": 3.0, "gpu_busy": 0.85, "overlap": 1.15,
           "cores_per_gpu": 2.0, "startup_s": 10.0, "rows_per_s_vs_streaming": 0.8,
           "default_vs_explicit_budget": 1 / 1.1}
AT_MOST = ("overlap", "cores_per_gpu", "startup_s")


def figures(methods: dict) -> dict:
    """The stable keys of the results file (None where a method did not run or failed)."""
    ok = {m: r for m, r in methods.items() if "error" not in r}

    def ratio(a: str, b: str, key: str = "rows_per_s") -> float | None:
        if a in ok and b in ok and ok[a].get(key) and ok[b].get(key):
            return ok[a][key] / ok[b][key]
        return None

    def per(key: str) -> dict:
        return {m: ok[m].get(key) if m in ok else None for m in methods}

    keyframes = ok.get("pyav_keyframes", {})
    return {"keyframes_vs_opencv": ratio("pyav_keyframes", "opencv"),
            "keyframes_vs_baseline": ratio("pyav_keyframes", "baseline"),
            "adaptive_vs_opencv": ratio("pyav_adaptive", "opencv"),
            "keyframes_vs_opencv_streaming": ratio("pyav_keyframes", "opencv", "rows_per_s_streaming"),
            "default_vs_explicit_budget": ratio("pyav_keyframes", EXPLICIT_BUDGET),
            "startup_vs_actor_engine": ratio("pyav_keyframes", ACTOR_ENGINE, "startup_s"),
            "engine_placement": per("engine_placement"), "startup_s_per_method": per("startup_s"),
            "startup_s": keyframes.get("startup_s"), "load_s": keyframes.get("load_s"),
            "first_run_startup_s": ok.get(FIRST_RUN, {}).get("startup_s"),
            "cold_cache_startup_s": ok.get(COLD_CACHE, {}).get("startup_s"),
            "cold_cache_plain_read_s": ok.get(COLD_CACHE, {}).get("plain_read_s"),
            "cold_cache_startup_over_plain_read_s": ok.get(COLD_CACHE, {}).get("startup_over_plain_read_s"),
            "budget": keyframes.get("memory"),
            "rows_per_s": per("rows_per_s"), "rows_per_s_streaming": per("rows_per_s_streaming"),
            "rows_per_s_vs_streaming": per("rows_per_s_vs_streaming"), "startup_steps": per("startup_steps"),
            "gpu_busy": per("gpu_busy"), "overlap": per("overlap"), "cores_per_gpu": per("cores_per_gpu"),
            "decode_ms_per_clip": per("decode_ms_per_clip"), "peak_host_mb": per("peak_host_mb_sampled"),
            "host_peak_mb_own": per("host_peak_mb"), "decoder_rss_mb": per("decoder_rss_mb"),
            "kernels_compiled": per("kernels_compiled"), "gpu_util_mean": per("gpu_util_mean")}


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(methods: dict) -> str:
    fig = figures(methods)
    base, opencv = methods.get("baseline", {}), methods.get("opencv", {})
    head = ("| method | engine in | rows/s | streaming rows/s | whole / streaming | start-up s | load s | vs opencv "
            "| vs baseline | GPU busy | decode ms/clip | cores/GPU | peak host MB | kernels compiled | bound by |")
    lines = [head, "|" + "|".join(["---"] * 15) + "|"]
    for m, r in methods.items():
        if "error" in r:
            lines.append(f"| {m} | failed: {r['error']} |" + " |" * 13)
            continue
        vs_cv = r["rows_per_s"] / opencv["rows_per_s"] if opencv.get("rows_per_s") else None
        vs_base = r["rows_per_s"] / base["rows_per_s"] if base.get("rows_per_s") and "error" not in base else None
        lines.append(f"| {m} | {r.get('engine_placement') or '-'} | {_fmt(r.get('rows_per_s'))} | {_fmt(r.get('rows_per_s_streaming'))} | "
                     f"{_fmt(r.get('rows_per_s_vs_streaming'))} | {_fmt(r.get('startup_s'), '.1f')} | "
                     f"{_fmt(r.get('load_s'), '.1f')} | {_fmt(vs_cv)}x | {_fmt(vs_base)}x | "
                     f"{_fmt(r.get('gpu_busy'), '.0%')} | {_fmt(r.get('decode_ms_per_clip'), '.0f')} | "
                     f"{_fmt(r.get('cores_per_gpu'), '.1f')} | {_fmt(r.get('peak_host_mb_sampled'), '.0f')} | "
                     f"{r.get('kernels_compiled', '-')} | {r.get('bound_by') or '-'} |")
    checks = []
    for key, target in TARGETS.items():
        v = fig[key] if not isinstance(fig[key], dict) else fig[key].get("pyav_keyframes")
        if v is None:
            continue
        good = v <= target if key in AT_MOST else v >= target
        checks.append(f"{key} (keyframes) {v:.2f}: {'meets' if good else 'MISSES'} "
                      f"{'<=' if key in AT_MOST else '>='} {target:.3g}")
    return "\n".join(lines + [""] + checks)


def environment() -> dict:
    return benchlib.env.environment(("av", "ray", "mlx.core", "cv2"))


def results_path(out: Path, env: dict, smoke: bool, model: str = "qwen2_5_vl") -> Path:
    return benchlib.env.results_path(out, env, f"pipeline-{model}", "-smoke" if smoke else "")


def save(report: dict, path: Path) -> None:
    report["figures"] = figures(report["methods"])
    benchlib.env.save_json(report, path)


# --- main ---------------------------------------------------------------------------------------------------
LOADERS = ("pyav_keyframes", "opencv", "pyav_adaptive")
METHODS = (FIRST_RUN, "pyav_keyframes", EXPLICIT_BUDGET, COLD_CACHE, ACTOR_ENGINE, "opencv", "baseline",
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
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCHJOB_CACHE", Path.home() / ".cache/batchjob"))
                    / "bench-gpu")
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
    on_disk = {FIRST_RUN, EXPLICIT_BUDGET, COLD_CACHE, ACTOR_ENGINE}
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
                    "environment": env, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
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
            got = run_baseline(args, model, data, data.info["rows"])
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
