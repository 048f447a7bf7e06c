"""The decoder layer as the engine runs it (residual adds in the GEMMs' epilogues) against mlx-vlm's own layer,
and `linear_plus` against the separate add, with the cases it must leave alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchjob.engine import fused_ops
from batchjob.engine.attention import AttentionContext, PagedAttention, attention_context
from batchjob.engine.decoder_layer import run_layer
from batchjob.engine.fused_ops import folds_residual, linear_plus
from batchjob.engine.vision_mlp import FusedGatedMLP
from batchjob.metal_backend import SeqSlice, build_attention_metadata


def _counting_addmm(monkeypatch) -> list:
    calls, real = [], mx.addmm

    def addmm(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(mx, "addmm", addmm)
    return calls


def test_linear_plus_adds_the_residual_in_the_gemm(rng, monkeypatch):
    calls = _counting_addmm(monkeypatch)
    t, k, n = int(rng.integers(1, 50)), int(rng.integers(1, 70)), int(rng.integers(1, 70))
    linear = nn.Linear(k, n, bias=False)
    linear.weight = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    x = mx.array(rng.standard_normal((1, t, k)).astype(np.float32))
    residual = mx.array(rng.standard_normal((1, t, n)).astype(np.float32))
    got = linear_plus(linear, x, residual)
    assert calls == [(t, n)] and got.shape == (1, t, n)
    want = np.array(residual, np.float64) + np.array(x, np.float64) @ np.array(linear.weight, np.float64).T
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert linear_plus(linear, x, None).shape == (1, t, n) and len(calls) == 1   # no residual: the plain GEMM


def test_in_half_precision_the_sum_is_rounded_once(rng):
    """bf16: the epilogue's sum is the exact sum of the fp32 product and the residual, rounded once, so it is
    within half a unit in the last place of the truth (the separate add rounds the product first)."""
    t, k, n = 33, 64, 48
    linear = nn.Linear(k, n, bias=False)
    linear.weight = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((1, t, k)).astype(np.float32)).astype(mx.bfloat16)
    residual = mx.array(rng.standard_normal((1, t, n)).astype(np.float32) * 8).astype(mx.bfloat16)
    got = np.array(linear_plus(linear, x, residual).astype(mx.float32), np.float64)
    xs, ws, rs = (np.array(a.astype(mx.float32), np.float64) for a in (x, linear.weight, residual))
    truth = rs + xs @ ws.T
    spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(truth), 1e-30))) - 7)
    # The fp32 accumulation's own error (the standard bound, (k + 1) units of fp32 over the absolute terms) can
    # carry a sum that cancels to near zero across a bf16 rounding point; half a bf16 unit is the rest.
    accumulation = (k + 1) * 2.0 ** -24 * (np.abs(xs) @ np.abs(ws).T + np.abs(rs))
    assert (np.abs(got - truth) <= 0.5 * spacing + accumulation).all()


@pytest.mark.parametrize("case", ["bias", "quantized", "switched_off"])
def test_what_it_leaves_to_a_separate_add(case, rng, monkeypatch):
    calls = _counting_addmm(monkeypatch)
    linear = nn.Linear(64, 32, bias=case == "bias")
    if case == "quantized":
        linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=8)
    if case == "switched_off":
        monkeypatch.setattr(fused_ops, "RESIDUAL_IN_GEMM", False)
    x = mx.array(rng.standard_normal((1, 7, 64)).astype(np.float32))
    residual = mx.array(rng.standard_normal((1, 7, 32)).astype(np.float32))
    before = len(calls)   # a biased nn.Linear runs addmm with its bias itself
    want = residual + linear(x)
    own = len(calls) - before
    assert not folds_residual(linear)
    got = linear_plus(linear, x, residual)
    assert len(calls) - before == 2 * own   # only the projection's own call, no residual epilogue
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("name", ["qwen2_vl-gqa", "qwen2_5_vl-mha", "qwen3_vl", "qwen3_vl_moe"])
def test_run_layer_equals_mlx_vlms_layer(name, checkpoint_dir, rng, monkeypatch):
    """Each layer of each family inside a paged forward's context, on random hidden states and positions: the
    engine's layer (residuals added in the GEMMs where they can be) gives mlx-vlm's layer's output (the same
    wrapped attention, its own adds) to fp32 rounding. The output projection and a dense MLP's down projection
    take their residuals; the MoE block's add stays a pass of its own. A classifier of its own: the layers write
    KV blocks the pool has not handed out, which a shared classifier's cached prefixes may hold."""
    from batchjob.engine import Classifier, EngineConfig

    clf = Classifier.from_pretrained(checkpoint_dir(name), EngineConfig(max_model_len=2048, memory_budget_gb=1.0))
    layers = clf.checkpoint.model.language_model.model.layers
    assert all(isinstance(layer.self_attn, PagedAttention) for layer in layers)
    calls = _counting_addmm(monkeypatch)
    for layer in layers:
        t = int(rng.integers(2, 40))
        hidden = layer.input_layernorm.weight.shape[0]
        meta = build_attention_metadata([SeqSlice(list(range(-(-t // clf.kv_cache.block_size))), 0, t)],
                                        clf.kv_cache.block_size)
        x = mx.array(rng.standard_normal((1, t, hidden)).astype(np.float32))
        positions = mx.array(np.tile(np.arange(t), (3, 1))[:, None, :] + rng.integers(0, 5, (3, 1, 1)))
        pe = layer.self_attn.rotary_emb(x, positions)
        with attention_context(AttentionContext(meta, clf.kv_cache, clf._attention)):
            want = np.array(layer(x, None, None, None, pe))
            del calls[:]
            got = np.array(run_layer(layer, x, pe))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        dense = isinstance(layer.mlp, FusedGatedMLP)
        assert calls.count((t, hidden)) == (2 if dense else 1), (name, calls)
