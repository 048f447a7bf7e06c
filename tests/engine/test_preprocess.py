"""Video preprocessing against transformers' own image processor and an independent numpy patchify."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batchjob.engine import EngineError
from batchjob.engine.preprocess import VisionSettings, load_vision_settings, preprocess_video, sampling_fps


# The two families' processor settings: Qwen2-VL / Qwen2.5-VL (CLIP statistics, 14-pixel patches, a pixel budget
# per frame) and Qwen3-VL (0.5 / 0.5, 16-pixel patches, the budget over the whole clip).
FAMILIES = {
    "qwen2_5_vl": dict(),
    "qwen3_vl": dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), pixel_budget="clip"),
}


def _reference_video_patches(frames: np.ndarray, settings: VisionSettings) -> tuple[np.ndarray, tuple]:
    """Frames -> resized as the video processor resizes (PyTorch's kernel, see test_resize.py) to the size
    transformers' own smart_resize plans, normalised by transformers' PIL image processor (one image each,
    already at its size), then the video processor's documented layout: (t, h/m, w/m, m, m, C, temporal,
    patch, patch), written out directly."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_smart_resize

    from .test_resize import torch_resize

    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    if settings.pixel_budget == "clip":
        h, w = clip_smart_resize(max(len(frames), tp), frames.shape[1], frames.shape[2], factor=p * m,
                                 min_pixels=settings.min_pixels, max_pixels=settings.max_pixels)
    else:
        h, w = smart_resize(frames.shape[1], frames.shape[2], factor=p * m, min_pixels=settings.min_pixels,
                            max_pixels=settings.max_pixels)
    proc = Qwen2VLImageProcessorPil(min_pixels=h * w, max_pixels=h * w, patch_size=p, merge_size=m,
                                    temporal_patch_size=tp, image_mean=list(settings.image_mean),
                                    image_std=list(settings.image_std))
    if (h, w) != frames.shape[1:3]:
        frames = torch_resize(frames, h, w)
    # Undo the image processor's patchify on a single frame to recover the normalized image [C, H, W].
    images = []
    for frame in frames:
        out = proc(frame, return_tensors="np")
        assert tuple(out["image_grid_thw"][0]) == (1, h // p, w // p)   # the processor kept the size
        patches = np.asarray(out["pixel_values"]).reshape(h // p // m, w // p // m, m, m, 3, tp, p, p)[:, :, :, :, :, 0]
        images.append(patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h, w))
    video = np.stack(images)
    if len(video) % tp:
        video = np.concatenate([video, np.repeat(video[-1:], tp - len(video) % tp, axis=0)])
    gt, gh, gw = len(video) // tp, h // p, w // p
    x = video.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * tp * p * p), (gt, gh, gw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_frames", [1, 2, 3, 5])
def test_matches_the_processors(family, num_frames, rng):
    """Exactly transformers' output, for both families: the same float32 operations (rescale in float64 then
    float32, normalise in float32) on the same resized bytes, in the video processor's layout."""
    per_frame = int(rng.integers(28 * 28 * 4, 28 * 28 * 30))
    budget = per_frame * (num_frames if family == "qwen3_vl" else 1)
    settings = VisionSettings(min_pixels=28 * 28 * 2, max_pixels=budget, **FAMILIES[family])
    frames = rng.integers(0, 256, (num_frames, int(rng.integers(40, 200)), int(rng.integers(40, 200)), 3),
                          dtype=np.uint8)
    out = preprocess_video(frames, {"fps": 30.0, "frames_indices": list(range(num_frames))}, settings)
    expected, grid = _reference_video_patches(frames, settings)
    assert out.grid_thw == grid
    assert out.num_tokens == grid[0] * grid[1] * grid[2] // 4
    assert out.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(out.pixel_values, expected)


@pytest.mark.parametrize("source", [(720, 1280), (1080, 1920), (480, 640), (1280, 720)])
def test_matches_the_processors_at_the_shipped_size(source, rng):
    """Real frame sizes at configs/nextqa.yaml's max_pixels (200704, the processor's default min_pixels):
    landscape and portrait, with a random min_pixels that sometimes forces an upscale."""
    min_pixels = int(rng.choice([3136, 28 * 28 * int(rng.integers(300, 500))]))
    settings = VisionSettings(min_pixels=min_pixels, max_pixels=max(200704, min_pixels))
    frames = rng.integers(0, 256, (3, *source, 3), dtype=np.uint8)
    out = preprocess_video(frames, {"fps": 30.0, "frames_indices": [0, 40, 80]}, settings)
    expected, grid = _reference_video_patches(frames, settings)
    assert out.grid_thw == grid
    np.testing.assert_array_equal(out.pixel_values, expected)


def test_smart_resize_is_transformers(rng):
    """The per-frame plan is transformers' Qwen2-VL smart_resize (ours runs without importing transformers)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from batchjob.engine.preprocess import frame_smart_resize

    for _ in range(3000):
        h, w = (int(v) for v in rng.integers(10, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        factor = int(rng.choice([28, 32]))
        lo = int(rng.integers(1, 64)) * factor * factor
        hi = lo + int(rng.integers(0, 20000)) * factor
        assert frame_smart_resize(h, w, factor, lo, hi) == smart_resize(h, w, factor=factor, min_pixels=lo,
                                                                         max_pixels=hi), (h, w, factor, lo, hi)
    with pytest.raises(ValueError, match="aspect ratio"):
        frame_smart_resize(10, 2500, 28, 784, 784 * 100)


def test_video_processors_fused_normalisation_is_within_float32_rounding():
    """transformers' torchvision-based *video* processors fold the rescale into mean and std ((x - 255 mean) /
    (255 std), float32); the PIL image processor, which batchjob matches exactly, rescales first. The two
    differ by float32 rounding only (a few units in the last place)."""
    import torch

    from batchjob.engine.patchify import normalize_table

    for mean, std in [VisionSettings.image_mean, VisionSettings.image_std], [(0.5,) * 3, (0.5,) * 3]:
        ours = normalize_table(tuple(mean), tuple(std))
        x = torch.arange(256, dtype=torch.float32)[None, :]
        fused = ((x - torch.tensor(mean)[:, None] * 255.0) / (torch.tensor(std)[:, None] * 255.0)).numpy()
        np.testing.assert_allclose(ours, fused, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(fused).max())


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
    check_prepared(preprocess_video(rng.integers(0, 256, (3, 60, 90, 3), dtype=np.uint8), {}, settings,
                                    normalise=False), settings)
    with pytest.raises(ValueError, match="float32 values or uint8 patch bytes, not float64"):
        check_prepared(dataclasses.replace(out, pixel_values=out.pixel_values.astype(np.float64)), settings)


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_bytes_normalise_to_the_same_values(family, rng):
    """What decoders send (normalise=False): uint8 patch bytes, a quarter of the size, that the engine's lookup
    (on the host, and on MLX's device as the classifier does it) turns into exactly the float32 values."""
    import mlx.core as mx

    from batchjob.engine.patchify import normalize_bytes, normalize_on_device, normalize_table

    n = int(rng.integers(1, 6))
    settings = VisionSettings(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * int(rng.integers(4, 30)) * n,
                              **FAMILIES[family])
    frames = rng.integers(0, 256, (n, int(rng.integers(30, 150)), int(rng.integers(30, 150)), 3), dtype=np.uint8)
    meta = {"fps": 30.0, "frames_indices": list(range(n))}
    values = preprocess_video(frames, meta, settings)
    packed = preprocess_video(frames, meta, settings, normalise=False)
    assert packed.pixel_values.dtype == np.uint8 and packed.pixel_values.shape == values.pixel_values.shape
    assert (packed.grid_thw, packed.num_tokens, packed.settings) == (values.grid_thw, values.num_tokens, settings)
    table = normalize_table(settings.image_mean, settings.image_std)
    np.testing.assert_array_equal(normalize_bytes(packed.pixel_values, table), values.pixel_values)
    on_device = normalize_on_device(packed.pixel_values, table)
    assert on_device.dtype == mx.float32
    np.testing.assert_array_equal(np.array(on_device), values.pixel_values)
