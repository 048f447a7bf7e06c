"""One method of the whole-job benchmark: `batchjob run` with a config, a fresh process timed and sampled from
outside, and its figures from the run's own --stats-json."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from batchjob.engine.kernel_cache import kernel_cache_root

from .disk import count_files, evict_from_page_cache, timed_read
from .job_inputs import Dataset, user_config
from .job_models import MODELS
from .measure import run_measured

KERNEL_CACHE = kernel_cache_root()     # every engine's compiled kernels (batchjob.engine.device)

# User-path runs besides one per loader: the job's first run on a fresh machine (no compiled kernels, the
# checkpoint out of the page cache), the shipped config with an explicit memory budget, and the job on the
# machine's first GPU alone (the control of a machine with several).
FIRST_RUN, EXPLICIT_BUDGET, ACTOR_ENGINE, COLD_CACHE = "first_run", "explicit_budget", "actor_engine", "cold_cache"
ONE_GPU = "one_gpu"


def one_gpu_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run that sees only the first of the GPUs this process sees (CUDA_VISIBLE_DEVICES'
    first entry where it is set, else GPU 0): what a user who owns one such GPU runs."""
    env = dict(os.environ if environ is None else environ)
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "0").split(",") if v.strip()]
    env["CUDA_VISIBLE_DEVICES"] = visible[0] if visible else "0"
    return env


def run_job(args, name: str, cfg: dict, work: Path, job_clips: int, env: dict[str, str] | None = None) -> dict:
    """`batchjob run CONFIG --stats-json S`, timed and sampled from outside (in `env`, default this process's)."""
    import yaml

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stats_path = work / f"{name}.stats.json"
    stats_path.unlink(missing_ok=True)
    kernels = count_files(KERNEL_CACHE)
    got = run_measured([sys.executable, "-m", "batchjob.cli", "run", str(cfg_path), "--stats-json", str(stats_path)],
                       args.run_timeout_s, env=env)
    errors = error_samples(Path(cfg["output"]["directory"]))
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    if got["returncode"] != 0 or stats is None:
        print(f"{name}: FAILED (exit {got['returncode']}{', timed out' if got['timed_out'] else ''}):\n"
              f"{got['output_tail']}\nerror rows: {errors}", flush=True)
        return {"error": f"exit {got['returncode']}", "error_samples": errors, "stats": stats, **got}
    clips = min(job_clips, -(-cfg["dataset"]["limit"] // args.questions)) if cfg["dataset"].get("limit") else job_clips
    return {**summarize_run(stats, got["wall_s"], clips), "peak_host_mb_sampled": got["peak_host_mb"],
            "gpu_util_mean": got["gpu_util_mean"], "gpu": got["gpu"],
            "kernels_compiled": count_files(KERNEL_CACHE) - kernels,
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
    loader, limit, budget, env = name, None, None, None
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
    elif name == ONE_GPU:
        loader, env = "pyav_keyframes", one_gpu_environment()
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
    got = {"loader": loader, "explicit_budget_gb": budget, **run_job(args, name, cfg, work, data.info["clips"], env)}
    if env is not None:
        got["cuda_visible_devices"] = env["CUDA_VISIBLE_DEVICES"]
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

