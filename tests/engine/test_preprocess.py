"""Video preprocessing against transformers' own image processor and an independent numpy patchify."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batchjob.engine import EngineError
from batchjob.engine.preprocess import VisionSettings, load_vision_settings, preprocess_video, sampling_fps


def _torch_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """What torchvision's resize does to a uint8 video (transformers' video processor): PyTorch's uint8
    antialiased bicubic (torchvision itself cannot be imported beside the CPU torch here)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    x = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return x.permute(0, 2, 3, 1).numpy()


def _reference_video_patches(frames: np.ndarray, settings: VisionSettings) -> tuple[np.ndarray, tuple]:
    """Frames -> resized as the video processor resizes (torch), normalized via transformers' PIL image
    processor (one image each, already at its size), then the video processor's documented layout:
    (t, h/m, w/m, m, m, C, temporal, patch, patch), written out directly."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    h, w = smart_resize(frames.shape[1], frames.shape[2], factor=p * m, min_pixels=settings.min_pixels,
                        max_pixels=settings.max_pixels)
    proc = Qwen2VLImageProcessorPil(min_pixels=settings.min_pixels, max_pixels=settings.max_pixels)
    if (h, w) != frames.shape[1:3]:
        frames = _torch_resize(frames, h, w)
    # Undo the image processor's patchify on a single frame to recover the normalized image [C, H, W].
    images = []
    for frame in frames:
        flat = np.asarray(proc(frame, return_tensors="np")["pixel_values"])
        gh, gw = h // p, w // p
        patches = flat.reshape(gh // m, gw // m, m, m, 3, tp, p, p)[:, :, :, :, :, 0]
        images.append(patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h, w))
    video = np.stack(images)
    if len(video) % tp:
        video = np.concatenate([video, np.repeat(video[-1:], tp - len(video) % tp, axis=0)])
    gt, gh, gw = len(video) // tp, h // p, w // p
    x = video.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * tp * p * p), (gt, gh, gw)


@pytest.mark.parametrize("num_frames", [1, 2, 3, 4, 5])
def test_matches_reference_layout(num_frames, rng):
    settings = VisionSettings(min_pixels=28 * 28 * 2, max_pixels=int(rng.integers(28 * 28 * 4, 28 * 28 * 30)))
    frames = rng.integers(0, 256, (num_frames, int(rng.integers(40, 200)), int(rng.integers(40, 200)), 3),
                          dtype=np.uint8)
    out = preprocess_video(frames, {"fps": 30.0, "frames_indices": list(range(num_frames))}, settings)
    expected, grid = _reference_video_patches(frames, settings)
    assert out.grid_thw == grid
    assert out.num_tokens == grid[0] * grid[1] * grid[2] // 4
    np.testing.assert_allclose(out.pixel_values, expected, rtol=0, atol=1e-6)


def test_resize_is_the_video_processors(rng):
    """Our numpy resize is bit-identical to PyTorch's uint8 antialiased bicubic (torchvision's path), down,
    up, and one axis only."""
    from batchjob.engine.resize import resize_frames

    for _ in range(12):
        h, w = int(rng.integers(20, 220)), int(rng.integers(20, 220))
        frames = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        height, width = int(rng.integers(14, 200)), int(rng.integers(14, 200))
        height = h if rng.random() < 0.25 else height
        want = _torch_resize(frames, height, width)
        np.testing.assert_array_equal(resize_frames(frames, height, width, backend="numpy"), want)
        np.testing.assert_array_equal(resize_frames(frames, height, width, backend="torch"), want)


def test_resize_backends_agree_at_real_frame_sizes(rng, monkeypatch):
    """1080p and 720p frames down to Qwen's grids: the torch kernel the decoders use when torch is installed
    and the numpy path they fall back on give the same bytes; `BATCHJOB_RESIZE=numpy` forces numpy."""
    from batchjob.engine import resize

    for (h, w), (height, width) in [((1080, 1920), (336, 588)), ((720, 1280), (448, 784)), ((360, 640), (364, 644))]:
        frames = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        numpy_out = resize.resize_frames(frames, height, width, backend="numpy")
        np.testing.assert_array_equal(resize.resize_frames(frames, height, width), numpy_out)
    monkeypatch.setenv("BATCHJOB_RESIZE", "numpy")
    assert resize._torch_resize(frames, height, width) is None
    same = frames[:, :100, :120]
    assert resize.resize_frames(same, 100, 120) is same


def test_identical_frames_equal_image_processor_output(rng):
    """A clip of two identical frames (at the grid's size) is exactly what the image processor makes of that image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = VisionSettings(min_pixels=3136, max_pixels=28 * 28 * 20)
    frame = rng.integers(0, 256, (1, 84, 140, 3), dtype=np.uint8)
    out = preprocess_video(np.repeat(frame, 2, axis=0), {"fps": 2.0}, settings)
    image = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=28 * 28 * 20)(frame[0], return_tensors="np")
    np.testing.assert_array_equal(out.pixel_values, np.asarray(image["pixel_values"], dtype=np.float32))
    assert out.grid_thw == tuple(int(v) for v in image["image_grid_thw"][0])


def test_sampling_fps_actual_rule_from_uneven_indices():
    actual = lambda meta: sampling_fps(meta, rule="actual")  # noqa: E731
    assert actual({"fps": 30.0, "frames_indices": [0, 30, 90], "total_num_frames": 300}) == pytest.approx(2 / 3)
    assert actual({"fps": 25.0, "frames_indices": [7]}) == 25.0  # no span: source fps
    assert actual({"fps": 25.0, "frames_indices": [4, 4, 4]}) == 25.0
    assert actual({}) == 2.0  # Qwen's default sampling rate when nothing is known
    out = preprocess_video(np.zeros((4, 28, 28, 3), np.uint8), {"fps": 30.0, "frames_indices": [0, 10, 20, 30],
                                                               "total_num_frames": 1000},
                           VisionSettings(min_pixels=784, max_pixels=784 * 4, temporal_step="actual"))
    assert out.second_per_grid_t == pytest.approx(2 / 3.0)


def test_sampling_fps_nominal_rule_is_transformers_video_metadata():
    """The default step is the one the model was trained with: transformers' VideoMetadata.sampled_fps."""
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(11)
    for _ in range(50):
        total = int(rng.integers(2, 20_000))
        n = int(rng.integers(1, min(total, 64) + 1))
        indices = sorted(rng.choice(total, n, replace=False).tolist())
        fps = float(rng.choice([23.976, 24.0, 25.0, 29.97, 30.0, 60.0]))
        meta = {"fps": fps, "frames_indices": indices, "total_num_frames": total}
        want = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=indices).sampled_fps
        assert sampling_fps(meta) == pytest.approx(want, rel=1e-12)
        out = preprocess_video(np.zeros((n, 28, 28, 3), np.uint8), meta, VisionSettings(784, 784 * 4))
        assert out.second_per_grid_t == pytest.approx(2 / want, rel=1e-12)
    # Without the clip's frame count the nominal rule has nothing to spread over: the actual spacing is used.
    assert sampling_fps({"fps": 30.0, "frames_indices": [0, 30, 90]}) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="nominal, actual"):
        sampling_fps({"fps": 30.0}, rule="uniform")


def test_bad_frames_are_clear_errors():
    settings = VisionSettings(min_pixels=784, max_pixels=784 * 4)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_video(np.zeros((2, 28, 28, 3), np.float32), {}, settings)
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        preprocess_video(np.zeros((28, 28, 3), np.uint8), {}, settings)


def test_vision_settings_from_checkpoint_and_overrides(tmp_path):
    with pytest.raises(EngineError, match="preprocessor_config.json"):
        load_vision_settings(tmp_path, None, None)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100, "max_pixels": 5000}))
    assert (load_vision_settings(tmp_path, None, None).min_pixels, load_vision_settings(tmp_path, None, None).max_pixels) == (100, 5000)
    assert load_vision_settings(tmp_path, None, 9000).max_pixels == 9000
    # transformers 5 layout and a video-specific config, which takes precedence
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 200, "longest_edge": 7000}, "temporal_patch_size": 2}))
    s = load_vision_settings(tmp_path, None, None)
    assert (s.min_pixels, s.max_pixels) == (200, 7000)
    with pytest.raises(EngineError, match="inverted"):
        load_vision_settings(tmp_path, 8000, None)


@pytest.mark.parametrize("trial", range(6))
def test_plan_matches_what_preprocessing_makes(trial, rng):
    """The prompt is planned from the frame shape alone; the processor must then make exactly that grid."""
    from batchjob.engine.preprocess import plan_video

    settings = VisionSettings(min_pixels=28 * 28 * int(rng.integers(1, 5)), max_pixels=28 * 28 * int(rng.integers(5, 40)))
    shape = (int(rng.integers(1, 6)), int(rng.integers(28, 300)), int(rng.integers(28, 300)), 3)
    meta = {"fps": 25.0, "frames_indices": sorted(rng.integers(0, 500, shape[0]).tolist())}
    plan = plan_video(shape, meta, settings)
    out = preprocess_video(rng.integers(0, 256, shape, dtype=np.uint8), meta, settings)
    assert (out.grid_thw, out.num_tokens, out.second_per_grid_t) == (plan.grid_thw, plan.num_tokens,
                                                                     plan.second_per_grid_t)
    assert out.pixel_values.shape == (np.prod(plan.grid_thw), 3 * 2 * 14 * 14) and out.settings == settings


@pytest.mark.parametrize("h,w,min_px,max_px", [(28, 210, 784, 3920), (203, 28, 784, 3920), (40, 290, 2352, 3920)])
def test_the_processor_does_not_plan_again(h, w, min_px, max_px, rng):
    """smart_resize is not idempotent at extreme aspect ratios (28x210 under 3,920 pixels plans 28x168, which a
    second call shrinks to 28x140): the frames are resized once, to the plan, as the video processor does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    first = smart_resize(h, w, 28, min_px, max_px)
    assert smart_resize(*first, 28, min_px, max_px) != first, "the case no longer exercises a second resize"
    settings = VisionSettings(min_pixels=min_px, max_pixels=max_px)
    out = preprocess_video(rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8), {"fps": 25.0}, settings)
    assert out.grid_thw == (1, first[0] // 14, first[1] // 14)


def test_prepared_inputs_are_checked_against_the_settings(rng):
    import dataclasses

    from batchjob.engine.preprocess import check_prepared

    settings = VisionSettings(min_pixels=784, max_pixels=784 * 8)
    out = preprocess_video(rng.integers(0, 256, (3, 60, 90, 3), dtype=np.uint8), {"fps": 30.0}, settings)
    check_prepared(out, settings)
    with pytest.raises(ValueError, match="prepared with processor settings"):
        check_prepared(out, dataclasses.replace(settings, max_pixels=784 * 9))
    with pytest.raises(ValueError, match="does not match grid"):
        check_prepared(dataclasses.replace(out, pixel_values=out.pixel_values[1:]), settings)
