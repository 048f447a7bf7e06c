#!/usr/bin/env python
"""The whole job on a GPU machine: `batchjob run` with each loader against a harness-style baseline.

Dataset: synthetic clips shaped like real footage: 1280x720 and 1920x1080, 30 s and 600 s long (a
`--long-fraction` of them long), H.264 and HEVC, 24-30 fps, a keyframe every 2-10 s, textured pictures that
pan (so the encoder spends real bits). Encoding 600 s of 1080p per clip would take minutes a clip, so each
clip is a segment of whole GOPs (about `--segment-s`) encoded once and repeated, packets remuxed with
shifted timestamps: the files have the length, GOP structure and bitrate of long footage, and a decoder
pays for every frame as it would there. Clips are encoded in parallel over the CPU cores and cached in
`--cache`; a job of `--clips` clips uses `--distinct` encoded files, the rest hard links under their own
names (each is its own clip to every method).

Model: random bf16 weights in Qwen2.5-VL-7B's shape (`--layers`/`--vision-layers` cut the depth), built in
the engine's process (`batchjob.synthetic.random_engine`); frames resized to at most `--max-pixels`.

Methods, each a fresh process timed from outside, start to exit:
  pyav_keyframes, pyav_adaptive, opencv   `batchjob run --stats-json` over the whole job
  baseline    one process: load the model, then per question decode its clip with `opencv` and classify
              that one question alone (the harness the published study measured against). It runs on
              the first `--baseline-clips` clips (the plan interleaves long and short clips, so that
              prefix has the job's mix) and is extrapolated to the job's rows from its own loop rate.

Figures per method: rows/s end to end and in the streaming phase, GPU busy fraction (the run's
`gpu_busy`, else the engine's busy time over the streaming phase), overlap efficiency (wall over the
busiest stage), decode ms per clip, the CPU cores a loader needs to keep one GPU busy (decode ms per clip x
the engine's clips/s / 1000), peak host memory (PSS of the run's process tree, sampled), and the mean GPU
utilisation nvidia-smi reports. Written to `<out>/pipeline-<gpu>-<date>.json` after every method.

    scripts/netns.sh bash -c 'source scripts/env.sh; python scripts/bench_pipeline_gpu.py --smoke'
    python3 scripts/bench_pipeline_gpu.py --out $OUT --cache /tmp/bjcache          # on the GPU machine
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import benchlib.env

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
LOADERS = ("pyav_keyframes", "opencv", "pyav_adaptive")
METHODS = ("pyav_keyframes", "opencv", "baseline", "pyav_adaptive")   # the headline figures first
TARGETS = {"keyframes_vs_opencv": 2.0, "keyframes_vs_baseline": 3.0, "gpu_busy": 0.85, "overlap": 1.15,
           "cores_per_gpu": 2.0}


# --- clip plan (pure) ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClipSpec:
    """One synthetic clip file: everything its encoding depends on (the cache key is its name)."""
    width: int
    height: int
    seconds: float
    fps: int
    gop_seconds: float
    codec: str          # "h264" | "hevc"
    seed: int

    @property
    def name(self) -> str:
        return (f"{self.codec}_{self.height}p_{self.seconds:g}s_{self.fps}fps_gop{self.gop_seconds:g}_"
                f"s{self.seed}.mp4")

    @property
    def gop_frames(self) -> int:
        return max(1, round(self.gop_seconds * self.fps))

    @property
    def gops(self) -> int:
        """The clip is whole GOPs: `seconds` rounded to the nearest GOP (at most half a GOP off)."""
        return max(1, round(self.seconds * self.fps / self.gop_frames))

    @property
    def frames(self) -> int:
        return self.gops * self.gop_frames

    def segment_gops(self, segment_s: float) -> int:
        """GOPs encoded once: about `segment_s`, never more than the clip."""
        return min(self.gops, max(1, math.ceil(segment_s / self.gop_seconds)))

    def segment_frames(self, segment_s: float) -> int:
        return self.segment_gops(segment_s) * self.gop_frames


@dataclass(frozen=True)
class Shape:
    """What the plan draws from: real footage's sizes, lengths, rates and GOPs (or tiny ones for --smoke)."""
    sizes: tuple[tuple[int, int], ...] = ((1280, 720), (1920, 1080))
    short_s: float = 30.0
    long_s: float = 600.0
    fps: tuple[int, ...] = (24, 25, 30)
    gop_s: tuple[float, float] = (2.0, 10.0)


SMOKE_SHAPE = Shape(sizes=((192, 108), (256, 144)), short_s=3.0, long_s=12.0, fps=(24, 30), gop_s=(1.0, 3.0))


def is_long(index: int, long_fraction: float) -> bool:
    """Clip `index` is long when the running count of long clips steps up there: every prefix of the plan
    holds round-down(k x fraction) long clips, so a baseline on the first k clips sees the job's mix."""
    return math.floor((index + 1) * long_fraction + 1e-9) > math.floor(index * long_fraction + 1e-9)


def plan_clips(count: int, *, long_fraction: float, hevc_fraction: float, seed: int,
               shape: Shape = Shape()) -> list[ClipSpec]:
    """`count` clip specs, deterministic in `seed`: long clips spread evenly over the plan (see is_long);
    within each length class, HEVC clips spread evenly too and the sizes alternate."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    for label, f in (("long_fraction", long_fraction), ("hevc_fraction", hevc_fraction)):
        if not 0 <= f <= 1:
            raise ValueError(f"{label} must be in [0, 1], got {f}")
    rng = np.random.default_rng(seed)
    specs, seen = [], {False: 0, True: 0}
    for i in range(count):
        long = is_long(i, long_fraction)
        k = seen[long]                  # sizes and codecs cycle within each length class, so neither
        seen[long] += 1                 # follows the length (no "every long clip is 1080p HEVC")
        width, height = shape.sizes[k % len(shape.sizes)]
        lo, hi = shape.gop_s
        gop = float(np.round(rng.uniform(lo, hi) * 2) / 2)       # half-second steps, as cameras set them
        specs.append(ClipSpec(width=width, height=height, seconds=shape.long_s if long else shape.short_s,
                              fps=int(shape.fps[int(rng.integers(len(shape.fps)))]), gop_seconds=max(lo, gop),
                              codec="hevc" if is_long(k, hevc_fraction) else "h264", seed=seed * 100_003 + i))
    return specs


def job_clip_names(specs: list[ClipSpec], clips: int) -> list[tuple[str, ClipSpec]]:
    """The job's clip files: `clips` names cycling over the encoded specs (the extra names are hard links)."""
    return [(f"clip{i:05d}_{specs[i % len(specs)].name}", specs[i % len(specs)]) for i in range(clips)]


# --- encoding -----------------------------------------------------------------------------------------------
def _texture(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Smooth shapes, edges and a little grain: costs an encoder real bits (keyframes of a few hundred kB at
    1080p, like camera footage), unlike flat synthetic colour or pure noise."""
    cell = 32
    coarse = rng.integers(30, 200, (h // cell + 2, w // cell + 2)).astype(np.float32)
    ys = np.arange(h, dtype=np.float32) / cell
    xs = np.arange(w, dtype=np.float32) / cell
    y0, x0 = ys.astype(int), xs.astype(int)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    smooth = top * (1 - fy) + bottom * fy
    edges = (rng.integers(0, 2, (h // 16 + 1, w // 16 + 1)) * 40).repeat(16, 0).repeat(16, 1)[:h, :w]
    grain = rng.integers(0, 6, (h, w))
    return np.clip(smooth + edges + grain, 0, 255).astype(np.uint8)


def _encoder(spec: ClipSpec) -> tuple[str, dict[str, str]]:
    gop = spec.gop_frames
    common = f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=error"
    if spec.codec == "h264":   # superfast keeps CABAC and B-frames (what cameras write); one thread per encoder;
        # x264's GOPs are closed unless asked otherwise
        return "libx264", {"preset": "superfast", "x264-params": f"{common}:bframes=2:threads=1"}
    # Closed GOPs (x265 defaults to open ones), so a repeat can end after any GOP.
    return "libx265", {"preset": "ultrafast",
                       "x265-params": f"{common}:bframes=2:open-gop=0:pools=1:frame-threads=1"}


def encode_segment(spec: ClipSpec, path: Path, frames: int) -> None:
    import av

    w, h = spec.width, spec.height
    rng = np.random.default_rng(spec.seed)
    step = max(2, w // 240) * 2                                  # pan speed, pixels per frame (even)
    span = w + step * frames
    y, u, v = _texture(h, span, rng), _texture(h // 2, span // 2, rng), _texture(h // 2, span // 2, rng)
    codec, options = _encoder(spec)
    buf = np.empty((h * 3 // 2, w), np.uint8)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.gop_size = spec.gop_frames
        stream.codec_context.thread_count = 1
        stream.options = options
        for i in range(frames):
            o = i * step
            buf[:h] = y[:, o:o + w]
            buf[h:h + h // 4] = u[:, o // 2:o // 2 + w // 2].reshape(h // 4, w)
            buf[h + h // 4:] = v[:, o // 2:o // 2 + w // 2].reshape(h // 4, w)
            frame = av.VideoFrame.from_ndarray(buf, format="yuv420p")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def repeat_segment(segment: Path, path: Path, gops: int, segment_gops: int, segment_frames: int) -> None:
    """Remux the segment's packets again and again, timestamps shifted, until the clip has `gops` GOPs; the
    last repeat stops before the keyframe that would start one GOP too many (GOPs are closed, so every GOP
    decodes on its own)."""
    import av

    repeats = math.ceil(gops / segment_gops)
    with av.open(str(segment)) as src:
        tb = src.streams.video[0].time_base
        seg_duration = None
        with av.open(str(path), "w", format="mp4") as out:
            ostream = out.add_stream_from_template(src.streams.video[0])
            for r in range(repeats):
                src.seek(0)
                pkts = [p for p in src.demux(src.streams.video[0]) if p.size]
                if seg_duration is None:
                    per_frame = int(round(1 / (src.streams.video[0].average_rate * tb)))
                    seg_duration = per_frame * segment_frames
                keep = min(segment_gops, gops - r * segment_gops)
                keys = 0
                for p in pkts:
                    keys += bool(p.is_keyframe)
                    if keys > keep:
                        break
                    p.pts = p.pts + r * seg_duration
                    p.dts = p.dts + r * seg_duration
                    p.stream = ostream
                    out.mux(p)


def build_clip(args: tuple[ClipSpec, str, float]) -> tuple[str, float]:
    """Encode one clip into `folder` (atomic rename; an existing file is kept). Returns (name, seconds)."""
    spec, folder, segment_s = args
    final = Path(folder) / spec.name
    if final.exists():
        return spec.name, 0.0
    t0 = time.perf_counter()
    tmp = Path(folder) / f".{spec.name}.{os.getpid()}"
    seg_frames = spec.segment_frames(segment_s)
    encode_segment(spec, tmp.with_suffix(".seg.mp4"), seg_frames)
    if seg_frames >= spec.frames:
        tmp.with_suffix(".seg.mp4").rename(final)
    else:
        repeat_segment(tmp.with_suffix(".seg.mp4"), tmp.with_suffix(".mp4"), spec.gops, spec.segment_gops(segment_s),
                       seg_frames)
        tmp.with_suffix(".seg.mp4").unlink()
        tmp.with_suffix(".mp4").rename(final)
    return spec.name, time.perf_counter() - t0


def build_dataset(cache: Path, specs: list[ClipSpec], clips: int, questions: int, segment_s: float,
                  workers: int, seed: int, long_s: float) -> tuple[Path, dict]:
    """Encode the distinct clips in parallel, link the job's names, write the manifest; return its path and
    how long the build took."""
    import multiprocessing

    folder = cache / "clips"
    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in dict.fromkeys(specs) if not (folder / s.name).exists()]
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    if todo:
        print(f"encoding {len(todo)} clips on {workers} processes into {folder} ...", flush=True)
        # Longest first, so the pool does not end on one long clip.
        todo.sort(key=lambda s: -s.segment_frames(segment_s) * s.width * s.height * (4 if s.codec == "hevc" else 1))
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for name, dt in pool.imap_unordered(build_clip, [(s, str(folder), segment_s) for s in todo]):
                times[name] = dt
    build_s = time.perf_counter() - t0
    job = cache / f"job-{clips}-{len(specs)}-{questions}q-{seed}"
    (job / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i, (name, spec) in enumerate(job_clip_names(specs, clips)):
        link = job / "clips" / name
        if not link.exists():
            os.link(folder / spec.name, link)
        for q in range(questions):
            records.append({"id": f"c{i:05d}q{q}", "video": name, "question": f"Question {q} about clip {i}?",
                            "options": [f"option {k}" for k in range(5)], "answer": int(rng.integers(0, 5))})
    manifest = job / "manifest.jsonl"
    tmp = job / "manifest.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(manifest)
    sizes = [(folder / s.name).stat().st_size for s in dict.fromkeys(specs)]
    info = {"build_s": build_s, "encoded": len(todo), "distinct": len(set(specs)), "clips": clips,
            "rows": len(records), "encode_s": times, "bytes_total": int(sum(sizes)),
            "long_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.seconds >= long_s),
            "hevc_clips": sum(1 for _, s in job_clip_names(specs, clips) if s.codec == "hevc")}
    return manifest, info


# --- model --------------------------------------------------------------------------------------------------
def ensure_model(cache: Path, dims: dict, layers: int, vision_layers: int, max_pixels: int) -> Path:
    from batchjob.synthetic.random_engine import scaled_config, write_random_config
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    path = cache / f"model-h{dims['hidden']}-L{layers}-V{vision_layers}-p{max_pixels}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        write_tiny_checkpoint(path, TinyModelSpec(model_type="qwen2_5_vl", max_pixels=max_pixels,
                                                  min_pixels=28 * 28 * 4))
        tiny = json.loads((path / "config.json").read_text())
        write_random_config(path, scaled_config(tiny, dims, layers, vision_layers))
        (path / ".complete").touch()
    return path


ENGINE = "batchjob.synthetic.random_engine:RandomWeightsEngine"


def job_config(args, model: Path, manifest: Path, loader: str, out: Path) -> dict:
    return {
        "job": f"bench-{loader}",
        "dataset": {"adapter": "manifest", "annotation": str(manifest), "video_root": str(manifest.parent / "clips")},
        "model": {"checkpoint": str(model), "engine": ENGINE, "dtype": args.dtype, "device": args.device,
                  "max_pixels": args.max_pixels, "max_num_batched_tokens": args.max_num_batched_tokens,
                  "memory_budget_gb": args.memory_budget_gb},
        "loader": {"name": loader, "num_frames": args.num_frames},
        "runtime": {"decode_actors": args.decoders, "engine_actors": 1, "decode_cpus": 1, "engine_cpus": 1,
                    "frames_in_flight": args.frames_in_flight, "clips_per_batch": args.clips_per_batch,
                    "max_error_fraction": 0, "decode_timeout_s": args.decode_timeout_s},
        "output": {"directory": str(out), "rows_per_part": 4096},
    }


# --- sampling the run from outside --------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree_pss_mb(root: int) -> float | None:
    """Proportional set size of `root` and its descendants (shared pages counted once overall); Linux only."""
    if not os.path.isdir("/proc"):
        return None
    kids, total, stack = _children(), 0, [root]
    while stack:
        pid = stack.pop()
        stack += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total / 1024


def gpu_utilization() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout.split()
        return float(out[0]) / 100 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class Sampler(threading.Thread):
    """Peak host memory of a process tree and mean GPU utilisation while it runs."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period, self.stop = pid, period, threading.Event()
        self.peak_mb: float | None = None
        self.gpu: list[float] = []
        self.has_gpu = shutil.which("nvidia-smi") is not None

    def run(self) -> None:
        while not self.stop.wait(self.period):
            mb = tree_pss_mb(self.pid)
            if mb is not None:
                self.peak_mb = max(self.peak_mb or 0.0, mb)
            if self.has_gpu:
                g = gpu_utilization()
                if g is not None:
                    self.gpu.append(g)


def run_measured(cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group; wall time, exit code, sampled memory/GPU, output tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        timed_out = True
    sampler.stop.set()
    sampler.join()
    return {"wall_s": time.perf_counter() - t0, "returncode": proc.returncode, "timed_out": timed_out,
            "peak_host_mb": sampler.peak_mb, "gpu_util_mean": statistics.fmean(sampler.gpu) if sampler.gpu else None,
            "output_tail": (output or "")[-3000:]}


# --- methods ------------------------------------------------------------------------------------------------
def run_loader(args, model: Path, manifest: Path, loader: str, work: Path, job_clips: int) -> dict:
    import yaml

    cfg_path = work / f"{loader}.yaml"
    cfg_path.write_text(yaml.safe_dump(job_config(args, model, manifest, loader, work / f"out-{loader}")))
    stats_path = work / f"{loader}.stats.json"
    stats_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(cfg_path), "--restart", "--quiet",
           "--stats-json", str(stats_path)]
    got = run_measured(cmd, args.run_timeout_s)
    if got["returncode"] != 0 or not stats_path.exists():
        print(f"{loader}: FAILED (exit {got['returncode']}{', timed out' if got['timed_out'] else ''}):\n"
              f"{got['output_tail']}", flush=True)
        return {"error": f"exit {got['returncode']}", **got}
    stats = json.loads(stats_path.read_text())
    return {**summarize_run(stats, got["wall_s"], job_clips), "peak_host_mb_sampled": got["peak_host_mb"],
            "gpu_util_mean": got["gpu_util_mean"], "stats": stats}


def summarize_run(stats: dict, wall_s: float, job_clips: int | None = None) -> dict:
    """One `batchjob run`'s figures from its --stats-json; keys the pipeline adds later are read if present.

    Per-clip costs are means (busy time / clips): that is what sets throughput and the cores a GPU needs on
    a mixed job; the pipeline's own per-clip figures are medians and are kept beside them."""
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
    return {
        "rows": done, "error_rows": stats.get("error_rows"), "wall_s": wall_s,
        "rows_per_s": done / wall_s if wall_s else None,
        "rows_per_s_streaming": done / stream if stream == stream and stream > 0 else None,
        "startup_s": wall_s - stream if stream == stream else None,
        "gpu_busy": gpu_busy, "overlap": stats.get("overlap_efficiency"),
        "decode_ms_per_clip": decode_ms, "engine_ms_per_clip": engine_ms,
        "decode_ms_per_clip_median": stats.get("decode_ms_per_clip"),
        "engine_ms_per_clip_median": stats.get("engine_ms_per_clip"),
        "cores_per_gpu": cores_per_gpu(decode_ms, engine_ms),
        "bound_by": stats.get("bound_by"), "queue_depth": stats.get("queue_depth"),
        "peak_rss_mb": stats.get("peak_rss_mb"), "decoders": stats.get("decoders"), "engines": stats.get("engines"),
        "clips": clips,
    }


def cores_per_gpu(decode_ms_per_clip: float | None, engine_ms_per_clip: float | None) -> float | None:
    """CPU cores that keep one GPU busy: decode ms per clip x the engine's clips/s (1000 / engine ms per clip)."""
    if not decode_ms_per_clip or not engine_ms_per_clip:
        return None
    return decode_ms_per_clip / engine_ms_per_clip


def run_baseline(args, model: Path, manifest: Path, job_rows: int) -> dict:
    cmd = [sys.executable, str(HERE), "--baseline-worker", str(model), str(manifest), str(args.baseline_clips)]
    for flag in ("device", "dtype", "max_pixels", "max_num_batched_tokens", "memory_budget_gb", "num_frames"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
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
    from batchjob.engine import ClassifyRequest, Clip
    from batchjob.loaders import load_video
    from batchjob.pipeline.mlx_engine import engine_config
    from batchjob.synthetic.random_engine import random_classifier

    rows = load_rows(DatasetConfig(adapter="manifest", annotation=manifest, video_root=str(Path(manifest).parent / "clips")))
    videos = list(dict.fromkeys(r.video for r in rows))[:clips]
    rows = [r for r in rows if r.video in set(videos)]
    mcfg = ModelConfig(checkpoint=model, engine=ENGINE, device=args.device, dtype=args.dtype, max_pixels=args.max_pixels,
                       max_num_batched_tokens=args.max_num_batched_tokens, memory_budget_gb=args.memory_budget_gb)
    clf = random_classifier(model, engine_config(mcfg, PromptConfig()))
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
def figures(methods: dict) -> dict:
    """The stable keys of the results file (None where a method did not run or failed)."""
    ok = {m: r for m, r in methods.items() if "error" not in r}

    def ratio(a: str, b: str, key: str = "rows_per_s") -> float | None:
        if a in ok and b in ok and ok[a].get(key) and ok[b].get(key):
            return ok[a][key] / ok[b][key]
        return None

    def per(key: str) -> dict:
        return {m: ok[m].get(key) if m in ok else None for m in methods}

    return {"keyframes_vs_opencv": ratio("pyav_keyframes", "opencv"),
            "keyframes_vs_baseline": ratio("pyav_keyframes", "baseline"),
            "adaptive_vs_opencv": ratio("pyav_adaptive", "opencv"),
            "keyframes_vs_opencv_streaming": ratio("pyav_keyframes", "opencv", "rows_per_s_streaming"),
            "rows_per_s": per("rows_per_s"), "rows_per_s_streaming": per("rows_per_s_streaming"),
            "gpu_busy": per("gpu_busy"), "overlap": per("overlap"), "cores_per_gpu": per("cores_per_gpu"),
            "decode_ms_per_clip": per("decode_ms_per_clip"), "peak_host_mb": per("peak_host_mb_sampled"),
            "gpu_util_mean": per("gpu_util_mean")}


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(methods: dict) -> str:
    fig = figures(methods)
    base = methods.get("baseline", {})
    opencv = methods.get("opencv", {})
    head = ("| method | rows/s | streaming rows/s | vs opencv | vs baseline | GPU busy | overlap | decode ms/clip "
            "| cores/GPU | peak host MB | GPU util | bound by |")
    lines = [head, "|" + "|".join(["---"] * 12) + "|"]
    for m, r in methods.items():
        if "error" in r:
            lines.append(f"| {m} | failed: {r['error']} |" + " |" * 10)
            continue
        vs_cv = r["rows_per_s"] / opencv["rows_per_s"] if opencv.get("rows_per_s") else None
        vs_base = r["rows_per_s"] / base["rows_per_s"] if base.get("rows_per_s") and "error" not in base else None
        lines.append(f"| {m} | {_fmt(r.get('rows_per_s'))} | {_fmt(r.get('rows_per_s_streaming'))} | "
                     f"{_fmt(vs_cv)}x | {_fmt(vs_base)}x | {_fmt(r.get('gpu_busy'), '.0%')} | "
                     f"{_fmt(r.get('overlap'))} | {_fmt(r.get('decode_ms_per_clip'), '.0f')} | "
                     f"{_fmt(r.get('cores_per_gpu'), '.1f')} | {_fmt(r.get('peak_host_mb_sampled'), '.0f')} | "
                     f"{_fmt(r.get('gpu_util_mean'), '.0%')} | {r.get('bound_by') or '-'} |")
    checks = []
    for key, target in TARGETS.items():
        v = fig[key] if not isinstance(fig[key], dict) else fig[key].get("pyav_keyframes")
        if v is None:
            continue
        good = v <= target if key in ("overlap", "cores_per_gpu") else v >= target
        checks.append(f"{key} (keyframes) {v:.2f}: {'meets' if good else 'MISSES'} "
                      f"{'<=' if key in ('overlap', 'cores_per_gpu') else '>='} {target:g}")
    return "\n".join(lines + [""] + checks)


def environment() -> dict:
    return benchlib.env.environment(("av", "ray", "mlx.core", "cv2"))


def results_path(out: Path, env: dict, smoke: bool) -> Path:
    return benchlib.env.results_path(out, env, "pipeline", "-smoke" if smoke else "")


def save(report: dict, path: Path) -> None:
    report["figures"] = figures(report["methods"])
    benchlib.env.save_json(report, path)


# --- main ---------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=192, help="clips in the job")
    ap.add_argument("--distinct", type=int, default=32, help="clips actually encoded (the rest are hard links)")
    ap.add_argument("--long-fraction", type=float, default=0.25, help="share of 600 s clips (the rest 30 s)")
    ap.add_argument("--hevc-fraction", type=float, default=0.25, help="share of HEVC clips (the rest H.264)")
    ap.add_argument("--questions", type=int, default=3, help="questions per clip")
    ap.add_argument("--num-frames", type=int, default=16)
    ap.add_argument("--segment-s", type=float, default=10.0, help="seconds encoded per clip (repeated to length)")
    ap.add_argument("--layers", type=int, default=28, help="text layers (28 = Qwen2.5-VL-7B)")
    ap.add_argument("--vision-layers", type=int, default=32, help="vision blocks (32 = Qwen2.5-VL-7B)")
    ap.add_argument("--max-pixels", type=int, default=448 * 448, help="per frame, after the processor's resize")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-budget-gb", type=float, default=None, help="engine KV/activation budget (GPU: 60)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="auto: gpu when nvidia-smi "
                    "sees one")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="auto: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--decoders", type=int, default=None, help="decode actors (default: CPU cores - 2)")
    ap.add_argument("--frames-in-flight", type=int, default=None, help="default: 2 x decoders + clips per batch")
    ap.add_argument("--clips-per-batch", type=int, default=8)
    ap.add_argument("--decode-timeout-s", type=float, default=600.0)
    ap.add_argument("--baseline-clips", type=int, default=4, help="clips the sequential baseline runs")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
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
    cores = os.cpu_count() or 2
    if args.decoders is None:
        args.decoders = max(1, cores - 2)
    if args.frames_in_flight is None:
        args.frames_in_flight = 2 * args.decoders + args.clips_per_batch
    if args.workers is None:
        args.workers = cores
    if args.smoke or args.tiny_model:
        args.layers, args.vision_layers = min(args.layers, 2), min(args.vision_layers, 4)
        args.max_pixels = min(args.max_pixels, 28 * 28 * 16)
        args.memory_budget_gb = args.memory_budget_gb or 2.0
    if args.smoke:
        args.segment_s = min(args.segment_s, 3.0)
    if args.device == "auto" and not args.smoke and shutil.which("nvidia-smi"):
        args.device = "gpu"
    if args.dtype == "auto" and args.device == "gpu":
        args.dtype = "bfloat16"
    if args.device == "gpu" and args.memory_budget_gb is None:
        args.memory_budget_gb = 60.0
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}; choose from {','.join(METHODS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.baseline_worker:
        model, manifest, clips = args.baseline_worker
        return baseline_worker(model, manifest, int(clips), args)
    from batchjob.synthetic.random_engine import QWEN25_VL_7B, SMOKE

    shape = SMOKE_SHAPE if args.smoke else Shape()
    dims = SMOKE if args.smoke or args.tiny_model else QWEN25_VL_7B
    env = environment()
    path = results_path(args.out, env, args.smoke or args.tiny_model)
    report: dict = {"environment": env, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "methods": {}, "complete": False}
    print(f"# {env['gpu']}, {env['cpus']} CPUs; {args.clips} clips ({args.distinct} encoded, "
          f"{args.long_fraction:.0%} long, {args.hevc_fraction:.0%} HEVC) x {args.questions} questions; "
          f"{args.decoders} decoders; model {args.layers}/{args.vision_layers} layers, device {args.device}, "
          f"dtype {args.dtype}", flush=True)
    specs = plan_clips(args.distinct, long_fraction=args.long_fraction, hevc_fraction=args.hevc_fraction,
                       seed=args.seed, shape=shape)
    manifest, data = build_dataset(args.cache, specs, args.clips, args.questions, args.segment_s, args.workers, args.seed,
                                   shape.long_s)
    report["dataset"] = data
    print(f"dataset: {data['clips']} clips, {data['rows']} rows, {data['encoded']} encoded in {data['build_s']:.1f} s "
          f"({data['bytes_total'] / 2**20:.0f} MiB distinct)", flush=True)
    t0 = time.perf_counter()
    model = ensure_model(args.cache, dims, args.layers, args.vision_layers, args.max_pixels)
    report["model_write_s"] = time.perf_counter() - t0
    save(report, path)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-gpu-"))
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        if method == "baseline":
            got = run_baseline(args, model, manifest, data["rows"])
        else:
            got = run_loader(args, model, manifest, method, work, data["clips"])
        report["methods"][method] = got
        save(report, path)
        print(f"{method}: {time.perf_counter() - t0:.1f} s; " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()
            if k not in ("stats", "output_tail", "engine_runtime", "queue_depth")), flush=True)
    report["complete"] = True
    save(report, path)
    shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(report["methods"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
