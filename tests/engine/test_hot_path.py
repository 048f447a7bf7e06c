"""The hot path's shape on the CPU: attention plan built once per forward, vision plan once per clip shape,
KV written in place, the LM head only at finishing sequences' last positions, only option logits to the host.

Each test spies on the real engine during a real `classify` and checks the property itself (call counts,
shapes, memory); answers are checked against the unchanged reference paths elsewhere (test_parity,
test_qwen25_vision).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchjob.engine import runner
from batchjob.engine import qwen25_vision
from batchjob.engine.runner import option_columns


def test_option_columns_pad_short_rows_with_their_own_first_id():
    assert option_columns([[5, 6], [7, 8, 9]]).tolist() == [[5, 6, 5], [7, 8, 9]]


def test_plans_are_built_once(tiny_classifier, rng, make_clip, make_request, monkeypatch):
    clf = tiny_classifier("qwen2_5_vl-mha")  # 3 decoder layers, 3 vision blocks
    counts = {"meta": 0, "segments": 0, "forward": 0}
    build, plan, forward = runner.build_attention_metadata, qwen25_vision.segment_plan, runner.forward

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(runner, "build_attention_metadata", counting("meta", build))
    monkeypatch.setattr(qwen25_vision, "segment_plan", counting("segments", plan))
    monkeypatch.setattr("batchjob.engine.classifier.forward", counting("forward", forward))

    def no_split(*args, **kwargs):  # mlx-vlm's vision attention splits on cu_seqlens.tolist() in every layer
        raise AssertionError("the vision tower split q/k/v per layer (host sync)")

    monkeypatch.setattr(mx, "split", no_split)
    clips = [make_clip(rng, f"plan-{i}", num_frames=4, size=(224, 224)) for i in range(2)]
    results = clf.classify([make_request(rng, f"r{i}", clips[i % 2]) for i in range(4)])
    assert all(r.error is None for r in results)
    assert counts["meta"] == counts["forward"] >= 1  # one attention plan per forward, whatever the depth
    # windows + frames, once per clip shape for the engine's life: both clips share one grid
    assert clf.vision_calls >= 2 and counts["segments"] in (0, 2)   # 0: an earlier test planned this grid
    before = counts["segments"]
    other = make_clip(rng, "plan-other", num_frames=4, size=(168, 280))   # a grid no other test uses
    assert clf.classify([make_request(rng, "r-other", other)])[0].error is None
    assert counts["segments"] == before + 2


def test_lm_head_sees_only_last_positions_and_only_option_logits_leave(tiny_classifier, rng, make_clip,
                                                                       make_request, monkeypatch):
    clf = tiny_classifier()
    lm = clf.checkpoint.model.language_model
    head_rows, host_shapes = [], []
    original_head = type(lm.lm_head).__call__

    class SpyHead(type(lm.lm_head)):
        def __call__(self, x):
            head_rows.append(x.shape)
            return original_head(self, x)

    forward = runner.forward

    def spy_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        host_shapes.append(out.logits.shape)
        return out

    monkeypatch.setattr(lm.lm_head, "__class__", SpyHead)
    monkeypatch.setattr("batchjob.engine.classifier.forward", spy_forward)
    clip = make_clip(rng, "head")
    requests = [make_request(rng, f"h{i}", clip, num_options=n) for i, n in enumerate([2, 5, 3])]
    results = clf.classify(requests)
    assert all(r.error is None for r in results)
    assert sum(shape[0] for shape in head_rows) == len(requests)  # one row per request, never per token
    vocab = clf.checkpoint.hf_config["vocab_size"]
    assert all(shape[1] <= 5 < vocab for shape in host_shapes if shape[0])
    assert [len(r.probs) for r in results] == [2, 5, 3]


def test_kv_cache_is_written_in_place(tiny_classifier, rng, make_clip, make_request, monkeypatch):
    """A forward pass must not copy a layer's cache: peak memory during classify stays below one layer's K.
    The same measurement with the old cache arrays kept alive (which forces MLX to copy) must see the copies."""
    import batchjob.engine.attention as attention

    clf = tiny_classifier("qwen2_5_vl-gqa", max_model_len=32768)  # a pool of 131,072 token slots
    layer_bytes = clf.kv_cache.k[0].nbytes

    def extra_peak(tag):
        mx.eval(clf.kv_cache.k, clf.kv_cache.v)
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        clf.classify([make_request(rng, tag, make_clip(rng, tag, num_frames=2, size=(112, 112)))])
        return mx.get_peak_memory() - before

    extra_peak("warm")
    assert extra_peak("in-place") < layer_bytes // 2
    held, call = [], attention.PagedAttention.__call__

    def holding(self, *args, **kwargs):
        if attention._CONTEXT is not None:
            held.append(attention._CONTEXT.kv_cache.k[self.layer_index])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(attention.PagedAttention, "__call__", holding)
    assert extra_peak("copied") >= layer_bytes


def test_gather_indices_are_planned_once_per_forward(rng, monkeypatch):
    """Scattered blocks (a follower reading a shared prefix): the gather rows are built by the first call and
    reused by K, V and every later layer; the answer equals a fresh (unplanned) computation."""
    from batchjob.metal_backend import attention, paged_attention
    from batchjob.metal_backend.probe import make_ragged_batch

    batch = make_ragged_batch(rng, [5, 1, 1, 9], [40, 17, 33, 0], num_q_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=16)
    calls = []
    real = attention.gather_rows
    monkeypatch.setattr(attention, "gather_rows", lambda *a: calls.append(a) or real(*a))
    first = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    planned = len(calls)
    for _ in range(3):  # three more "layers" over the same metadata
        again = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    assert planned >= 1 and len(calls) == planned
    assert mx.array_equal(first, again).item()
    batch.meta.plan_cache.clear()
    assert mx.array_equal(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2), first).item()


def test_equal_length_prefill_is_one_sdpa_call_per_layer(tiny_classifier, rng, make_clip, monkeypatch):
    """Distinct clips of one size with the same question: equal prompts over no video prefix. The language
    model's attention must cost one SDPA call per layer per forward pass, not one per sequence."""
    import batchjob.engine.attention as attention
    from batchjob.engine import ClassifyRequest

    clf = tiny_classifier("qwen2_5_vl-mha")  # 3 decoder layers
    num_layers = len(clf.checkpoint.model.language_model.model.layers)
    real_sdpa, forward = mx.fast.scaled_dot_product_attention, runner.forward
    lm_calls, forwards = [], []

    def spy_sdpa(q, k, v, **kwargs):
        if attention._CONTEXT is not None:  # inside the packed LM forward (the vision tower runs outside it)
            lm_calls.append(q.shape)
        return real_sdpa(q, k, v, **kwargs)

    def spy_forward(*args, **kwargs):
        forwards.append(len(args[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr("batchjob.engine.classifier.forward", spy_forward)
    n = 3
    requests = [ClassifyRequest(request_id=f"eq{i}", clip=make_clip(rng, f"eq-{i}", num_frames=2, size=(56, 56)),
                                question="What happens first?", options=("a cat", "a dog")) for i in range(n)]
    results = clf.classify(requests)
    assert all(r.error is None for r in results)
    # Equal prompts; the system text before the video may be cached by earlier tests on this shared engine,
    # but then for all three alike (one prefix length, so still one group).
    assert len({r.prompt_tokens for r in results}) == 1 and len({r.cached_tokens for r in results}) == 1
    assert forwards == [n]  # the three prompts were packed into one forward pass
    assert len(lm_calls) == num_layers
    assert all(shape[0] == n for shape in lm_calls)


def test_grouped_attention_answers_like_per_sequence_attention(checkpoint_dir, rng, make_clip, make_request,
                                                                check_choice):
    """The engine with grouped SDPA calls (and fresh K/V read directly) against the same engine running one
    SDPA per sequence from the cache (the path before grouping), on a ragged workload: several clips, several
    questions of random length each (followers over a cached video prefix), clips of different sizes."""
    from batchjob.engine import Classifier, EngineConfig
    from batchjob.metal_backend import paged_attention

    def per_sequence(q, k_cache, v_cache, meta, scale, new_kv=None):
        return paged_attention(q, k_cache, v_cache, meta, scale, group_rows=1)

    config = EngineConfig(max_model_len=2048, memory_budget_gb=1.0)
    grouped = Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), config)
    reference = Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), config)
    reference._attention = per_sequence
    clips = [make_clip(rng, f"rag-{i}", num_frames=int(rng.integers(2, 5)),
                       size=(int(rng.choice([56, 84])), int(rng.choice([56, 112])))) for i in range(4)]
    requests = [make_request(rng, f"rag{i}-{j}", clip) for i, clip in enumerate(clips)
                for j in range(int(rng.integers(1, 5)) if i else 3)]  # the first clip surely has followers
    got, want = grouped.classify(requests), reference.classify(requests)
    assert all(r.error is None for r in got + want)
    assert any(r.cached_tokens > 0 for r in got)  # followers did read a cached prefix
    for g, w in zip(got, want):
        assert (g.prompt_tokens, g.cached_tokens) == (w.prompt_tokens, w.cached_tokens)
        check_choice(g, w.logprobs, g.request_id)
        assert np.abs(np.array(g.logprobs) - np.array(w.logprobs)).max() < 1e-5, g.request_id
