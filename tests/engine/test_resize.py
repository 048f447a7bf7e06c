"""The frame resize against PyTorch's uint8 antialiased bicubic (what torchvision, and so transformers' video
processors and vLLM, run on uint8 frames): byte for byte, on random, adversarial and decoded frames."""

from __future__ import annotations

import numpy as np
import pytest

from batchjob.engine import resize
from batchjob.engine.aa_filter import aa_taps, fixed_point
from batchjob.engine.preprocess import clip_smart_resize, frame_smart_resize
from batchjob.engine.resize_gemm import axis_plan, gemm_resize

torch = pytest.importorskip("torch")


def torch_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference, called as torchvision calls it on a uint8 video (torchvision itself cannot be imported
    beside the CPU torch here): NCHW, bicubic, antialias, align_corners False."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    x = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return x.permute(0, 2, 3, 1).numpy()


def test_random_sizes_down_up_odd_and_one_axis(rng):
    """Random frames and sizes, odd ones included, down, up and one axis only: numpy (the default), the
    reference tap loop and the torch backend all give torch's bytes."""
    for trial in range(40):
        h, w = int(rng.integers(3, 260)), int(rng.integers(3, 260))
        height, width = int(rng.integers(2, 300)), int(rng.integers(2, 300))
        if trial % 4 == 1:
            height = h            # horizontal pass only
        elif trial % 4 == 2:
            width = w             # vertical pass only
        frames = rng.integers(0, 256, (int(rng.integers(1, 4)), h, w, 3), dtype=np.uint8)
        want = torch_resize(frames, height, width)
        for backend in resize.BACKENDS:
            got = resize.resize_frames(frames, height, width, backend=backend)
            np.testing.assert_array_equal(got, want, err_msg=f"{backend}: {h}x{w} -> {height}x{width}")


def _planned_axes(sources: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Every (input, output) axis pair Qwen2-VL's and Qwen3-VL's smart_resize plan for these frame sizes,
    over pixel budgets from a single window up to Qwen2.5-VL's default max_pixels, and min_pixels that force
    upscales."""
    pairs = set()
    budgets = np.unique(np.geomspace(4 * 28 * 28, 16384 * 28 * 28, 400).astype(int))
    for h, w in sources:
        for max_px in budgets:
            for min_px in (4 * 28 * 28, int(max_px)):
                planned = [frame_smart_resize(h, w, 28, min_px, int(max_px))]
                planned += [clip_smart_resize(16, h, w, 32, min_px * 16, int(max_px) * 16)]
                for ph, pw in planned:
                    pairs |= {(h, ph), (w, pw)}
    return {(i, o) for i, o in pairs if i != o}


def test_every_planned_size_of_common_videos(rng):
    """Each axis resize smart_resize can plan for common video sizes equals torch's, tested one axis at a time
    (the passes are separable; the composition is tested above and below)."""
    sources = [(1080, 1920), (720, 1280), (360, 640), (480, 854), (2160, 3840), (1920, 1080)]
    pairs = sorted(_planned_axes(sources))
    assert len(pairs) > 300
    kinds = set()
    for size_in, size_out in pairs:
        plan = axis_plan(size_in, size_out)
        kinds.add((plan.groups, plan.dtype.name))
        frames = rng.integers(0, 256, (1, 3, size_in, 3), dtype=np.uint8)    # width pass: 3 rows
        np.testing.assert_array_equal(gemm_resize(frames, 3, size_out), torch_resize(frames, 3, size_out),
                                      err_msg=f"width {size_in} -> {size_out}")
        frames = rng.integers(0, 256, (1, size_in, 2, 3), dtype=np.uint8)    # height pass: 2 columns
        np.testing.assert_array_equal(gemm_resize(frames, size_out, 2), torch_resize(frames, size_out, 2),
                                      err_msg=f"height {size_in} -> {size_out}")
    assert kinds >= {(1, "float32"), (2, "float32")}, kinds


def _extreme_rows(size_in: int, size_out: int) -> np.ndarray:
    """uint8 [2 * out, in]: for each output, a row that drives its sum to the top (255 under positive weights,
    0 under negative ones) and one that drives it to the bottom: the partial sums an exact float product must
    survive."""
    index, weight = aa_taps(size_in, size_out)
    coef, _ = fixed_point(weight)
    rows = np.full((2 * size_out, size_in), 128, np.uint8)
    for j in range(size_out):
        live = coef[j] != 0
        rows[2 * j, index[j, live]] = np.where(coef[j, live] > 0, 255, 0)
        rows[2 * j + 1, index[j, live]] = np.where(coef[j, live] > 0, 0, 255)
    return rows


@pytest.mark.parametrize("size_in,size_out", [(1920, 448), (1080, 252), (1280, 448), (3840, 448), (4000, 252),
                                              (640, 896), (101, 37)])
def test_worst_case_sums(size_in, size_out):
    """Frames built to push every output's sum to its extremes, through every kind of plan: one float32 sum,
    two float32 groups (precision 17), float64 (larger downscales)."""
    rows = _extreme_rows(size_in, size_out)
    plan = axis_plan(size_in, size_out)
    wide = np.stack([rows, rows[::-1], 255 - rows], axis=-1)[None]           # [1, 2*out, in, 3]
    np.testing.assert_array_equal(gemm_resize(wide, wide.shape[1], size_out), torch_resize(wide, wide.shape[1], size_out))
    tall = np.ascontiguousarray(wide.transpose(0, 2, 1, 3))                  # the same rows as columns
    np.testing.assert_array_equal(gemm_resize(tall, size_out, tall.shape[2]), torch_resize(tall, size_out, tall.shape[2]))
    expected = {(1920, 448): (2, "float32"), (4000, 252): (1, "float64"), (640, 896): (1, "float32")}
    if (size_in, size_out) in expected:
        assert (plan.groups, plan.dtype.name) == expected[(size_in, size_out)], "the case no longer covers its plan"


def test_decoded_frames_at_real_sizes(tmp_path):
    """Real decoded frames (H.264, 4:2:0, as the loaders return them) to the grids Qwen plans for them."""
    from batchjob.loaders import load_video
    from batchjob.synthetic.clips import make_clip

    for (w, h), sizes in [((1280, 720), [(252, 448), (308, 560), (728, 1288)]), ((640, 360), [(504, 896), (196, 336)])]:
        path = tmp_path / f"{w}x{h}.mp4"
        make_clip(path, width=w, height=h, seconds=1.0, pattern="motion", seed=3)
        frames, _ = load_video(str(path), backend="pyav_keyframes", num_frames=4)
        for height, width in sizes:
            np.testing.assert_array_equal(resize.resize_frames(frames, height, width), torch_resize(frames, height, width),
                                          err_msg=f"{w}x{h} -> {width}x{height}")


def test_backend_choice(rng, monkeypatch):
    frames = rng.integers(0, 256, (2, 30, 40, 3), dtype=np.uint8)
    assert resize.resize_frames(frames, 30, 40) is frames          # nothing to do
    monkeypatch.delenv(resize.ENV, raising=False)
    assert resize.resize_backend() == "numpy"                      # the default needs no torch
    monkeypatch.setenv(resize.ENV, "reference")
    assert resize.resize_backend() == "reference" and resize.resize_backend("torch") == "torch"
    monkeypatch.setenv(resize.ENV, "auto")
    with pytest.raises(ValueError, match="BATCHJOB_RESIZE='auto'.*numpy, torch, reference"):
        resize.resize_frames(frames, 14, 20)
    monkeypatch.setitem(__import__("sys").modules, "torch", None)   # torch not installed
    with pytest.raises(RuntimeError, match="BATCHJOB_RESIZE=torch needs PyTorch"):
        resize.resize_frames(frames, 14, 20, backend="torch")
