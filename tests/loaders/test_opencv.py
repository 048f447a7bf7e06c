"""opencv: the lossless uniform baseline, checked against the full decode and against the PyAV loaders."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.loaders import UnsupportedMedia, load_video


@pytest.mark.parametrize("name", ["h264_bframes_mp4", "h264_open_gop_mp4", "hevc_bframes_mp4", "mpeg4_bframes_mp4",
                                  "vp9_webm",
                                  "h264_bframes_mkv", "h264_vfr", "h264_single_keyframe"])
def test_matches_full_decode(clips, expect, rng, name):
    path, ref = clips(name)
    num_frames = rng.randint(1, 32)
    frames, meta = load_video(path, backend="opencv", num_frames=num_frames)
    expected = expect.uniform(len(ref.frames), num_frames)
    assert meta["frames_indices"] == expected and meta["total_num_frames"] == len(ref.frames)
    np.testing.assert_array_equal(frames, ref.at(expected))


@pytest.mark.parametrize("name", ["h264_rot90", "h264_rot270"])
def test_rotation_agrees_with_pyav(clips, expect, name):
    """OpenCV applies the display matrix with its own code; the reference decode (which the PyAV loaders
    match exactly) must land on the same upright pixels."""
    path, ref = clips(name)
    cv_frames, cv_meta = load_video(path, backend="opencv", num_frames=9)
    assert cv_meta["frames_indices"] == expect.uniform(len(ref.frames), 9)
    assert cv_frames.shape[1:3] == (160, 120)  # stored 160x120, shown a quarter turn round
    np.testing.assert_array_equal(cv_frames, ref.at(cv_meta["frames_indices"]))
    av_frames, av_meta = load_video(path, backend="pyav_keyframes", num_frames=3)
    np.testing.assert_array_equal(av_frames, ref.at(av_meta["frames_indices"]))


def test_odd_dimensions_keep_size_and_indices(clips, expect):
    """OpenCV converts odd-sized 4:2:0 to RGB with its own chroma rounding, so pixels may differ slightly
    from PyAV's conversion there; sizes and frame choice must not."""
    path, ref = clips("vp9_odd_dims")
    frames, meta = load_video(path, backend="opencv", num_frames=8)
    expected = expect.uniform(len(ref.frames), 8)
    assert meta["frames_indices"] == expected and frames.shape[1:] == (121, 161, 3)
    diff = np.abs(frames.astype(int) - ref.at(expected).astype(int))
    assert np.median(diff) == 0 and diff.mean() < 2.0


def test_av1_is_decoded_exactly_or_refused_clearly(clips, expect):
    """The OpenCV wheel's FFmpeg has no software AV1 decoder; a build that has one must then be exact."""
    path, ref = clips("av1_mkv")
    try:
        frames, meta = load_video(path, backend="opencv", num_frames=6)
    except UnsupportedMedia as err:
        assert path in str(err) and "PyAV" in str(err)
    else:
        np.testing.assert_array_equal(frames, ref.at(expect.uniform(len(ref.frames), 6)))
