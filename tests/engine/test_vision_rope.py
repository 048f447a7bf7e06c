"""The vision towers' CUDA rotary kernel's logic on a CPU (engine/vision_rope.py): its wrapper, its start-up check
and fallback beside the q/k kernel's, the towers' dispatch. The CUDA source runs only on the GPU machine
(`gpu_probe_ops.py --sections fused`, and the engine's own check at start; test_nvrtc.py compiles it here); an
independent NumPy statement of what the source computes stands in for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import cuda_fused, vision_attention, vision_rope
from batchjob.engine.cuda_fused import FusedKernels, select_fused_kernels
from batchjob.engine.kernel_build import ulps_apart
from batchjob.engine.vision_rope import (MAX_ULPS, check_vision_rope, portable_vision_rope, vision_rope_suits,
                                         vision_rope_with)


def _qk_statement():
    """The q/k kernel's NumPy statement (test_cuda_fused.py's `emulated_kernel`)."""
    spec = importlib.util.spec_from_file_location("_fused_statement", Path(__file__).with_name("test_cuda_fused.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.emulated_kernel


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def emulated_vision_kernel(faults: tuple[str, ...] = ()):
    """The kernel over NumPy: for q and k of each head, `(x1 c - x2 s, x2 c + x1 s)` in float32 with the tables'
    halves (each product and the sum rounded in float32), rounded once to the dtype. `faults` plants the mistakes
    the start-up check must catch."""

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        qkv, cos_half, sin_half = inputs
        args = dict(template)
        heads, d = args["H"], args["D"]
        tokens = qkv.shape[0]
        assert grid == (tokens * heads * d // 4, 1, 1) and output_shapes == [(tokens, 2, heads, d)]   # 4 pairs a thread
        assert cos_half.dtype == mx.float32 and cos_half.shape == (tokens, d // 2) and args["T"] == qkv.dtype
        x = _f32(qkv).reshape(tokens, 3, heads, d)[:, :2]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        c, s = _f32(cos_half)[:, None, None, :], _f32(sin_half)[:, None, None, :]
        if "halves_swapped" in faults:
            x1, x2 = x2, x1
        if "next_token_tables" in faults:
            c, s = np.roll(c, 1, axis=0), np.roll(s, 1, axis=0)
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)
        if "q_for_k" in faults:
            out[:, 1] = out[:, 0]
        return [mx.array(out).astype(output_dtypes[0])]

    return kernel


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_statement_matches_the_portable_form_and_planted_faults_do_not(dtype):
    assert check_vision_rope(vision_rope_with(emulated_vision_kernel()), dtype) is None
    for fault in ("halves_swapped", "q_for_k", "next_token_tables"):
        problem = check_vision_rope(vision_rope_with(emulated_vision_kernel((fault,))), dtype)
        assert problem is not None and "units in the last place" in problem, fault


def test_fresh_shapes_agree_with_both_portable_forms(rng):
    """The statement against the rotate-half form and against the block's own pair-swap form (no kernel active),
    on head sizes the check does not use."""
    heads, d, tokens = int(rng.integers(1, 5)), int(rng.choice([16, 72, 80, 128])), int(rng.integers(3, 50))
    qkv = mx.array(rng.normal(0, 2, (tokens, 3 * heads * d)).astype(np.float32)).astype(mx.bfloat16)
    freqs = mx.array(rng.uniform(0, 30, (tokens, d // 2)).astype(np.float32))
    tables = vision_attention.rope_tables(freqs)
    got = vision_rope_with(emulated_vision_kernel())(qkv, heads, d, *tables.halves)
    assert got.shape == (tokens, 2, heads, d)
    assert ulps_apart(got, portable_vision_rope(qkv, heads, d, *tables.halves), mx.bfloat16) <= MAX_ULPS
    q, k, v = vision_attention.rotated_qkv(qkv, heads, d, tables)
    assert ulps_apart(got, mx.stack([q, k], axis=1), mx.bfloat16) <= MAX_ULPS
    np.testing.assert_array_equal(_f32(v), _f32(qkv).reshape(tokens, 3, heads, d)[:, 2])


def test_suits_half_precision_and_halves_of_whole_quads():
    assert vision_rope_suits(mx.bfloat16, 72) and vision_rope_suits(mx.float16, 80)
    assert vision_rope_suits(mx.bfloat16, 128)
    assert not vision_rope_suits(mx.float32, 80) and not vision_rope_suits(mx.bfloat16, 36)


def test_the_towers_kernel_is_chosen_beside_the_qk_kernel_each_on_its_own():
    def never(*_):
        raise AssertionError("nothing may be built here")

    emulated_kernel = _qk_statement()

    assert select_fused_kernels("cpu", mx.bfloat16, vision_heads=(16, 80), build_qk_norm_rope=never,
                                build_vision_rope=never).summary() == "none (portable forms on cpu)"
    assert "half precision" in select_fused_kernels("cuda", mx.float32, vision_heads=(16, 80),
                                                    build_vision_rope=never).reason
    checked = []

    def at_tower_heads():
        kernel = emulated_vision_kernel()

        def noting(**call):
            checked.append(dict(call["template"]))
            return kernel(**call)

        return noting

    tower_only = select_fused_kernels("cuda", mx.bfloat16, qk_heads=None, vision_heads=(5, 72),
                                      build_qk_norm_rope=never, build_vision_rope=at_tower_heads)
    assert tower_only.qk_norm_rope is None and tower_only.vision_rope is not None
    assert [(c["H"], c["D"]) for c in checked] == [(5, 72)]   # the kernel compiled is the one the blocks use
    assert tower_only.summary() == ("vision_rope (q/k: no q/k norms in this model; towers' rotary: the CUDA kernel "
                                    "matched the portable form at start)")
    both = select_fused_kernels("cuda", mx.bfloat16, vision_heads=(16, 80), build_qk_norm_rope=emulated_kernel,
                                build_vision_rope=emulated_vision_kernel)
    assert both.summary().startswith("qk_norm_rope, vision_rope (")

    def broken():
        raise RuntimeError("nvrtc: error: identifier 'x' is undefined")

    wrong_tower = select_fused_kernels("cuda", mx.bfloat16, vision_heads=(16, 80), build_qk_norm_rope=emulated_kernel,
                                       build_vision_rope=lambda: emulated_vision_kernel(("q_for_k",)))
    assert wrong_tower.qk_norm_rope is not None and wrong_tower.vision_rope is None
    assert wrong_tower.reason.startswith("q/k: the CUDA kernel matched")
    assert "units in the last place" in wrong_tower.reason
    unbuilt_tower = select_fused_kernels("cuda", mx.float16, vision_heads=(16, 80), build_qk_norm_rope=emulated_kernel,
                                         build_vision_rope=broken)
    assert unbuilt_tower.qk_norm_rope is not None and unbuilt_tower.vision_rope is None
    assert "vision_rope failed to build or run: RuntimeError: nvrtc" in unbuilt_tower.reason
    unbuilt_qk = select_fused_kernels("cuda", mx.bfloat16, vision_heads=(16, 80), build_qk_norm_rope=broken,
                                      build_vision_rope=emulated_vision_kernel)
    assert unbuilt_qk.qk_norm_rope is None and unbuilt_qk.vision_rope is not None
    odd = select_fused_kernels("cuda", mx.bfloat16, qk_heads=None, vision_heads=(16, 36), build_vision_rope=never)
    assert odd.vision_rope is None and "head size 36" in odd.reason


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen2_vl-gqa", "qwen3_vl"])
def test_the_towers_send_q_and_k_through_the_active_kernel(name, tiny_classifier, rng, make_clip, monkeypatch):
    """With the kernel active (its statement, counting calls), every vision block calls it once at the tower's
    own heads, and the clip's features are the portable path's."""
    from batchjob.engine.preprocess import preprocess_video

    clf = tiny_classifier(name)
    tower = clf.checkpoint.model.vision_tower
    heads = vision_attention.rotary_heads(tower)
    assert heads == (tower.blocks[0].attn.num_heads, tower.blocks[0].attn.head_dim)
    clip = make_clip(rng, "tower")
    inputs = preprocess_video(clip.frames, clip.metadata, clf.checkpoint.vision)
    want = clf.checkpoint.encode_clip(inputs)
    calls = []
    wrapped = vision_rope_with(emulated_vision_kernel())

    def counting(qkv, h, d, *tables):
        calls.append((h, d))
        return wrapped(qkv, h, d, *tables)

    monkeypatch.setattr(cuda_fused, "_ACTIVE", FusedKernels(vision_rope=counting, reason="test"))
    monkeypatch.setattr(vision_attention, "vision_rope_suits", lambda dtype, d: True)   # the tests run in float32
    got = clf.checkpoint.encode_clip(inputs)
    assert calls == [heads] * len(tower.blocks)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)


def test_an_engine_on_cpu_builds_nothing(tiny_classifier):
    clf = tiny_classifier("qwen2_5_vl-gqa")
    assert clf.runtime.fused_kernels == "none (portable forms on cpu)" and clf.fused_kernels.vision_rope is None
    assert vision_rope.CHECK_HEADS[1] % 8 == 0
