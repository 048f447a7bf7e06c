"""The clip builder writes what it promises (the loader tests rely on it)."""

from __future__ import annotations

import av
import numpy as np
import pytest

from batchjob.synthetic.clips import draw_frame, make_clip, make_motion_clip, read_counter


@pytest.mark.parametrize("codec,container", [("h264", "mp4"), ("hevc", "mkv"), ("vp9", "webm"), ("mpeg4", "mov")])
def test_clip_has_the_frames_and_gop_asked_for(tmp_path, rng, codec, container):
    fps = rng.choice([10, 24, 30])
    gop_seconds = rng.choice([0.5, 1.0])
    info = make_clip(tmp_path / f"c.{container}", codec=codec, container=container, seconds=2, fps=fps,
                     gop_seconds=gop_seconds)
    with av.open(info.path) as c:
        packets = [(p.pts, p.is_keyframe) for p in c.demux(video=0) if p.size]
    with av.open(info.path) as c:
        frames = sorted(c.decode(video=0), key=lambda f: f.pts)
    assert len(packets) == len(frames) == info.num_frames == 2 * fps
    key_pts = {pts for pts, key in packets if key}
    flags = [f.pts in key_pts for f in frames]  # presentation order (HEVC's open GOPs reorder keyframes)
    assert [read_counter(f.to_ndarray(format="rgb24")) for f in frames] == list(range(info.num_frames))
    positions = [i for i, key in enumerate(flags) if key] + [len(flags)]
    assert positions[0] == 0
    # the GOP is a maximum in decode order; reordering B-frames can shift a keyframe by up to `bframes`
    assert max(np.diff(positions)) <= info.gop_frames + info.bframes
    if codec in ("h264", "hevc"):  # x264/x265 are pinned (min-keyint = keyint, no scene cuts)
        assert len(positions) - 1 == -(-info.num_frames // info.gop_frames)


def test_single_keyframe_and_rotation(tmp_path):
    info = make_clip(tmp_path / "one.mp4", seconds=2, single_keyframe=True, rotation=90)
    with av.open(info.path) as c:
        flags = [p.is_keyframe for p in c.demux(video=0) if p.size]
    with av.open(info.path) as c:
        rotation = next(iter(c.decode(video=0))).rotation
    assert sum(flags) == 1 and flags[0] and rotation == 90


def test_vfr_clip_has_uneven_intervals(tmp_path):
    info = make_clip(tmp_path / "vfr.mp4", seconds=2, vfr=True, seed=1)
    with av.open(info.path) as c:
        pts = sorted(f.pts for f in c.decode(video=0))
    assert len(set(np.diff(pts).tolist())) > 1


def test_counter_roundtrip_on_raw_frames(rng):
    for _ in range(20):
        index = rng.randrange(2 ** 16)
        assert read_counter(draw_frame(index, 160, 120)) == index


def test_odd_dimensions_need_a_capable_codec(tmp_path):
    with pytest.raises(ValueError, match="even dimensions"):
        make_clip(tmp_path / "odd.mp4", width=65, height=49)


@pytest.mark.parametrize("direction", ["left", "right"])
def test_motion_clip_moves_the_named_way_deterministically(tmp_path, direction):
    a = make_motion_clip(tmp_path / "a.mp4", direction=direction, seed=4)
    b = make_motion_clip(tmp_path / "b.mp4", direction=direction, seed=4)

    def centroids(path):
        with av.open(path) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        xs = [np.nonzero(f.astype(int).sum(axis=2) > 300)[1].mean() for f in frames]
        return frames, xs

    frames_a, xs = centroids(a.path)
    frames_b, _ = centroids(b.path)
    np.testing.assert_array_equal(np.stack(frames_a), np.stack(frames_b))
    assert (xs[-1] > xs[0] + 20) if direction == "right" else (xs[-1] < xs[0] - 20)
