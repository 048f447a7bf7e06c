"""The CUDA kernels' logic on a CPU (Qwen3's q/k norm + rotary, the towers' rotary): their wrappers, their
start-up check and fallback, the layers' dispatch. The CUDA sources run only on the GPU machine
(`gpu_probe_ops.py --sections fused`, and the engine's own check at start); here independent NumPy statements of
what each source computes stand in for them.
"""

from __future__ import annotations

import dataclasses
import uuid

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import attention, cuda_fused
from batchjob.engine.cuda_fused import (FusedKernels, check_qk_norm_rope, check_vision_rope, portable_qk_norm_rope,
                                        portable_vision_rope, qk_norm_rope_suits, qk_norm_rope_with,
                                        select_fused_kernels, vision_rope_suits, vision_rope_with)


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def emulated_kernel(faults: tuple[str, ...] = ()):
    """`mx.fast.cuda_kernel`'s calling convention over NumPy: per head row, the RMSNorm rounded to the dtype, the
    weight product rounded, then `x * cos + rotate_half(x) * sin` with each product and the sum rounded (as the
    CUDA source does, warp lanes and shuffles aside). `faults` plants the mistakes the start-up check must catch."""

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        qkv, q_weight, k_weight, cos, sin, eps = inputs
        args = dict(template)
        hq, hk, d, dtype = args["HQ"], args["HK"], args["D"], args["T"]
        rows = hq + hk
        assert grid == (qkv.shape[0] * rows * 32, 1, 1) and threadgroup[0] % 32 == 0
        assert output_shapes == [(qkv.shape[0], rows, d)] and qkv.shape[2] == d
        rnd = lambda a: _f32(mx.array(a.astype(np.float32)).astype(dtype))  # noqa: E731
        x = _f32(qkv)[:, :rows]
        weights = np.concatenate([np.broadcast_to(_f32(q_weight), (hq, d)), np.broadcast_to(_f32(k_weight), (hk, d))])
        if "k_gets_q_weight" in faults:
            weights = np.broadcast_to(_f32(q_weight), (rows, d))
        inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + float(_f32(eps)[0]))
        normed = rnd(rnd(x * inv) * weights)
        half = d // 2
        rotated = np.concatenate([-normed[..., half:], normed[..., :half]], axis=-1)
        if "sign" in faults:
            rotated = -rotated
        c, s = _f32(cos)[:, None, :], _f32(sin)[:, None, :]
        a, b = normed * c, rotated * s
        if args["C"] == dtype:
            a, b = rnd(a), rnd(b)
        return [mx.array(a + b).astype(output_dtypes[0])]

    return kernel


def emulated_vision_kernel(faults: tuple[str, ...] = ()):
    """The towers' rotary kernel over NumPy: for q and k of each head, `(x1 c - x2 s, x2 c + x1 s)` in float32 with
    the tables' halves, rounded once to the dtype."""

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        qkv, cos_half, sin_half = inputs
        args = dict(template)
        heads, d = args["H"], args["D"]
        tokens = qkv.shape[0]
        assert grid == (tokens * heads * d // 4, 1, 1) and output_shapes == [(tokens, 2, heads, d)]
        assert cos_half.dtype == mx.float32 and cos_half.shape == (tokens, d // 2)
        x = _f32(qkv).reshape(tokens, 3, heads, d)[:, :2]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        c, s = _f32(cos_half)[:, None, None, :], _f32(sin_half)[:, None, None, :]
        if "halves_swapped" in faults:
            x1, x2 = x2, x1
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)
        if "q_for_k" in faults:
            out[:, 1] = out[:, 0]
        return [mx.array(out).astype(output_dtypes[0])]

    return kernel


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_vision_kernels_statement_matches_the_portable_form_and_planted_faults_do_not(dtype):
    assert check_vision_rope(vision_rope_with(emulated_vision_kernel()), dtype) is None
    for fault in ("halves_swapped", "q_for_k"):
        problem = check_vision_rope(vision_rope_with(emulated_vision_kernel((fault,))), dtype)
        assert problem is not None and "units in the last place" in problem, fault
    assert vision_rope_suits(mx.zeros((2, 3), dtype=dtype), 72) and not vision_rope_suits(mx.zeros((2, 3)), 80)
    assert not vision_rope_suits(mx.zeros((2, 3), dtype=dtype), 36)


def test_vision_rope_on_fresh_shapes(rng):
    heads, d, tokens = int(rng.integers(1, 5)), int(rng.choice([16, 72, 80, 128])), int(rng.integers(3, 50))
    qkv = mx.array(rng.normal(0, 2, (tokens, 3 * heads * d)).astype(np.float32)).astype(mx.bfloat16)
    freqs = rng.uniform(0, 30, (tokens, d // 2)).astype(np.float32)
    c, s = mx.array(np.cos(freqs)), mx.array(np.sin(freqs))
    got = vision_rope_with(emulated_vision_kernel())(qkv, heads, d, c, s)
    assert got.shape == (tokens, 2, heads, d)
    assert cuda_fused._ulps_apart(got, portable_vision_rope(qkv, heads, d, c, s), mx.bfloat16) <= cuda_fused.MAX_ULPS


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernels_statement_matches_the_portable_form_and_planted_faults_do_not(dtype):
    assert check_qk_norm_rope(qk_norm_rope_with(emulated_kernel()), dtype) is None
    for fault in ("sign", "k_gets_q_weight"):
        problem = check_qk_norm_rope(qk_norm_rope_with(emulated_kernel((fault,))), dtype)
        assert problem is not None and "units in the last place" in problem, fault


def test_fresh_random_inputs_agree_to_a_rounding_step(rng):
    """The kernel's statement against the portable form on shapes the check does not use (GQA 7:1, head 64)."""
    hq, hkv, d, tokens = 7, 1, 64, int(rng.integers(5, 40))
    qkv = mx.array(rng.normal(0, 3, (tokens, hq + 2 * hkv, d)).astype(np.float32)).astype(mx.bfloat16)
    angles = rng.uniform(0, 6.3, (tokens, d // 2))
    cos = mx.array(np.tile(np.cos(angles), 2).astype(np.float32)).astype(mx.bfloat16)
    sin = mx.array(np.tile(np.sin(angles), 2).astype(np.float32)).astype(mx.bfloat16)
    norms = [cuda_fused._Norm(mx.array(rng.normal(1, 0.3, d).astype(np.float32)).astype(mx.bfloat16), 1e-6)
             for _ in range(2)]
    got = qk_norm_rope_with(emulated_kernel())(qkv, hq, hkv, *norms, cos, sin)
    want = portable_qk_norm_rope(qkv, hq, hkv, *norms, cos, sin)
    assert got.shape == (tokens, hq + hkv, d)
    assert cuda_fused._ulps_apart(got, want, mx.bfloat16) <= cuda_fused.MAX_ULPS


def test_only_cuda_in_half_precision_builds_and_a_failing_build_falls_back():
    def never(*_):
        raise AssertionError("nothing may be built here")

    nothing = dict(build_qk_norm_rope=never, build_vision_rope=never)
    assert select_fused_kernels("cpu", mx.float32, **nothing) == FusedKernels(reason="portable forms on cpu")
    assert "metal" in select_fused_kernels("metal", mx.bfloat16, **nothing).reason
    assert "half precision" in select_fused_kernels("cuda", mx.float32, **nothing).reason
    tower_only = select_fused_kernels("cuda", mx.bfloat16, qk_norms=False, build_qk_norm_rope=never,
                                      build_vision_rope=emulated_vision_kernel)
    assert tower_only.qk_norm_rope is None and tower_only.vision_rope is not None
    assert tower_only.summary() == "vision_rope (CUDA kernels matched the portable forms at start)"

    def broken():
        raise RuntimeError("nvrtc: error: identifier 'x' is undefined")

    fallen = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=broken, build_vision_rope=broken)
    assert fallen.qk_norm_rope is None and fallen.vision_rope is None
    assert "nvrtc" in fallen.reason and fallen.summary().startswith("none (")
    wrong = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=lambda: emulated_kernel(("sign",)),
                                 build_vision_rope=emulated_vision_kernel)
    assert wrong.qk_norm_rope is None and wrong.vision_rope is not None and "units in the last place" in wrong.reason
    good = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=emulated_kernel,
                                build_vision_rope=emulated_vision_kernel)
    assert good.qk_norm_rope is not None and good.summary().startswith("qk_norm_rope, vision_rope (")


def _counting(kernel, calls: list):
    """`kernel`, noting the shape of each call's first input in `calls`."""

    def counted(qkv, *args):
        calls.append(qkv.shape)
        return kernel(qkv, *args)

    return counted


def test_suits_half_precision_and_heads_the_warp_splits():
    x = mx.zeros((3, 5, 128), dtype=mx.bfloat16)
    assert qk_norm_rope_suits(x, 128) and qk_norm_rope_suits(x.astype(mx.float16), 64)
    assert not qk_norm_rope_suits(x.astype(mx.float32), 128)
    assert not qk_norm_rope_suits(x, 96) and not qk_norm_rope_suits(x, 512)


def test_the_layer_sends_qwen3s_q_and_k_through_the_active_kernel(tiny_classifier, rng, make_clip, make_request,
                                                                  monkeypatch):
    """With a kernel active (its statement, counting calls), each Qwen3 layer calls it once per forward and the
    answers are the portable path's."""
    clf = tiny_classifier("qwen3_vl")
    assert clf.runtime.fused_kernels == "none (portable forms on cpu)"
    assert attention.has_qk_norms(clf.checkpoint.model.language_model)
    assert not attention.has_qk_norms(tiny_classifier().checkpoint.model.language_model)
    clip = make_clip(rng, f"fused-{uuid.uuid4().hex}")
    request = make_request(rng, "r", clip)
    want = clf.classify([request])[0]
    calls = []
    monkeypatch.setattr(cuda_fused, "_ACTIVE", FusedKernels(
        qk_norm_rope=_counting(qk_norm_rope_with(emulated_kernel()), calls), reason="test"))
    monkeypatch.setattr(attention, "qk_norm_rope_suits", lambda qkv, d: True)   # the tiny model's head is 32 wide
    again = dataclasses.replace(clip, media_id=f"again-{uuid.uuid4().hex}")   # not served from the feature cache
    got = clf.classify([dataclasses.replace(request, clip=again)])[0]
    layers = len(clf.checkpoint.model.language_model.model.layers)
    assert len(calls) == layers and want.error is None and got.error is None
    np.testing.assert_allclose(got.probs, want.probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_the_towers_send_q_and_k_through_the_active_kernel(name, tiny_classifier, rng, make_clip, monkeypatch):
    """With the towers' kernel active (its statement, counting calls), every vision block calls it once and the
    clip's features are the portable path's."""
    from batchjob.engine import vision_attention
    from batchjob.engine.preprocess import preprocess_video

    clf = tiny_classifier(name)
    clip = make_clip(rng, "tower")
    inputs = preprocess_video(clip.frames, clip.metadata, clf.checkpoint.vision)
    want = clf.checkpoint.encode_clip(inputs)
    calls = []
    monkeypatch.setattr(cuda_fused, "_ACTIVE", FusedKernels(
        vision_rope=_counting(vision_rope_with(emulated_vision_kernel()), calls), reason="test"))
    monkeypatch.setattr(vision_attention, "vision_rope_suits", lambda qkv, d: True)   # the tests run in float32
    got = clf.checkpoint.encode_clip(inputs)
    assert len(calls) == len(clf.checkpoint.model.vision_tower.blocks)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)
