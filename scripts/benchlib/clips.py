"""Synthetic clips shaped like real footage for the pipeline benchmarks: sizes, lengths, codecs, GOPs.

Encoding 600 s of 1080p per clip would take minutes a clip, so each clip is a segment of whole GOPs encoded once
and repeated, packets remuxed with shifted timestamps: the files have the length, GOP structure and bitrate of
long footage, and a decoder pays for every frame as it would there.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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


def encode_clips(folder: Path, specs: list[ClipSpec], segment_s: float, workers: int) -> tuple[dict[str, float], float]:
    """Encode the specs not yet in `folder`, in parallel (longest first, so the pool does not end on one long
    clip). Returns each encoded clip's seconds and the wall time."""
    import multiprocessing

    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in dict.fromkeys(specs) if not (folder / s.name).exists()]
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    if todo:
        print(f"encoding {len(todo)} clips on {workers} processes into {folder} ...", flush=True)
        todo.sort(key=lambda s: -s.segment_frames(segment_s) * s.width * s.height * (4 if s.codec == "hevc" else 1))
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for name, dt in pool.imap_unordered(build_clip, [(s, str(folder), segment_s) for s in todo]):
                times[name] = dt
    return times, time.perf_counter() - t0
