"""The forward pass handed to MLX layer by layer (runner.LAYER_LAG): same answers and KV as the whole pass built
first, and the host never more than `lag` layers ahead of the one it last waited for.

Pacing only changes where MLX's evaluation is cut, never the ops: answers must match the unpaced pass (the same
choices and token counts; logprobs to fp32 rounding, as the CPU's multi-threaded BLAS gives them), including
followers that read a prefix the paced pass wrote into the cache, and DeepStack's additions (Qwen3-VL)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchjob.engine import runner


def _workload(rng, make_clip, make_request, tag):
    clips = [make_clip(rng, f"{tag}-{i}", num_frames=int(rng.integers(2, 5)),
                       size=(int(rng.choice([56, 84])), int(rng.choice([56, 112])))) for i in range(3)]
    return [make_request(rng, f"{tag}{i}-{j}", clip) for i, clip in enumerate(clips)
            for j in range(int(rng.integers(1, 4)) if i else 3)]   # the first clip surely has followers


@pytest.mark.parametrize("name", ["qwen2_5_vl-mha", "qwen3_vl_moe", "qwen3_vl"])
def test_paced_forward_answers_exactly_as_the_whole_pass(checkpoint_dir, rng, make_clip, make_request, name,
                                                          monkeypatch):
    from batchjob.engine import Classifier, EngineConfig

    config = EngineConfig(max_model_len=2048, memory_budget_gb=1.0)
    requests = _workload(rng, make_clip, make_request, "pace")
    answers = {}
    for lag in (0, 1, 2, 5):   # 5: more than the model's layers (nothing is ever waited for)
        monkeypatch.setattr(runner, "LAYER_LAG", lag)
        clf = Classifier.from_pretrained(checkpoint_dir(name), config)
        answers[lag] = clf.classify(requests)
        assert all(r.error is None for r in answers[lag]), [r.error for r in answers[lag]]
        assert any(r.cached_tokens > 0 for r in answers[lag])   # followers read what a paced pass wrote
    for lag in (1, 2, 5):
        for got, want in zip(answers[lag], answers[0]):
            assert (got.choice, got.prompt_tokens, got.cached_tokens) == (want.choice, want.prompt_tokens,
                                                                          want.cached_tokens)
            # to fp32 rounding: the same graph, but the CPU's multi-threaded BLAS sums in a different order from run
            # to run (bit for bit with OPENBLAS_NUM_THREADS=1); a layer run twice or skipped is far off
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5,
                                       err_msg=f"{lag} {got.request_id}")


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_host_stays_within_lag_layers(tiny_classifier, rng, make_clip, make_request, monkeypatch, lag):
    """Every layer's output is queued (with its K/V writes) as soon as it is built; before queueing layer i + 1
    the host has waited for layer i - lag. Unpaced (0), nothing is queued before the pass is handed over whole, once
    (for the engine's `on_queued` look-ahead), ahead of its closing eval."""
    from batchjob.engine import classifier as classifier_module

    clf = tiny_classifier("qwen2_5_vl-mha")
    num_layers = len(clf.checkpoint.model.language_model.model.layers)
    queued, waited, events, inside, closing = [], [], [], [], []
    real_async, real_eval, real_forward = mx.async_eval, mx.eval, classifier_module.forward

    def spy_forward(*args, **kwargs):   # only the forward pass's own calls count (not the vision features')
        inside.append(True)
        try:
            return real_forward(*args, **kwargs)
        finally:
            inside.pop()

    def spy_async(*arrays):
        if not inside:
            return real_async(*arrays)
        if arrays[-1] is clf.kv_cache.v:   # the whole pass handed over before `on_queued` (runner._queued)
            closing.append(len(queued))
            return real_async(*arrays)
        layer = len(queued)
        # the layer's K/V writes go with it: not left for the pass's closing eval, holding its new K/V till then
        assert len(arrays) == 3 and arrays[1] is clf.kv_cache.k[layer] and arrays[2] is clf.kv_cache.v[layer]
        queued.append(arrays[0])
        events.append(("queue", len(queued) - len(waited)))
        return real_async(*arrays)

    def spy_eval(*arrays):
        for a in arrays:
            if any(a is q for q in queued):
                waited.append(a)
        return real_eval(*arrays)

    monkeypatch.setattr(runner, "LAYER_LAG", lag)
    monkeypatch.setattr(mx, "async_eval", spy_async)
    monkeypatch.setattr(mx, "eval", spy_eval)
    monkeypatch.setattr(classifier_module, "forward", spy_forward)
    results = clf.classify([make_request(rng, f"lag{lag}", make_clip(rng, f"lag{lag}", num_frames=2, size=(56, 56)))])
    monkeypatch.undo()
    assert results[0].error is None
    assert closing == [len(queued)]   # once, after every layer
    if lag == 0:
        assert not queued
        return
    assert len(queued) == num_layers
    assert max(depth for _, depth in events) == min(lag + 1, num_layers)
    assert len(waited) == max(0, num_layers - lag)
    assert [id(a) for a in waited] == [id(a) for a in queued[:len(waited)]]   # oldest first


@pytest.mark.parametrize("lag", [1, 2])
def test_overlapped_passes_stay_within_lag_layers(tiny_classifier, rng, make_clip, make_request, monkeypatch, lag):
    """Across a step's end too: a pass queued behind the one before (the engine's overlapped passes) counts that
    pass's layers still in flight, so the host is never more than `lag` layers ahead of the one it last waited for
    (the activations the memory plan holds), and each pass after the first starts with the last layers of the pass
    before still queued (the device is not left idle while the host reads, books and schedules)."""
    from batchjob.engine import classifier as classifier_module

    clf = tiny_classifier("qwen2_5_vl-mha")
    num_layers = len(clf.checkpoint.model.language_model.model.layers)
    pushed, waited, first_depths, inside = [], [], [], []
    real_async, real_eval, real_forward = mx.async_eval, mx.eval, classifier_module.forward

    def spy_forward(*args, **kwargs):
        inside.append(len(pushed))   # where this pass's layers start
        try:
            return real_forward(*args, **kwargs)
        finally:
            inside.pop()

    def spy_async(*arrays):
        if inside and len(arrays) == 3 and any(arrays[1] is k for k in clf.kv_cache.k):   # a layer handed over
            pushed.append(arrays[0])
            depth = len(pushed) - len(waited)
            assert depth <= lag + 1
            if len(pushed) - 1 == inside[-1]:
                first_depths.append(depth)
        return real_async(*arrays)

    def spy_eval(*arrays):
        waited.extend(a for a in arrays if any(a is p for p in pushed))
        return real_eval(*arrays)

    clips = [make_clip(rng, f"overlap{lag}-{i}", num_frames=2, size=(56, 56)) for i in range(4)]
    requests = [make_request(rng, f"overlap{lag}-{i}-{j}", clip) for i, clip in enumerate(clips) for j in range(2)]
    prompt = clf._prepare(0, requests[0], -1).num_tokens
    monkeypatch.setattr(clf.config, "max_num_batched_tokens", (prompt + 15) // 16 * 16)
    monkeypatch.setattr(runner, "LAYER_LAG", lag)
    monkeypatch.setattr(classifier_module, "OVERLAP_PASSES", True)
    monkeypatch.setattr(mx, "async_eval", spy_async)
    monkeypatch.setattr(mx, "eval", spy_eval)
    monkeypatch.setattr(classifier_module, "forward", spy_forward)
    results = clf.classify(requests)
    monkeypatch.undo()
    assert all(r.error is None for r in results)
    assert len(first_depths) >= 3 and len(pushed) == num_layers * len(first_depths)
    assert first_depths == [1] + [min(lag, num_layers) + 1] * (len(first_depths) - 1)
    assert [id(a) for a in waited] == [id(a) for a in pushed[:len(waited)]]   # oldest first, across passes
