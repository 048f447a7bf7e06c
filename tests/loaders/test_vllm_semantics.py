"""vLLM's media kwargs and the files vLLM's own loaders handle, for every batchjob loader (no vLLM needed).

Expected frame counts are vLLM's uniform-loader rule restated here; frames are checked pixel for pixel
against a full decode (conftest.full_decode), which never seeks.
"""

from __future__ import annotations

import math

import av
import numpy as np
import pytest

from batchjob.loaders import CorruptVideo, load_video
from batchjob.synthetic.clips import cut_without_reencode, make_clip

LOADERS = ["pyav_keyframes", "pyav_adaptive", "pyav_burst", "opencv"]
CLIPS = ["h264_bframes_mp4", "hevc_bframes_mp4", "h264_bframes_mkv", "vp9_webm", "h264_single_keyframe",
         "h264_dense"]


def vllm_count(total: int, clip_fps: float, num_frames: int, fps: float) -> int:
    """vLLM 0.32's uniform loader: min(num_frames, total) (-1: all), then at most floor(duration * fps)."""
    count = total if num_frames <= 0 else min(num_frames, total)
    if fps > 0:
        count = min(count, math.floor(total / clip_fps * fps))
    return max(1, count)


def check_pixels(frames, meta, decoded, loader):
    expected = decoded.at(meta["frames_indices"])
    if loader == "opencv":  # OpenCV's own FFmpeg converts YUV->RGB with different rounding
        assert np.abs(frames.astype(int) - expected).max() <= 8
    else:
        np.testing.assert_array_equal(frames, expected)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("clip", CLIPS)
def test_fps_limits_the_count_like_vllm(clips, rng, loader, clip):
    path, decoded = clips(clip)
    total = len(decoded.frames)
    clip_fps = float(av.open(path).streams.video[0].average_rate)
    for _ in range(3):
        num_frames = rng.choice([-1, 1, 2, rng.randint(3, 40), total, total + rng.randint(1, 50)])
        fps = rng.choice([-1, 0.5, 1, 2, round(rng.uniform(0.1, 12), 3)])
        if loader == "pyav_keyframes" and num_frames == -1:
            continue  # every keyframe: its own test below
        frames, meta = load_video(path, backend=loader, num_frames=num_frames, fps=fps, max_duration=1)
        want = vllm_count(total, clip_fps, num_frames, fps)
        assert len(frames) == len(meta["frames_indices"]) == want, (num_frames, fps)
        assert meta["total_num_frames"] == total
        check_pixels(frames, meta, decoded, loader)
        if loader == "opencv":  # uniform placement, as vLLM's loader places them
            assert meta["frames_indices"] == [int(i) for i in np.linspace(0, total - 1, want, dtype=int)]


@pytest.mark.parametrize("clip", CLIPS)
def test_all_frames_means_every_keyframe_for_the_keyframe_loader(clips, clip):
    path, decoded = clips(clip)
    frames, meta = load_video(path, backend="pyav_keyframes", num_frames=-1)
    assert meta["frames_indices"] == decoded.keyframe_indices
    check_pixels(frames, meta, decoded, "pyav_keyframes")


@pytest.mark.parametrize("loader", ["pyav_adaptive", "pyav_burst", "opencv"])
@pytest.mark.parametrize("clip", ["h264_bframes_mp4", "h264_bframes_mkv", "h264_single_keyframe"])
def test_all_frames_and_overlong_requests_give_each_frame_once(clips, loader, clip):
    path, decoded = clips(clip)
    total = len(decoded.frames)
    for num_frames in (-1, total, total + 7):
        frames, meta = load_video(path, backend=loader, num_frames=num_frames)
        assert meta["frames_indices"] == list(range(total)) and meta["do_sample_frames"] is True
        check_pixels(frames, meta, decoded, loader)


def test_keyframe_loader_never_returns_more_frames_than_the_clip_has(tmp_path):
    path = make_clip(tmp_path / "all_key.mp4", seconds=0.4, fps=10, gop_seconds=0.1, bframes=0).path  # 4 frames
    frames, meta = load_video(path, backend="pyav_keyframes", num_frames=32)
    assert meta["frames_indices"] == [0, 1, 2, 3]  # every frame a keyframe: each once, no repeats


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    """Clips cut with an edit list between keyframes, and their visible frames (a full decode)."""
    d = tmp_path_factory.mktemp("trimmed")
    out = {}
    for name, kwargs, start in [("bframes", dict(seconds=4, gop_seconds=1, bframes=2), 1.5),
                                ("one_gop", dict(seconds=2, gop_seconds=4, bframes=2), 0.7),
                                ("hevc", dict(codec="hevc", seconds=3, gop_seconds=1, bframes=3), 1.2)]:
        src = make_clip(d / f"{name}_src.mp4", **kwargs).path
        path = cut_without_reencode(src, d / f"{name}.mp4", start)
        with av.open(path) as container:
            stream = container.streams.video[0]
            assert any(p.is_discard for p in container.demux(stream) if p.size), "the cut made no edit list"
        out[name] = path
    return out


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name", ["bframes", "one_gop", "hevc"])
def test_edit_list_trimmed_mp4_returns_the_visible_frames(trimmed, loader, name, expect):
    path = trimmed[name]
    decoded = expect.full_decode(path)  # decoders drop the hidden pictures: what a player shows
    total = len(decoded.frames)
    for use_index in (True, False):
        for num_frames in (4, 12, -1):
            frames, meta = load_video(path, backend=loader, num_frames=num_frames, use_index=use_index)
            assert meta["total_num_frames"] == total
            check_pixels(frames, meta, decoded, loader)
            if loader == "pyav_keyframes":
                # the first visible frame stands in for the hidden keyframe that starts the clip
                keys = sorted(set([0] + decoded.keyframe_indices))
                assert set(meta["frames_indices"]) <= set(keys)
                if num_frames == -1:
                    assert meta["frames_indices"] == keys
            elif num_frames == -1:
                assert meta["frames_indices"] == list(range(total))


def _refused_packet_clip(tmp_path) -> tuple[str, str, int]:
    """A one-GOP clip without B-frame references whose packet for frame k is garbage the decoder refuses."""
    src = make_clip(tmp_path / "ok.mp4", seconds=2, single_keyframe=True, bframes=1).path
    with av.open(src) as container:
        packets = [(p.pts, p.pos, p.size, p.is_keyframe) for p in container.demux(video=0) if p.size]
        all_pts = sorted(p[0] for p in packets)
    # a non-reference B picture (shown before the P picture decoded just ahead of it) far from the targets
    bframes = [(pts, pos, size) for i, (pts, pos, size, key) in enumerate(packets)
               if 0 < i and not key and pts < packets[i - 1][0]]
    pts, pos, size = min(bframes, key=lambda b: abs(all_pts.index(b[0]) - 29))
    data = bytearray(open(src, "rb").read())
    data[pos:pos + size] = bytes([0xFF]) * size  # NAL length prefix included: not a picture any more
    bad = str(tmp_path / "bad.mp4")
    open(bad, "wb").write(bytes(data))
    return src, bad, all_pts.index(pts)


def test_adaptive_skips_a_damaged_packet_it_does_not_need(tmp_path, expect):
    src, bad, damaged = _refused_packet_clip(tmp_path)
    with av.open(bad) as container, pytest.raises(av.error.InvalidDataError):
        for _ in container.decode(video=0):
            pass  # the damage is real: a plain full decode stops there
    reference = expect.full_decode(src)
    frames, meta = load_video(bad, backend="pyav_adaptive", num_frames=4)
    assert meta["adaptive_mode"] == "fill" and damaged not in meta["frames_indices"]
    np.testing.assert_array_equal(frames, reference.at(meta["frames_indices"]))
    with pytest.raises(CorruptVideo, match="never came out"):  # asking for that very frame still fails
        load_video(bad, backend="pyav_adaptive", num_frames=-1)
