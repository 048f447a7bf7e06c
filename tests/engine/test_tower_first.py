"""The towers of a call's first clips start before its prompts are built and scheduled (`Classifier._start_towers`).

Checked: which towers have started when the first prompt is built (the clips the first step can hold, in
admission order), answers identical to towers started by the step that needs them, nothing kept for a clip
whose requests all fail, and no tower for a clip whose input fails its check.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest

from batchjob.engine import Clip


def _clip_tokens(clf, clip) -> int:
    return clf._clip_plan(clip).num_tokens


def _expected_started(tokens: list[int], budget: int) -> int:
    """What the first step can hold: the first clip always, then clips while the budget lasts (independent of the
    engine's loop: a running sum)."""
    total = np.cumsum(tokens)
    return max(1, int(np.searchsorted(total, budget, side="right")))


@pytest.fixture
def prompt_probe(monkeypatch):
    """Records `clf.vision_calls` when the first prompt of a call is built."""
    def install(clf):
        seen: list[int] = []
        family = clf.checkpoint.family
        real = family.video_prompt

        def video_prompt(*a, **k):
            seen.append(clf.vision_calls)
            return real(*a, **k)

        monkeypatch.setattr(family, "video_prompt", video_prompt)
        return seen
    return install


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_first_steps_towers_start_before_any_prompt(tiny_classifier, rng, make_clip, make_request, prompt_probe, name):
    clf = tiny_classifier(name, max_model_len=4096)
    clips = [make_clip(rng, f"first-{uuid.uuid4().hex}", num_frames=int(rng.integers(2, 7))) for _ in range(4)]
    tokens = [_clip_tokens(clf, c) for c in clips]
    # a budget that ends somewhere inside the clips: between one clip's worth and all of them
    budget = int(rng.integers(tokens[0], sum(tokens) + 1)) // 16 * 16 + 16
    requests = [make_request(rng, f"q{i}-{j}", c) for i, c in enumerate(clips) for j in range(int(rng.integers(1, 4)))]
    rng.shuffle(requests)   # the engine groups a clip's requests in first-appearance order
    order = list(dict.fromkeys(r.clip.media_id for r in requests))
    admitted = [tokens[[c.media_id for c in clips].index(m)] for m in order]
    seen = prompt_probe(clf)
    saved = clf.config.max_num_batched_tokens
    clf.config.max_num_batched_tokens = budget
    try:
        before = clf.vision_calls
        results = clf.classify(requests)
    finally:
        clf.config.max_num_batched_tokens = saved
    assert all(r.error is None for r in results)
    assert seen[0] - before == _expected_started(admitted, budget)
    assert clf.vision_calls - before == len(clips)   # still once per clip
    assert not any(clf._features.holds(c.media_id) and c.media_id in clf._features._clips for c in clips)


def test_answers_equal_towers_started_by_their_step(tiny_classifier, rng, make_clip, make_request, monkeypatch):
    clf = tiny_classifier("qwen2_5_vl-gqa")
    clips = [make_clip(rng, f"same-{uuid.uuid4().hex}") for _ in range(3)]
    requests = [make_request(rng, f"q{i}-{j}", c) for i, c in enumerate(clips) for j in range(2)]

    def renamed(tag: str):
        fresh = {c.media_id: dataclasses.replace(c, media_id=f"{c.media_id}-{tag}") for c in clips}
        return [dataclasses.replace(r, clip=fresh[r.clip.media_id]) for r in requests]

    early = clf.classify(renamed("early"))
    monkeypatch.setattr(type(clf), "_start_towers", lambda self, *a: [])
    late = clf.classify(renamed("late"))
    for a, b in zip(early, late):
        assert a.error is None and b.error is None
        # to fp32 rounding: the second call finds the system prompt cached, and the CPU's multi-threaded BLAS sums
        # in a different order from run to run; a tower's features given to the wrong step would be far off
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert a.prompt_tokens == b.prompt_tokens


def test_nothing_kept_for_failed_clips(tiny_classifier, rng, make_clip, make_request):
    clf = tiny_classifier("qwen2_vl-gqa", max_model_len=300)
    short = make_clip(rng, f"short-{uuid.uuid4().hex}", num_frames=2, size=(56, 56))
    # the video fits max_model_len but no prompt around it does: its tower starts, its requests all fail
    text = make_request(rng, "near", short)
    around = len(clf.prompts.token_ids(text.question, text.options, 0))   # the prompt's tokens besides the video
    near = next(c for c in (make_clip(rng, f"near-{uuid.uuid4().hex}", num_frames=n, size=(112, 112))
                            for n in range(2, 40)) if 300 - around < _clip_tokens(clf, c) < 300)
    huge = make_clip(rng, f"huge-{uuid.uuid4().hex}", num_frames=40, size=(112, 112))   # the video alone is too long
    bad = Clip(np.zeros((2, 8, 8), np.uint8), {}, f"bad-{uuid.uuid4().hex}")
    requests = [dataclasses.replace(text, clip=near), make_request(rng, "huge", huge), make_request(rng, "bad", bad),
                make_request(rng, "ok", short)]
    before = clf.vision_calls
    results = {r.request_id: r for r in clf.classify(requests)}
    assert "max_model_len 300" in results["near"].error and "max_model_len 300" in results["huge"].error
    assert "[T, H, W, 3]" in results["bad"].error and results["ok"].error is None
    assert clf.vision_calls - before == 2   # near (started early, wasted) and short; never huge or bad
    for clip in (near, huge, bad):
        assert not clf._features.holds(clip.media_id)

