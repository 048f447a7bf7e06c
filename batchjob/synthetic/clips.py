"""Synthetic video clips built with PyAV's encoders, for tests, benchmarks and the demo.

No dataset can be downloaded where batchjob is developed, so every clip a test or benchmark needs is
encoded on the spot. Each frame is identifiable: a bar of frame-counter bits along the top edge and a
square that moves with time, so two decoded frames of a clip never look alike and a test can read the
source index back out of a decoded frame (`read_counter`).

The codec settings are chosen to reproduce what real files do to loaders: B-frames (decode order is not
presentation order), long GOPs, a single keyframe, odd dimensions, variable frame rate, a rotation in the
display matrix. Encoders run at their fastest presets; picture quality is irrelevant here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from fractions import Fraction
from typing import Callable, Literal

import av
import numpy as np

Codec = Literal["h264", "hevc", "vp9", "av1", "mpeg4"]
Pattern = Literal["counter", "motion", "noisy"]

COUNTER_BITS = 16  # enough for a 600 s clip at 30 fps (18,000 frames)
_ENCODERS = {"h264": "libx264", "hevc": "libx265", "vp9": "libvpx-vp9", "av1": "libsvtav1", "mpeg4": "mpeg4"}
_CONTAINERS = {"mp4", "mov", "mkv", "webm"}
_FORMATS = {"mp4": "mp4", "mov": "mov", "mkv": "matroska", "webm": "webm"}


# Named clips the loader tests and `scripts/make_clips.py` build: name -> make_clip arguments. Small pictures
# keep encoding and full decodes cheap; the structures (B-frames, HEVC's open GOPs, long GOPs, one keyframe,
# odd sizes, variable frame rate, rotation) are what loaders must survive.
CATALOGUE: dict[str, dict] = {
    "h264_bframes_mp4": dict(codec="h264", container="mp4", seconds=4, gop_seconds=1, bframes=2),
    "h264_open_gop_mp4": dict(codec="h264", container="mp4", seconds=4, gop_seconds=1, bframes=3, open_gop=True),
    "hevc_bframes_mp4": dict(codec="hevc", container="mp4", seconds=4, gop_seconds=1, bframes=3),
    "mpeg4_bframes_mp4": dict(codec="mpeg4", container="mp4", seconds=3, gop_seconds=0.5, bframes=2),
    "h264_bframes_mkv": dict(codec="h264", container="mkv", seconds=3, gop_seconds=0.5, bframes=2),
    "hevc_mov": dict(codec="hevc", container="mov", seconds=3, gop_seconds=0.5, bframes=2),
    "vp9_webm": dict(codec="vp9", container="webm", seconds=3, gop_seconds=0.5),
    "av1_mkv": dict(codec="av1", container="mkv", seconds=2, gop_seconds=0.5, width=128, height=96),
    "h264_long_gop": dict(codec="h264", container="mp4", seconds=20, fps=10, gop_seconds=10, bframes=2,
                          width=96, height=64),
    "h264_single_keyframe": dict(codec="h264", container="mp4", seconds=3, single_keyframe=True, bframes=2),
    "vp9_odd_dims": dict(codec="vp9", container="webm", seconds=2, gop_seconds=0.5, width=161, height=121),
    "h264_vfr": dict(codec="h264", container="mp4", seconds=3, gop_seconds=0.5, bframes=2, vfr=True, seed=3),
    "h264_rot90": dict(codec="h264", container="mp4", seconds=2, gop_seconds=0.5, bframes=2, rotation=90),
    "h264_rot270": dict(codec="h264", container="mp4", seconds=2, gop_seconds=0.5, bframes=2, rotation=-90),
    "h264_dense": dict(codec="h264", container="mp4", seconds=3, gop_seconds=0.1, bframes=2),
}


@dataclasses.dataclass(frozen=True)
class ClipInfo:
    """What was written: tests compare decoders against these facts, not against each other."""

    path: str
    codec: str
    container: str
    num_frames: int
    fps: float
    width: int  # encoded (stored) size; a rotation of +-90 swaps the displayed size
    height: int
    gop_frames: int  # requested keyframe interval in frames (> num_frames for a single-keyframe clip)
    bframes: int
    rotation: int
    vfr: bool


def _counter_cells(width: int, height: int) -> tuple[int, int]:
    """Size of one counter bit's cell: as large as the width allows, so lossy coding cannot flip it."""
    return max(1, width // COUNTER_BITS), max(2, min(16, height // 6))


@functools.lru_cache(maxsize=8)
def _gradient(width: int, height: int) -> np.ndarray:
    """Red rises left to right, green top to bottom: cached, since a 600 s clip draws 18,000 frames."""
    yy, xx = np.mgrid[0:height, 0:width]
    return np.stack([xx * 255 // max(1, width - 1), yy * 255 // max(1, height - 1)], axis=-1).astype(np.uint8)


def draw_frame(index: int, width: int, height: int, *, pattern: Pattern = "counter",
               color: tuple[int, int, int] = (220, 40, 40), direction: int = 1,
               num_frames: int = 1) -> np.ndarray:
    """One RGB frame whose content is a pure function of its index (so encoders see real motion).

    "counter": gradient background, counter bits on top, a square on a diagonal path.
    "motion": plain background and one coloured square crossing the frame left-to-right (direction=1) or
    right-to-left (direction=-1) over the clip, for questions a model can answer.
    "noisy": "counter" under fresh per-frame noise, as a camera's sensor adds it: every picture costs bits, so
    the file has a real camera's bitrate and its keyframes are a small part of it (remote-read tests).
    """
    img = np.empty((height, width, 3), np.uint8)
    side = max(4, min(width, height) // 4)
    if pattern == "motion":
        img[:] = (30, 30, 30)
        progress = index / max(1, num_frames - 1)
        if direction < 0:
            progress = 1.0 - progress
        x0 = int(round(progress * (width - side)))
        y0 = (height - side) // 2
        img[y0:y0 + side, x0:x0 + side] = color
        return img
    if pattern == "noisy":
        img = draw_frame(index, width, height, pattern="counter", color=color)
        noise = np.random.default_rng(index).integers(-24, 25, size=img.shape, dtype=np.int16)
        cw, ch = _counter_cells(width, height)
        noise[:ch] = 0   # the counter bits stay readable
        return np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    img[..., :2] = _gradient(width, height)
    img[..., 2] = (index * 7) % 256
    x0 = (index * 3) % max(1, width - side)
    y0 = (index * 2) % max(1, height - side)
    img[y0:y0 + side, x0:x0 + side] = color
    cw, ch = _counter_cells(width, height)
    for bit in range(COUNTER_BITS):
        img[0:ch, bit * cw:(bit + 1) * cw] = 255 if (index >> bit) & 1 else 0
    return img


def read_counter(frame: np.ndarray) -> int:
    """Read back the frame index drawn by `draw_frame(pattern="counter")` from an upright RGB frame."""
    height, width = frame.shape[:2]
    cw, ch = _counter_cells(width, height)
    value = 0
    for bit in range(COUNTER_BITS):
        cell = frame[1:max(2, ch - 1), bit * cw + cw // 4:bit * cw + max(cw // 4 + 1, 3 * cw // 4)]
        if cell.mean() > 127:
            value |= 1 << bit
    return value


def _encoder_options(codec: str, gop: int, bframes: int, open_gop: bool = False) -> dict[str, str]:
    """Per-encoder settings that pin the GOP (no scene-cut keyframes) and pick the fastest preset.

    x265 makes open GOPs by default (pictures after a keyframe in decode order shown before it); x264
    only when asked (`open_gop`), which is what some cameras and streaming encoders produce.
    """
    if codec == "h264":
        extra = ":open-gop=1" if open_gop else ""
        return {"preset": "ultrafast" if bframes == 0 else "veryfast", "tune": "zerolatency" if bframes == 0 else "",
                "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}{extra}:log-level=error"}
    if codec == "hevc":
        return {"preset": "ultrafast",
                "x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}:log-level=error"}
    if codec == "vp9":
        return {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0", "kf-max-dist": str(gop),
                "kf-min-dist": str(gop)}
    if codec == "av1":
        return {"preset": "12", "svtav1-params": f"keyint={gop}:scd=0"}
    return {}


def _frame_times(num_frames: int, fps: float, vfr: bool, seed: int) -> list[Fraction]:
    """Presentation times in seconds; with vfr, intervals drawn between 0.5x and 2x the nominal one."""
    step = Fraction(1) / Fraction(fps).limit_denominator(1001)
    if not vfr:
        return [i * step for i in range(num_frames)]
    rng = np.random.default_rng(seed)
    factors = rng.choice([Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2)], size=num_frames)
    times, t = [], Fraction(0)
    for f in factors:
        times.append(t)
        t += step * f
    return times


def make_clip(path: str | os.PathLike, *, codec: Codec = "h264", container: str = "mp4",
              seconds: float = 2.0, fps: float = 30.0, width: int = 160, height: int = 120,
              gop_seconds: float = 1.0, bframes: int = 2, pattern: Pattern = "counter", vfr: bool = False,
              rotation: int = 0, single_keyframe: bool = False, seed: int = 0,
              color: tuple[int, int, int] = (220, 40, 40), direction: int = 1,
              faststart: bool = False, open_gop: bool = False,
              draw: Callable[[int, int], np.ndarray] | None = None, crf: int | None = None) -> ClipInfo:
    """Encode a clip; return what was asked for so tests can check decoders against it.

    `draw(index, num_frames)` replaces the built-in patterns (uint8 RGB [height, width, 3] per frame); `crf`
    sets H.264/HEVC quality (the encoder's default otherwise).

    `faststart` puts an MP4's index (moov) before the media data, as web-ready files have it; a file
    cut short then still opens, with an index that promises frames the file no longer holds.

    Odd dimensions need a codec that stores them: VP9 and AV1 do; H.264/HEVC/MPEG-4 in 4:2:0 do not.
    """
    path = os.fspath(path)
    if codec not in _ENCODERS:
        raise ValueError(f"codec {codec!r}: choose one of {sorted(_ENCODERS)}")
    if container not in _CONTAINERS:
        raise ValueError(f"container {container!r}: choose one of {sorted(_CONTAINERS)}")
    if codec in ("h264", "hevc", "mpeg4") and (width % 2 or height % 2):
        raise ValueError(f"{codec} in 4:2:0 needs even dimensions, got {width}x{height}; use vp9 or av1")
    num_frames = max(1, int(round(seconds * fps)))
    gop = num_frames + 1 if single_keyframe else max(1, int(round(gop_seconds * fps)))
    if codec in ("vp9", "av1"):
        bframes = 0  # no B-frames in these codecs (VP9's alt-ref frames are hidden, not reordered)
    times = _frame_times(num_frames, fps, vfr, seed)
    time_base = Fraction(1, 1000) if vfr else 1 / Fraction(fps).limit_denominator(1001)
    if codec == "av1":
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints a banner per encoder otherwise
    options = {"movflags": "faststart"} if faststart and container in ("mp4", "mov") else {}
    with av.open(path, "w", format=_FORMATS.get(container), options=options) as out:
        stream = out.add_stream(_ENCODERS[codec], rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = time_base
        stream.codec_context.time_base = time_base
        stream.codec_context.gop_size = gop
        stream.codec_context.max_b_frames = bframes
        if codec == "mpeg4":
            stream.codec_context.qmax = 4  # keep the counter bits crisp
        options = _encoder_options(codec, gop, bframes, open_gop)
        if crf is not None and codec in ("h264", "hevc"):
            options["crf"] = str(crf)
        stream.options = {k: v for k, v in options.items() if v}
        if rotation:
            stream.set_display_rotation(rotation)
        for i, t in enumerate(times):
            rgb = draw(i, num_frames) if draw is not None else draw_frame(
                i, width, height, pattern=pattern, color=color, direction=direction, num_frames=num_frames)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
            frame.pts = int(round(t / time_base))
            frame.time_base = time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return ClipInfo(path, codec, container, num_frames, float(fps), width, height, gop, bframes, rotation, vfr)


def cut_without_reencode(src: str | os.PathLike, dst: str | os.PathLike, start_seconds: float) -> str:
    """Copy `src` (an MP4) from `start_seconds` on without re-encoding, as `ffmpeg -ss T -i SRC -c copy`
    does: packets from the keyframe before T on, timestamps shifted so T is 0. The muxer then writes an
    edit list that hides the pictures before T (they stay in the file: the ones after T reference them).
    """
    with av.open(os.fspath(src)) as source:
        stream = source.streams.video[0]
        start = int(round(start_seconds / stream.time_base))
        packets = [p for p in source.demux(stream) if p.size and p.pts is not None]
        keyframe = max((p.pts for p in packets if p.is_keyframe and p.pts <= start), default=None)
        if keyframe is None:
            raise ValueError(f"no keyframe at or before {start_seconds} s in {src}")
        first = min(i for i, p in enumerate(packets) if p.is_keyframe and p.pts == keyframe)
        with av.open(os.fspath(dst), "w", format="mp4") as out:
            copy = out.add_stream_from_template(stream)
            for packet in packets[first:]:
                packet.pts -= start
                packet.dts -= start
                packet.stream = copy
                out.mux(packet)
    return os.fspath(dst)


def make_motion_clip(path: str | os.PathLike, *, direction: Literal["left", "right"] = "right",
                     color: tuple[int, int, int] = (220, 40, 40), width: int = 112, height: int = 84,
                     seconds: float = 2.0, fps: float = 8.0, seed: int = 0) -> ClipInfo:
    """A small clip for the demo: one coloured square crossing the frame left or right.

    Deterministic for a given argument set; `seed` only varies the square's colour slightly so a demo set
    of many clips is not made of byte-identical files.
    """
    if direction not in ("left", "right"):
        raise ValueError(f"direction {direction!r}: choose 'left' or 'right'")
    jitter = np.random.default_rng(seed).integers(-15, 16, size=3)
    tinted = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(color, jitter))
    return make_clip(path, codec="h264", container="mp4", seconds=seconds, fps=fps, width=width,
                     height=height, gop_seconds=1.0, bframes=0, pattern="motion", color=tinted,
                     direction=1 if direction == "right" else -1)


def make_scene_clip(path: str | os.PathLike, scene, *, seconds: float, fps: float = 10.0, width: int = 256,
                    height: int = 144, gop_seconds: float = 1.0, single_keyframe: bool = False, bframes: int = 2,
                    crf: int = 18, seed: int = 0) -> ClipInfo:
    """A clip of a `batchjob.synthetic.scenes` scene (shapes moving at known times), H.264 in MP4.

    Frame i shows the scene at clip fraction `i / num_frames` (the instant a uniform sampler's index maps to);
    `seed` draws the frames' noise, so two encodings of one scene differ only there.
    """
    from batchjob.synthetic.scenes import background, render

    base = background(scene, width, height)
    rng = np.random.default_rng(seed)
    noise_seeds = rng.integers(2**31, size=max(1, int(round(seconds * fps))))
    return make_clip(path, codec="h264", container="mp4", seconds=seconds, fps=fps, width=width, height=height,
                     gop_seconds=gop_seconds, single_keyframe=single_keyframe, bframes=bframes, crf=crf,
                     draw=lambda i, n: render(scene, i / n, width, height, int(noise_seeds[i]), base))
