"""Clips and an independent reference decode for the loader tests.

The reference never seeks: it decodes every frame with plain PyAV, orders them by presentation time and
marks keyframes by the demuxer's packet flags. Loaders are then checked against it pixel for pixel.
"""

from __future__ import annotations

import dataclasses
import os
import random
import types
import zlib

import av
import numpy as np
import pytest

from batchjob.synthetic.clips import CATALOGUE, make_clip

SEED = int(os.environ.get("BATCHJOB_TEST_SEED", random.randrange(2**31)))

EXT = {"mp4": "mp4", "mov": "mov", "mkv": "mkv", "webm": "webm"}


@dataclasses.dataclass(frozen=True)
class Decoded:
    """Every frame of a clip in presentation order, upright, and which of them are keyframes."""

    frames: list[np.ndarray]
    pts: list[int]
    keyframe_indices: list[int]

    def at(self, indices: list[int]) -> np.ndarray:
        return np.stack([self.frames[i] for i in indices])


def upright(frame: av.VideoFrame) -> np.ndarray:
    """Written here, not imported: rotate by the display matrix's counter-clockwise angle."""
    rgb = frame.to_ndarray(format="rgb24")
    return np.rot90(rgb, k=int(round(frame.rotation / 90)) % 4) if frame.rotation else rgb


def full_decode(path: str) -> Decoded:
    with av.open(path) as container:
        key_pts = {p.pts for p in container.demux(video=0) if p.size and p.is_keyframe}
    with av.open(path) as container:
        decoded = sorted(((f.pts, upright(f)) for f in container.decode(video=0)), key=lambda t: t[0])
    pts = [p for p, _ in decoded]
    return Decoded([np.ascontiguousarray(f) for _, f in decoded], pts, [i for i, p in enumerate(pts) if p in key_pts])


def keyframe_sample_indices(decoded: Decoded, num_frames: int) -> list[int]:
    """The documented rule, spelled out: up to one frame per keyframe, picks spread over the keyframe list by
    round(linspace); more frames than keyframes, frame i is the keyframe whose equal share of the frame slots
    holds slot i's centre (every keyframe, counts at most one apart)."""
    n = len(decoded.keyframe_indices)
    if num_frames <= n:
        picks = np.round(np.linspace(0, n - 1, num_frames))
    else:
        picks = [np.floor((i + 0.5) * n / num_frames) for i in range(num_frames)]
    return [decoded.keyframe_indices[int(p)] for p in picks]


def uniform_indices(total: int, num_frames: int) -> list[int]:
    if num_frames >= total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, num_frames, dtype=int)]


def adaptive_fill_indices(decoded: Decoded, num_frames: int) -> list[int]:
    """The adaptive loader's documented placement when the budget suffices: uniform frames, each moved
    onto the nearest keyframe (earlier on ties) lying strictly within half a spacing of it."""
    targets = uniform_indices(len(decoded.frames), num_frames)
    if len(targets) < 2:
        return targets
    half = ((len(decoded.frames) - 1) // (len(targets) - 1)) / 2
    out = []
    for t in targets:
        candidates = sorted((abs(k - t), k) for k in decoded.keyframe_indices if abs(k - t) < half)
        out.append(candidates[0][1] if candidates else t)
    return out


@pytest.fixture(scope="session")
def expect():
    """The expected-index rules, as a fixture because test modules cannot import this conftest."""
    return types.SimpleNamespace(keyframe_sample=keyframe_sample_indices, uniform=uniform_indices,
                                 adaptive_fill=adaptive_fill_indices,
                                 full_decode=full_decode)


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("clips"))


_cache: dict[str, tuple[str, Decoded]] = {}


@pytest.fixture(scope="session")
def clips(clip_dir):
    """clips(name) -> (path, reference decode); each clip is encoded and decoded once per session."""

    def get(name: str) -> tuple[str, Decoded]:
        if name not in _cache:
            spec = CATALOGUE[name]
            path = os.path.join(clip_dir, f"{name}.{EXT[spec['container']]}")
            make_clip(path, **spec)
            _cache[name] = (path, full_decode(path))
        return _cache[name]

    return get


@pytest.fixture
def rng(request) -> random.Random:
    """Fresh draws per test; the seed is printed so a failure can be replayed with BATCHJOB_TEST_SEED."""
    seed = SEED ^ zlib.crc32(request.node.nodeid.encode())
    print(f"seed: BATCHJOB_TEST_SEED={SEED} (per-test {seed})")
    return random.Random(seed)
