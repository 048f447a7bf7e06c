"""pyav_keyframes against a full decode: same indices, same pixels, on every codec and container."""

from __future__ import annotations

import io

import numpy as np
import pytest

import batchjob.loaders.decode as decode_mod
from batchjob.loaders import load_video
from batchjob.loaders.reference import load_keyframes_reference

from batchjob.synthetic.clips import CATALOGUE

MP4_FAMILY = [name for name, spec in CATALOGUE.items() if spec["container"] in ("mp4", "mov")]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("use_index", [True, False], ids=["auto", "sweep"])
def test_matches_full_decode(clips, expect, rng, name, use_index):
    path, ref = clips(name)
    num_frames = rng.randint(1, 40)
    frames, meta = load_video(path, num_frames=num_frames, use_index=use_index)
    expected = expect.keyframe_sample(ref, num_frames)
    assert meta["frames_indices"] == expected, f"num_frames={num_frames}"
    assert frames.dtype == np.uint8 and frames.shape == (num_frames, *ref.frames[0].shape)
    np.testing.assert_array_equal(frames, ref.at(expected))
    assert meta["total_num_frames"] == len(ref.frames)
    assert meta["video_backend"] == "pyav_keyframes"
    assert meta["fps"] > 0 and meta["duration"] == pytest.approx(len(ref.frames) / meta["fps"])
    assert meta["keyframe_source"] == ("index" if use_index and name in MP4_FAMILY else "sweep")


@pytest.mark.parametrize("name", MP4_FAMILY)
def test_index_path_equals_sweep_path(clips, name):
    """The sample table's DTS-ordered entries must give exactly the sweep's picks (B-frames, open GOPs)."""
    path, ref = clips(name)
    n_kf = len(ref.keyframe_indices)
    for num_frames in (n_kf, 2 * n_kf + 1, max(1, n_kf // 2)):
        a, meta_a = load_video(path, num_frames=num_frames)
        b, meta_b = load_video(path, num_frames=num_frames, use_index=False)
        assert (meta_a["keyframe_source"], meta_b["keyframe_source"]) == ("index", "sweep")
        assert meta_a["frames_indices"] == meta_b["frames_indices"]
        assert meta_a["total_num_frames"] == meta_b["total_num_frames"]
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["hevc_bframes_mp4", "h264_open_gop_mp4"])
def test_open_gop_keyframes_are_not_at_their_decode_position(clips, name):
    """Guards the tests themselves: open GOPs put shown-earlier pictures after each later keyframe, so an
    index path that used decode positions as frame indices would fail the tests above."""
    import av

    path, ref = clips(name)
    with av.open(path) as container:
        flags = [p.is_keyframe for p in container.demux(video=0) if p.size]
    decode_positions = [i for i, key in enumerate(flags) if key]
    assert decode_positions != ref.keyframe_indices


def test_two_keyframes_split_evenly(clips):
    path, ref = clips("h264_long_gop")  # 20 s, GOP 10 s: exactly two keyframes
    assert len(ref.keyframe_indices) == 2
    frames, meta = load_video(path, num_frames=16)
    assert meta["frames_indices"] == [0] * 8 + [ref.keyframe_indices[1]] * 8


def test_repeated_keyframes_are_balanced(clips):
    """More frames asked for than the clip has keyframes: every keyframe, each returned a number of times at
    most one apart from the others (the README's promise; it once gave 4/8/4 for 3 keyframes and 16 frames)."""
    from collections import Counter

    checked = 0
    for name in sorted(CATALOGUE):
        path, ref = clips(name)
        k = len(ref.keyframe_indices)
        for num_frames in (k + 1, 2 * k + 1, 3 * k - 1):
            if k < 3 or num_frames > len(ref.frames):
                continue
            _, meta = load_video(path, num_frames=num_frames)
            counts = Counter(meta["frames_indices"])
            assert sorted(counts) == sorted(ref.keyframe_indices), name
            assert max(counts.values()) - min(counts.values()) <= 1, (name, num_frames, sorted(counts.items()))
            checked += 1
    assert checked >= 6, "the catalogue must hold clips with several keyframes"


def test_package_reference_algorithm_is_correct(clips, expect, rng):
    """The benchmark's baseline must itself return the right frames, or its timings mean nothing."""
    for name in ("hevc_bframes_mp4", "vp9_webm", "h264_vfr"):
        path, ref = clips(name)
        num_frames = rng.randint(1, 24)
        frames, meta = load_keyframes_reference(path, num_frames)
        expected = expect.keyframe_sample(ref, num_frames)
        assert meta["frames_indices"] == expected
        np.testing.assert_array_equal(frames, ref.at(expected))


@pytest.mark.parametrize("name", ["h264_bframes_mp4", "vp9_webm"])
def test_bytes_and_file_objects_match_path(clips, name):
    path, _ = clips(name)
    by_path, meta_path = load_video(path, num_frames=7)
    with open(path, "rb") as f:
        data = f.read()
    by_bytes, meta_bytes = load_video(data, num_frames=7)
    by_file, meta_file = load_video(io.BytesIO(data), num_frames=7)
    for frames, meta in ((by_bytes, meta_bytes), (by_file, meta_file)):
        np.testing.assert_array_equal(frames, by_path)
        assert meta["frames_indices"] == meta_path["frames_indices"]


@pytest.mark.parametrize("name", ["h264_bframes_mp4", "h264_open_gop_mp4", "hevc_bframes_mp4", "h264_bframes_mkv"])
def test_never_decodes_a_delta_frame(clips, monkeypatch, name):
    """Every packet handed to the decoder is a keyframe, and each distinct keyframe is decoded once."""
    path, ref = clips(name)
    seen = []
    original = decode_mod.decode_alone

    def spy(codec, packet):
        seen.append((packet.is_keyframe, packet.pts))
        return original(codec, packet)

    def forbidden(*args, **kwargs):
        raise AssertionError("pyav_keyframes ran a forward decode")

    monkeypatch.setattr(decode_mod, "decode_alone", spy)
    monkeypatch.setattr(decode_mod, "decode_run", forbidden)
    _, meta = load_video(path, num_frames=24)
    assert all(key for key, _ in seen)
    assert len(seen) == len({pts for _, pts in seen}) == len(set(meta["frames_indices"]))


def test_unknown_kwargs_are_ignored(clips):
    path, _ = clips("vp9_webm")
    a, _ = load_video(path, num_frames=5)
    b, _ = load_video(path, num_frames=5, fps=2, max_duration=300, requested_video_backend="x")
    np.testing.assert_array_equal(a, b)
