"""The CUDA q/k norm + rotary kernel's logic on a CPU: its wrapper, its start-up check and fallback, the layer's
dispatch. The kernel's CUDA source runs only on the GPU machine (`gpu_probe_ops.py --sections fused`, and the
engine's own check at start); here an independent NumPy statement of what the source computes stands in for it.
"""

from __future__ import annotations

import dataclasses
import uuid

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import attention, cuda_fused
from batchjob.engine.kernel_build import ulps_apart
from batchjob.engine.cuda_fused import (FusedKernels, check_qk_norm_rope, portable_qk_norm_rope, qk_norm_rope_suits,
                                        qk_norm_rope_with, select_fused_kernels)


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
        assert grid == (qkv.shape[0] * 32, 1, 1) and threadgroup[0] % 32 == 0   # a warp per token
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
    assert ulps_apart(got, want, mx.bfloat16) <= cuda_fused.MAX_ULPS


def test_only_cuda_in_half_precision_builds_and_a_failing_build_falls_back():
    def never(*_):
        raise AssertionError("nothing may be built here")

    assert select_fused_kernels("cpu", mx.float32, build_qk_norm_rope=never).qk_norm_rope is None
    assert "no q/k norms" in select_fused_kernels("cuda", mx.bfloat16, qk_heads=None,
                                                  build_qk_norm_rope=never).reason
    assert "head size 72" in select_fused_kernels("cuda", mx.bfloat16, qk_heads=(8, 2, 72),
                                                  build_qk_norm_rope=never).reason
    checked = []

    def at_model_heads():
        kernel = emulated_kernel()

        def noting(**call):
            checked.append(dict(call["template"]))
            return kernel(**call)

        return noting

    chosen = select_fused_kernels("cuda", mx.bfloat16, qk_heads=(6, 3, 64), build_qk_norm_rope=at_model_heads)
    assert chosen.qk_norm_rope is not None and [(c["HQ"], c["HK"], c["D"]) for c in checked] == [(6, 3, 64)]
    assert "metal" in select_fused_kernels("metal", mx.bfloat16, build_qk_norm_rope=never).reason
    assert "half precision" in select_fused_kernels("cuda", mx.float32, build_qk_norm_rope=never).reason

    def broken():
        raise RuntimeError("nvrtc: error: identifier 'x' is undefined")

    fallen = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=broken)
    assert fallen.qk_norm_rope is None and "nvrtc" in fallen.reason and fallen.summary().startswith("none (")
    wrong = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=lambda: emulated_kernel(("sign",)))
    assert wrong.qk_norm_rope is None and "units in the last place" in wrong.reason
    good = select_fused_kernels("cuda", mx.bfloat16, build_qk_norm_rope=emulated_kernel)
    assert good.qk_norm_rope is not None and good.summary().startswith("qk_norm_rope (")


def test_suits_half_precision_and_heads_the_warp_splits():
    assert qk_norm_rope_suits(mx.bfloat16, 128) and qk_norm_rope_suits(mx.float16, 64)
    assert not qk_norm_rope_suits(mx.float32, 128)
    assert not qk_norm_rope_suits(mx.bfloat16, 96) and not qk_norm_rope_suits(mx.bfloat16, 512)


def test_the_layer_sends_qwen3s_q_and_k_through_the_active_kernel(tiny_classifier, rng, make_clip, make_request,
                                                                  monkeypatch):
    """With a kernel active (its statement, counting calls), each Qwen3 layer calls it once per forward and the
    answers are the portable path's."""
    clf = tiny_classifier("qwen3_vl")
    assert clf.runtime.fused_kernels == "none (portable forms on cpu)"
    assert attention.qk_norm_heads(clf.checkpoint.model.language_model) == (4, 2, 32)
    assert attention.qk_norm_heads(tiny_classifier().checkpoint.model.language_model) is None
    clip = make_clip(rng, f"fused-{uuid.uuid4().hex}")
    request = make_request(rng, "r", clip)
    want = clf.classify([request])[0]
    calls = []
    wrapped = qk_norm_rope_with(emulated_kernel())

    def counting(qkv, *args):
        calls.append(qkv.shape)
        return wrapped(qkv, *args)

    monkeypatch.setattr(cuda_fused, "_ACTIVE", FusedKernels(qk_norm_rope=counting, reason="test"))
    monkeypatch.setattr(attention, "qk_norm_rope_suits", lambda dtype, d: True)   # the tiny model's head is 32 wide
    again = dataclasses.replace(clip, media_id=f"again-{uuid.uuid4().hex}")   # not served from the feature cache
    got = clf.classify([dataclasses.replace(request, clip=again)])[0]
    layers = len(clf.checkpoint.model.language_model.model.layers)
    assert len(calls) == layers and want.error is None and got.error is None
    np.testing.assert_allclose(got.probs, want.probs, rtol=0, atol=1e-5)
