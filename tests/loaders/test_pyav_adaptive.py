"""pyav_adaptive: keyframes when they cover the budget, exact uniform frames when they do not."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.loaders import load_video
from batchjob.synthetic.clips import read_counter


def test_dense_keyframes_return_what_pyav_keyframes_returns(clips, rng):
    path, ref = clips("h264_dense")
    num_frames = rng.randint(1, len(ref.keyframe_indices))
    a, meta_a = load_video(path, backend="pyav_adaptive", num_frames=num_frames)
    b, meta_b = load_video(path, backend="pyav_keyframes", num_frames=num_frames)
    assert meta_a["adaptive_mode"] == "keyframes"
    assert meta_a["frames_indices"] == meta_b["frames_indices"]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["h264_single_keyframe", "h264_long_gop"])
def test_few_keyframes_fill_with_distinct_exact_frames(clips, expect, rng, name):
    """The published failure: one keyframe, sixteen copies of the first instant. Here: 16 distinct frames."""
    path, ref = clips(name)
    num_frames = rng.randint(len(ref.keyframe_indices) + 1, 24)
    frames, meta = load_video(path, backend="pyav_adaptive", num_frames=num_frames)
    expected = expect.adaptive_fill(ref, num_frames)
    assert meta["adaptive_mode"] == "fill"
    assert meta["frames_indices"] == expected
    if name == "h264_single_keyframe":
        assert expected == expect.uniform(len(ref.frames), num_frames)  # only frame 0 is a keyframe
    assert len(set(expected)) == num_frames == frames.shape[0]
    np.testing.assert_array_equal(frames, ref.at(expected))
    assert [read_counter(f) for f in frames] == expected  # the encoded counter agrees, independently


@pytest.mark.parametrize("name", ["hevc_bframes_mp4", "h264_open_gop_mp4", "mpeg4_bframes_mp4", "h264_bframes_mkv",
                                  "vp9_webm",
                                  "av1_mkv", "h264_vfr", "h264_rot90", "vp9_odd_dims", "hevc_mov"])
def test_fill_is_pixel_exact_on_every_codec(clips, expect, name):
    """Open GOPs (HEVC, x264 open-gop), B-frames, VFR, rotation: forward-decoded frames equal a full decode."""
    path, ref = clips(name)
    num_frames = min(len(ref.frames), len(ref.keyframe_indices) + 5)
    frames, meta = load_video(path, backend="pyav_adaptive", num_frames=num_frames)
    expected = expect.adaptive_fill(ref, num_frames)
    assert meta["adaptive_mode"] == "fill" and meta["frames_indices"] == expected
    assert any(i not in ref.keyframe_indices for i in expected)  # some frames really were decoded forward
    np.testing.assert_array_equal(frames, ref.at(expected))


def test_decode_budget_bounds_the_work_and_keeps_frames_exact(clips, rng):
    path, ref = clips("h264_single_keyframe")
    budget = rng.randint(16, 60)  # far below the 90 frames an exact plan needs
    frames, meta = load_video(path, backend="pyav_adaptive", num_frames=16, max_decoded_frames=budget)
    indices = meta["frames_indices"]
    assert meta["decoded_frames"] <= budget, f"budget={budget}"
    assert indices == sorted(indices) and indices[0] == 0 and max(indices) < budget
    np.testing.assert_array_equal(frames, ref.at(indices))


def test_fewer_frames_than_asked_returns_every_frame(clips):
    path, ref = clips("h264_single_keyframe")
    frames, meta = load_video(path, backend="pyav_adaptive", num_frames=len(ref.frames) + 10)
    assert meta["frames_indices"] == list(range(len(ref.frames)))
    assert meta["do_sample_frames"] is True
    np.testing.assert_array_equal(frames, np.stack(ref.frames))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_budget_is_refused(clips, bad):
    from batchjob.loaders import InvalidArgument

    path, _ = clips("h264_single_keyframe")
    with pytest.raises(InvalidArgument, match="max_decoded_frames"):
        load_video(path, backend="pyav_adaptive", max_decoded_frames=bad)
