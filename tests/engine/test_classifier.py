"""Classifier behaviour: batch invariance, per-clip sharing, per-request errors, load-time errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid

import numpy as np
import pytest

from batchjob.engine import ClassifyRequest, Classifier, Clip, EngineConfig, EngineError
from batchjob.engine.mrope import placeholder_runs


def _fresh(clip: Clip) -> Clip:
    """The same frames under a new media id: no prefix of it is cached anywhere yet."""
    return dataclasses.replace(clip, media_id=f"{clip.media_id}-{uuid.uuid4().hex[:8]}")


def _with_clip(request: ClassifyRequest, clip: Clip) -> ClassifyRequest:
    return dataclasses.replace(request, clip=clip)


def test_batch_invariance(tiny_classifier, rng, make_clip, make_request, check_choice):
    clf = tiny_classifier("qwen2_5_vl-gqa")
    clip = make_clip(rng, "inv")
    request = make_request(rng, "target", _fresh(clip))
    ids = clf.prompts.token_ids(request.question, request.options, 1)
    video_start = placeholder_runs(ids, clf.checkpoint.video_token_id)[0][0]
    alone = clf.classify([request])[0]
    # Only the clip-independent system prompt before the video can be a hit for a new clip.
    assert alone.cached_tokens <= video_start and alone.error is None

    others = [make_request(rng, f"o{i}", make_clip(rng, f"other-{uuid.uuid4().hex}")) for i in range(4)]
    packed = clf.classify(others[:2] + [_with_clip(request, _fresh(clip))] + others[2:])[2]
    assert packed.cached_tokens <= video_start

    budget = clf.config.max_num_batched_tokens
    chunk = int(rng.integers(5, 40))
    clf.config.max_num_batched_tokens = chunk  # forces several chunks per prompt
    try:
        chunked = clf.classify([_with_clip(request, _fresh(clip)), others[0]])[0]
    finally:
        clf.config.max_num_batched_tokens = budget
    assert chunked.prompt_tokens > 2 * chunk and chunked.cached_tokens <= video_start  # at least three chunks

    hit = clf.classify([request])[0]  # same media id as `alone`: its prefix blocks are cached
    assert hit.cached_tokens > video_start + 1
    for other in (packed, chunked, hit):
        np.testing.assert_allclose(other.probs, alone.probs, rtol=0, atol=1e-5)
        check_choice(other, alone.logprobs)
        assert other.prompt_tokens == alone.prompt_tokens


def test_vision_runs_once_per_clip_and_prefix_is_shared(tiny_classifier, rng, make_clip, make_request):
    clf = tiny_classifier("qwen2_5_vl-gqa")
    clip = make_clip(rng, f"share-{uuid.uuid4().hex}", num_frames=6, size=(112, 168))  # 72 video tokens
    requests = [make_request(rng, f"q{i}", clip) for i in range(4)]
    before = clf.vision_calls
    results = clf.classify(requests)
    assert clf.vision_calls - before == 1
    num_video = results[0].prompt_tokens - len(clf.prompts.token_ids(requests[0].question, requests[0].options, 0))
    prompts = [clf.prompts.token_ids(r.question, r.options, num_video) for r in requests]
    video_start, video_end = placeholder_runs(prompts[0], clf.checkpoint.video_token_id)[0]
    block = clf.config.block_size
    assert results[0].cached_tokens <= video_start
    for ids, r in zip(prompts[1:], results[1:]):  # every full block of the common prefix is reused
        common = next((i for i, (a, b) in enumerate(zip(ids, prompts[0])) if a != b), min(len(ids), len(prompts[0])))
        assert common >= video_end
        assert r.cached_tokens == min(common, len(ids) - 1) // block * block
        assert r.cached_tokens >= video_end // block * block > video_start

    # Later calls about the same clip (one question at a time) hit the prefix and need no vision run.
    before = clf.vision_calls
    for request, result in zip(requests, results):
        again = clf.classify([request])[0]
        assert again.cached_tokens >= video_end // block * block
        np.testing.assert_allclose(again.probs, result.probs, rtol=0, atol=1e-5)
    assert clf.vision_calls == before

    # Sharing off: the vision tower runs per request, nothing is cached, and the answers do not change.
    private = tiny_classifier("qwen2_5_vl-gqa", enable_prefix_sharing=False)
    before = private.vision_calls
    unshared = private.classify([_with_clip(r, _fresh(clip)) for r in requests])
    assert private.vision_calls - before == 4
    assert all(r.cached_tokens == 0 for r in unshared)  # not even the system prompt
    for a, b in zip(results, unshared):
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=1e-5)


def test_per_request_errors_do_not_stop_the_batch(tiny_classifier, rng, make_clip, make_request):
    clf = tiny_classifier("qwen2_vl-gqa", max_model_len=300)
    short = make_clip(rng, f"short-{uuid.uuid4().hex}", num_frames=2, size=(56, 56))
    long = make_clip(rng, f"long-{uuid.uuid4().hex}", num_frames=40, size=(112, 112))
    ok = make_request(rng, "ok", short)
    requests = [
        make_request(rng, "too-long", long),
        ok,
        dataclasses.replace(ok, request_id="one-option", options=("only",)),
        dataclasses.replace(ok, request_id="six-options", options=tuple("abcdef")),
        dataclasses.replace(ok, request_id="bad-frames", clip=Clip(np.zeros((2, 8, 8), np.uint8), {}, "x")),
        make_request(rng, "ok2", short),
    ]
    results = clf.classify(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    errors = {r.request_id: r.error for r in results}
    assert "max_model_len 300" in errors["too-long"]
    assert "2 to 5 options" in errors["one-option"] and "2 to 5 options" in errors["six-options"]
    assert "[T, H, W, 3]" in errors["bad-frames"]
    for i in (1, 5):
        r = results[i]
        assert r.error is None and len(r.probs) == len(requests[i].options) and abs(sum(r.probs) - 1) < 1e-9
    assert all(r.choice is None and r.probs == [] for r in results if r.error)


def test_results_follow_request_order_across_interleaved_clips(tiny_classifier, rng, make_clip, make_request):
    clf = tiny_classifier("qwen2_vl-mha")
    clips = [make_clip(rng, f"inter-{uuid.uuid4().hex}") for _ in range(3)]
    requests = [make_request(rng, f"r{i}", clips[i % 3]) for i in range(7)]
    together = clf.classify(requests)
    assert [r.request_id for r in together] == [r.request_id for r in requests]
    for request, result in zip(requests, together):
        alone = clf.classify([_with_clip(request, _fresh(request.clip))])[0]
        np.testing.assert_allclose(result.probs, alone.probs, rtol=0, atol=1e-5)


@pytest.fixture
def broken_checkpoint(checkpoint_dir, tmp_path):
    def copy() -> str:
        target = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
        shutil.copytree(checkpoint_dir("qwen2_vl-gqa"), target)
        return target

    return copy


def test_load_errors_name_the_problem(broken_checkpoint, tmp_path):
    with pytest.raises(EngineError, match="no config.json"):
        Classifier.from_pretrained(tmp_path)
    path = broken_checkpoint()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(EngineError, match="'llava' is not supported"):
        Classifier.from_pretrained(path)
    nested = {k: v for k, v in config.items() if k != "hidden_size"}
    (path / "config.json").write_text(json.dumps({**nested, "text_config": {"hidden_size": 64}}))
    with pytest.raises(EngineError, match="flat layout"):
        Classifier.from_pretrained(path)
    path = broken_checkpoint()
    (path / "model.safetensors").unlink()
    with pytest.raises(EngineError, match="safetensors"):
        Classifier.from_pretrained(path)
    path = broken_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(EngineError, match="tokenizer"):
        Classifier.from_pretrained(path)
    with pytest.raises(EngineError, match="not a local directory"):
        Classifier.from_pretrained(tmp_path / "no-such-dir")


def test_budget_and_labels_fail_at_start(checkpoint_dir):
    path = checkpoint_dir("qwen2_vl-gqa")
    with pytest.raises(EngineError, match="memory budget"):
        Classifier.from_pretrained(path, EngineConfig(memory_budget_gb=1e-4, max_model_len=4096))
    with pytest.raises(EngineError, match="single token"):
        Classifier.from_pretrained(path, EngineConfig(option_labels=("A1", "B", "C"), memory_budget_gb=1.0))
    with pytest.raises(EngineError, match="max_num_batched_tokens"):
        Classifier.from_pretrained(path, EngineConfig(max_num_batched_tokens=0))
    with pytest.raises(EngineError, match="prompt_template"):
        Classifier.from_pretrained(path, EngineConfig(prompt_template="{question} only"))
    import mlx.core as mx

    if not mx.metal.is_available():  # no Metal here: asking for the kernels is an error, auto falls back
        with pytest.raises(EngineError, match="attention_backend='metal'"):
            Classifier.from_pretrained(path, EngineConfig(attention_backend="metal", memory_budget_gb=1.0))
        auto = Classifier.from_pretrained(path, EngineConfig(memory_budget_gb=1.0, max_model_len=1024))
        assert auto.attention_backend == "portable"


def test_prepared_inputs_answer_like_frames(tiny_classifier, rng, make_clip, make_request, check_choice):
    """Inputs prepared outside the engine (as the pipeline's decoders do) give the frames' answers; inputs
    made with other processor settings are a per-request error, not a silently different answer."""
    from batchjob.engine import preprocess_video
    from batchjob.engine.preprocess import VisionSettings

    clf = tiny_classifier("qwen2_5_vl-gqa")
    clip = make_clip(rng, f"prep-{uuid.uuid4().hex}", num_frames=int(rng.integers(1, 6)))
    requests = [make_request(rng, f"f{i}", clip) for i in range(2)]
    from_frames = clf.classify(requests)
    inputs = preprocess_video(clip.frames, clip.metadata, clf.checkpoint.vision)
    prepared = Clip(None, clip.metadata, f"prep-{uuid.uuid4().hex}", inputs=inputs)
    before = clf.vision_calls
    from_inputs = clf.classify([_with_clip(r, prepared) for r in requests])
    assert clf.vision_calls - before == 1
    for a, b in zip(from_frames, from_inputs):
        assert b.error is None and a.prompt_tokens == b.prompt_tokens
        check_choice(b, a.logprobs)
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=1e-6)
    # The decoders' uint8 patch bytes, normalised on the engine's device: the same pixel values, so the same
    # vision features bit for bit, and the same answers (to the tolerance of a repeated call: the prefix cache
    # changes what a call computes together).
    import mlx.core as mx

    from batchjob.engine.patchify import normalize_on_device, normalize_table

    packed = preprocess_video(clip.frames, clip.metadata, clf.checkpoint.vision, normalise=False)
    assert packed.pixel_values.dtype == np.uint8
    ck, v = clf.checkpoint, clf.checkpoint.vision
    with mx.stream(clf._device):
        features = [np.array(ck.family.encode_video(ck.model, pixels, inputs.grid_thw, ck.dtype).astype(mx.float32))
                    for pixels in (inputs.pixel_values,
                                   normalize_on_device(packed.pixel_values, normalize_table(v.image_mean, v.image_std)))]
    np.testing.assert_array_equal(*features)
    from_bytes = clf.classify([_with_clip(r, Clip(None, clip.metadata, f"bytes-{uuid.uuid4().hex}", inputs=packed))
                               for r in requests])
    for a, b in zip(from_inputs, from_bytes):
        assert b.error is None and a.prompt_tokens == b.prompt_tokens
        check_choice(b, a.logprobs)
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=1e-6)

    v = clf.checkpoint.vision
    other = preprocess_video(clip.frames, clip.metadata, VisionSettings(v.min_pixels, v.max_pixels * 2))
    [bad] = clf.classify([_with_clip(requests[0], Clip(None, clip.metadata, "other-settings", inputs=other))])
    assert bad.choice is None and "prepared with processor settings" in bad.error


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_a_clips_questions_take_one_pass_and_match_each_asked_alone(tiny_classifier, rng, make_clip, make_request,
                                                                    check_choice, monkeypatch, name):
    """The followers join the pass that writes their leader's video (scheduler.py): one forward for the clip, each
    follower reading the prefix blocks written in that same pass; answers as each question gets alone, unshared."""
    from batchjob.engine import classifier as classifier_module

    clf = tiny_classifier(name)
    clip = make_clip(rng, f"one-pass-{uuid.uuid4().hex}")
    requests = [make_request(rng, f"q{i}", clip) for i in range(int(rng.integers(2, 5)))]
    passes = []
    real = classifier_module.forward
    monkeypatch.setattr(classifier_module, "forward", lambda *a, **k: passes.append(len(a[1])) or real(*a, **k))
    results = clf.classify(requests)
    monkeypatch.undo()
    assert passes == [len(requests)]
    num_video = results[0].prompt_tokens - len(clf.prompts.token_ids(requests[0].question, requests[0].options, 0))
    ids = clf.prompts.token_ids(requests[0].question, requests[0].options, num_video)
    video_end = placeholder_runs(ids, clf.checkpoint.video_token_id)[-1][1]
    block = clf.config.block_size
    assert all(r.cached_tokens >= video_end // block * block for r in results[1:])   # the leader's video blocks
    private = tiny_classifier(name, enable_prefix_sharing=False)
    for request, got in zip(requests, results):
        alone = private.classify([_with_clip(request, _fresh(clip))])[0]
        assert got.error is None and alone.cached_tokens == 0
        np.testing.assert_allclose(got.probs, alone.probs, rtol=0, atol=1e-5)
        check_choice(got, alone.logprobs)
