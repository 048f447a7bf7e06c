"""The whole-job benchmark's report: the stable figures of the results file, the table and its targets, and the
results file itself (where it goes, what it says about the machine)."""
from __future__ import annotations

from pathlib import Path

from . import env as env_lib
from .job_runs import ACTOR_ENGINE, COLD_CACHE, EXPLICIT_BUDGET, FIRST_RUN, ONE_GPU

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
    compiled = per("kernels_compiled")
    all_vs_one = ratio("pyav_keyframes", ONE_GPU)
    return {"keyframes_vs_opencv": ratio("pyav_keyframes", "opencv"),
            "keyframes_vs_baseline": ratio("pyav_keyframes", "baseline"),
            "adaptive_vs_opencv": ratio("pyav_adaptive", "opencv"),
            "keyframes_vs_opencv_streaming": ratio("pyav_keyframes", "opencv", "rows_per_s_streaming"),
            "default_vs_explicit_budget": ratio("pyav_keyframes", EXPLICIT_BUDGET),
            "startup_vs_actor_engine": ratio("pyav_keyframes", ACTOR_ENGINE, "startup_s"),
            "all_gpus_vs_one_gpu": all_vs_one, "engines": per("engines"),
            # like for like only when neither run compiled kernels: the run that finds the cache cold pays the
            # compiles in its start-up (list first_run before both on a fresh machine)
            "all_gpus_vs_one_gpu_warm": None if all_vs_one is None else (
                compiled.get("pyav_keyframes") == 0 and compiled.get(ONE_GPU) == 0),
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
            "kernels_compiled": compiled, "gpu_util_mean": per("gpu_util_mean"),
            "gpu_sm_mhz_median": {m: (ok[m].get("gpu") or {}).get("sm_mhz_median") if m in ok else None
                                  for m in methods}}


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(methods: dict) -> str:
    fig = figures(methods)
    base, opencv = methods.get("baseline", {}), methods.get("opencv", {})
    head = ("| method | engine in | rows/s | streaming rows/s | whole / streaming | start-up s | load s | vs opencv "
            "| vs baseline | GPU busy | SM MHz | decode ms/clip | cores/GPU | peak host MB | kernels compiled "
            "| bound by |")
    lines = [head, "|" + "|".join(["---"] * 16) + "|"]
    for m, r in methods.items():
        if "error" in r:
            lines.append(f"| {m} | failed: {r['error']} |" + " |" * 14)
            continue
        vs_cv = r["rows_per_s"] / opencv["rows_per_s"] if opencv.get("rows_per_s") else None
        vs_base = r["rows_per_s"] / base["rows_per_s"] if base.get("rows_per_s") and "error" not in base else None
        lines.append(f"| {m} | {r.get('engine_placement') or '-'} | {_fmt(r.get('rows_per_s'))} | "
                     f"{_fmt(r.get('rows_per_s_streaming'))} | "
                     f"{_fmt(r.get('rows_per_s_vs_streaming'))} | {_fmt(r.get('startup_s'), '.1f')} | "
                     f"{_fmt(r.get('load_s'), '.1f')} | {_fmt(vs_cv)}x | {_fmt(vs_base)}x | "
                     f"{_fmt(r.get('gpu_busy'), '.0%')} | {_fmt(fig['gpu_sm_mhz_median'][m], '.0f')} | "
                     f"{_fmt(r.get('decode_ms_per_clip'), '.0f')} | "
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
    if fig["all_gpus_vs_one_gpu"] is not None:
        compiled = fig["kernels_compiled"]
        caveat = "" if fig["all_gpus_vs_one_gpu_warm"] else (
            f" (NOT like for like: kernels compiled {compiled.get('pyav_keyframes')} and {compiled.get(ONE_GPU)};"
            " list first_run before both)")
        checks.append(f"all GPUs vs one ({fig['engines'].get('pyav_keyframes')} engines vs "
                      f"{fig['engines'].get(ONE_GPU)}): {fig['all_gpus_vs_one_gpu']:.2f}x the rows/s{caveat}")
    return "\n".join(lines + [""] + checks)


def environment() -> dict:
    return env_lib.environment(("av", "ray", "mlx.core", "cv2"))


def results_path(out: Path, env: dict, smoke: bool, model: str = "qwen2_5_vl") -> Path:
    return env_lib.results_path(out, env, f"pipeline-{model}", "-smoke" if smoke else "")


def save(report: dict, path: Path) -> None:
    report["figures"] = figures(report["methods"])
    env_lib.save_json(report, path)

