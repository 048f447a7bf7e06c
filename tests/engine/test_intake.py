"""A call's host work a step ahead of the device (`intake.CallIntake`): the first step's towers start before any
prompt is built, later steps' towers while the pass before them runs, prompts only as far as the next step reaches.

Checked: which towers have started when the first prompt is built (the clips the first step reaches, in admission
order); that no step encodes a tower itself when the look-ahead could; how few prompts exist when the first pass
runs; answers identical to the whole call prepared up front with every tower started by its step; nothing kept for a
clip whose requests all fail (started at the call's start or ahead of a later step) or after an exception; no tower
for a clip whose input fails its check; `runner.forward`'s `on_queued` hook called once per pass, before the wait;
passes overlapped (each queued behind the one before, whose logits are read only then) taking the steps and giving
the answers of passes run one by one.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest

from batchjob.engine import Clip
from batchjob.engine import classifier as classifier_module
from batchjob.engine.intake import CallIntake, key_groups

REAL_ADMIT = CallIntake.admit


def _admit_all(self, tokens, most=None):
    return REAL_ADMIT(self, 10**12)


def _no_towers(self, budget, most=None):
    return 0


class _Budget:
    """`with _Budget(clf, n):` the engine's tokens per step set to `n` for the block (the shared engine keeps its
    own after it)."""

    def __init__(self, clf, tokens: int):
        self.clf, self.tokens = clf, tokens

    def __enter__(self):
        self.saved = self.clf.config.max_num_batched_tokens
        self.clf.config.max_num_batched_tokens = self.tokens

    def __exit__(self, *exc):
        self.clf.config.max_num_batched_tokens = self.saved


def _clip_tokens(clf, clip) -> int:
    return clf._clip_plan(clip).num_tokens


def _expected_started(tokens: list[int], budget: int) -> int:
    """The clips a step of `budget` tokens reaches: each while the video tokens before it are under the budget
    (independent of the engine's loop: an exclusive running sum)."""
    before = np.concatenate([[0], np.cumsum(tokens)[:-1]])
    return int((before < budget).sum())


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
    before = clf.vision_calls
    with _Budget(clf, budget):
        results = clf.classify(requests)
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
    # the reference: every prompt built up front, every tower started by the step that needs it
    monkeypatch.setattr(CallIntake, "start_towers", _no_towers)
    monkeypatch.setattr(CallIntake, "admit", _admit_all)
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



def _many_step_call(rng, make_clip, make_request, tag: str, clips: int):
    """Equal clips (video most of each prompt), 1-3 questions each, shuffled (the engine groups them by clip)."""
    made = [make_clip(rng, f"{tag}-{uuid.uuid4().hex}", num_frames=16) for _ in range(clips)]
    requests = [make_request(rng, f"{tag}{i}-{j}", c) for i, c in enumerate(made)
                for j in range(int(rng.integers(1, 4)))]
    rng.shuffle(requests)
    return made, requests


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_later_steps_find_their_towers_started(tiny_classifier, rng, make_clip, make_request, monkeypatch, name):
    """Every tower is started at the call's start or while the pass before its step runs; none by the step that
    reads it (which would leave the device idle while the host builds the tower's graph)."""
    clf = tiny_classifier(name, max_model_len=4096)
    clips, requests = _many_step_call(rng, make_clip, make_request, "ahead", int(rng.integers(8, 12)))
    prompt = clf._prepare(0, requests[0], -1).num_tokens
    where, inside = [], [False]
    real_encode, real_rows = type(clf)._encode, type(clf)._video_rows

    def encode(self, *a, **k):
        where.append("step" if inside[0] else "ahead")
        return real_encode(self, *a, **k)

    def video_rows(self, *a, **k):
        inside[0] = True
        try:
            return real_rows(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(type(clf), "_encode", encode)
    monkeypatch.setattr(type(clf), "_video_rows", video_rows)
    steps = []
    real_forward = classifier_module.forward
    monkeypatch.setattr(classifier_module, "forward", lambda m, batch, *a, **k: (steps.append(batch),
                                                                                   real_forward(m, batch, *a, **k))[1])
    # a budget between two and three prompts: several steps, most of which cut a clip's prompt
    budget = (int(rng.integers(2 * prompt, 3 * prompt)) + 15) // 16 * 16
    with _Budget(clf, budget):
        results = clf.classify(requests)
    assert all(r.error is None for r in results)
    assert len(steps) >= 3
    assert where == ["ahead"] * len(clips)   # once per clip, and never by its step
    assert not any(c.media_id in clf._features._clips for c in clips)


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_prompts_are_built_a_step_ahead(tiny_classifier, rng, make_clip, make_request, monkeypatch, name):
    """When the first pass runs, only the prompts of the first steps exist; yet every step takes the same requests
    and tokens as the call prepared up front (with every tower started by its step), and the answers are equal."""
    clf = tiny_classifier(name, max_model_len=4096)
    clips, requests = _many_step_call(rng, make_clip, make_request, "lazy", int(rng.integers(10, 14)))
    prompt = clf._prepare(0, requests[0], -1).num_tokens
    budget = (int(rng.integers(prompt, 2 * prompt)) + 15) // 16 * 16   # one prompt and part of the next per step
    # the text blocks before each video (Qwen3-VL's first timestamp among them) cached before either call, so both
    # calls find the same blocks cached
    warm = [make_request(rng, f"warm{i}", dataclasses.replace(c, media_id=c.media_id + "-w"))
            for i, c in enumerate(clips)]
    assert all(r.error is None for r in clf.classify(warm))
    built, at_forward = [0], []
    real_prepare, real_forward = type(clf)._prepare, classifier_module.forward

    def prepare(self, *a, **k):
        built[0] += 1
        return real_prepare(self, *a, **k)

    def forward(model, batch, *a, **k):
        at_forward.append((built[0], [(s.seq.index, s.num_new) for s in batch]))
        return real_forward(model, batch, *a, **k)

    monkeypatch.setattr(type(clf), "_prepare", prepare)
    monkeypatch.setattr(classifier_module, "forward", forward)
    with _Budget(clf, budget):
        lazy = clf.classify(requests)
    lazy_steps = [step for _, step in at_forward]
    first_built = at_forward[0][0]
    monkeypatch.setattr(CallIntake, "start_towers", _no_towers)
    monkeypatch.setattr(CallIntake, "admit", _admit_all)
    at_forward.clear()
    with _Budget(clf, budget):
        eager = clf.classify([dataclasses.replace(r, clip=dataclasses.replace(r.clip, media_id=r.clip.media_id + "-e"))
                              for r in requests])
    assert lazy_steps == [step for _, step in at_forward] and len(lazy_steps) >= 4
    # one step's tokens are at most two prompts: the first clips' requests up to the clip that crosses the mark (more
    # for prompts of uneven length), never all of them
    order = list(dict.fromkeys(r.clip.media_id for r in requests))
    first_six = sum(1 for r in requests if r.clip.media_id in order[:6])
    assert len(lazy_steps[0]) <= first_built <= first_six < len(requests)
    assert built[0] == 2 * len(requests)   # every prompt once per call
    for a, b in zip(lazy, eager):
        assert a.error is None and b.error is None and a.request_id == b.request_id
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert a.prompt_tokens == b.prompt_tokens


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_work_ahead_is_done_at_the_pass_layer_waits(tiny_classifier, rng, make_clip, make_request, monkeypatch, name):
    """With a layer to wait on (LAYER_LAG 1 over two layers), each pass that has work ahead does pieces of it at its
    waits. Passes overlapped (the engine's way), a pass is queued behind the one before, whose logits are read only
    then; it waits once on that pass's last layer and once on its own first, and once queued starts the next step's
    towers only. Step by step, a pass waits once and does the rest once queued. The steps and answers are the same
    in all three, and with no waits at all (LAYER_LAG 0)."""
    from batchjob.engine import runner
    from batchjob.engine.intake import StepAhead

    clf = tiny_classifier(name, max_model_len=4096)
    assert len(clf.checkpoint.model.language_model.model.layers) == 2
    clips, requests = _many_step_call(rng, make_clip, make_request, "waits", int(rng.integers(8, 12)))
    prompt = clf._prepare(0, requests[0], -1).num_tokens
    budget = (int(rng.integers(prompt, 2 * prompt)) + 15) // 16 * 16
    warm = [make_request(rng, f"warm{i}", dataclasses.replace(c, media_id=c.media_id + "-w"))
            for i, c in enumerate(clips)]
    assert all(r.error is None for r in clf.classify(warm))   # the calls below find the same text blocks cached
    passes, events = [], []   # per pass: its pieces (where, did) and towers calls; the loop's forwards and reads
    real = StepAhead.piece, StepAhead.finish, StepAhead.towers, classifier_module.forward, type(clf)._read_answers
    finishing = [False]

    def piece(self):
        did = real[0](self)
        passes[-1]["pieces"].append(("queued" if finishing[0] else "wait", did))
        return did

    def finish(self):
        finishing[0] = True
        try:
            real[1](self)
        finally:
            finishing[0] = False

    def towers(self):
        passes[-1]["towers"] += 1
        return real[2](self)

    def forward(model, batch, *a, **k):
        passes.append({"pieces": [], "towers": 0, "step": [(s.seq.index, s.num_new) for s in batch]})
        out = real[3](model, batch, *a, **k)
        passes[-1]["out"] = out
        events.append(("forward", len(passes) - 1))
        return out

    def read_answers(intake, requests, batch, out):
        events.append(("read", next(i for i, p in enumerate(passes) if p.get("out") is out)))
        return real[4](intake, requests, batch, out)

    monkeypatch.setattr(StepAhead, "piece", piece)
    monkeypatch.setattr(StepAhead, "finish", finish)
    monkeypatch.setattr(StepAhead, "towers", towers)
    monkeypatch.setattr(classifier_module, "forward", forward)
    monkeypatch.setattr(type(clf), "_read_answers", staticmethod(read_answers))
    runs = {}
    for overlap, lag in ((True, 1), (True, 0), (False, 1)):
        monkeypatch.setattr(runner, "LAYER_LAG", lag)
        monkeypatch.setattr(classifier_module, "OVERLAP_PASSES", overlap)
        passes.clear()
        events.clear()
        tagged = [dataclasses.replace(r, clip=dataclasses.replace(r.clip, media_id=f"{r.clip.media_id}-{overlap}{lag}"))
                  for r in requests]
        with _Budget(clf, budget):
            runs[overlap, lag] = (clf.classify(tagged), [dict(p) for p in passes], list(events))
    steps = {key: [p["step"] for p in run[1]] for key, run in runs.items()}
    assert steps[True, 1] == steps[True, 0] == steps[False, 1] and len(steps[True, 1]) >= 4
    n = len(steps[True, 1])
    for (overlap, lag), (_, run_passes, run_events) in runs.items():
        if overlap:   # pass k's logits are read once pass k + 1 is queued, before pass k + 2 is built
            reads = [e for k in range(1, n) for e in (("forward", k), ("read", k - 1))]
            assert run_events == [("forward", 0)] + reads + [("read", n - 1)], (overlap, lag)
            assert all(p["towers"] == 1 and all(where == "wait" for where, _ in p["pieces"]) for p in run_passes)
            waits = [len(p["pieces"]) for p in run_passes]
            assert waits == ([1] + [2] * (n - 1) if lag else [0] * n), waits
        else:
            assert run_events == [e for k in range(n) for e in (("forward", k), ("read", k))]
            for p in run_passes:
                assert p["towers"] == 0 and [where for where, _ in p["pieces"]][:1] == ["wait"]
                assert sum(where == "wait" for where, _ in p["pieces"]) == 1
                assert all(where == "queued" for where, _ in p["pieces"][1:]) and p["pieces"][-1][1] is False
        if lag:
            assert any(did for p in run_passes for where, did in p["pieces"] if where == "wait")   # work at a wait
    reference = runs[False, 1][0]
    for key in ((True, 1), (True, 0)):
        for a, b in zip(runs[key][0], reference):
            assert a.error is None and b.error is None and a.request_id == b.request_id
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
            assert (a.choice, a.prompt_tokens, a.cached_tokens) == (b.choice, b.prompt_tokens, b.cached_tokens)


def test_failed_clip_started_ahead_of_a_later_step_keeps_nothing(tiny_classifier, rng, make_clip, make_request):
    clf = tiny_classifier("qwen2_vl-gqa", max_model_len=300)
    fine = [make_clip(rng, f"fine-{uuid.uuid4().hex}", num_frames=2, size=(56, 56)) for _ in range(4)]
    probe = make_request(rng, "probe", fine[0])
    around = len(clf.prompts.token_ids(probe.question, probe.options, 0))
    near = next(c for c in (make_clip(rng, f"near-{uuid.uuid4().hex}", num_frames=n, size=(112, 112))
                            for n in range(2, 40)) if 300 - around < _clip_tokens(clf, c) < 300)
    # near's prompts cannot fit, so its requests all fail when they are built; it comes after two steps' clips
    requests = [make_request(rng, f"f{i}", c) for i, c in enumerate(fine[:2])]
    requests += [dataclasses.replace(probe, request_id=f"near{j}", clip=near) for j in range(2)]   # probe's text
    requests += [make_request(rng, f"g{i}", c) for i, c in enumerate(fine[2:])]
    before = clf.vision_calls
    with _Budget(clf, _clip_tokens(clf, fine[0]) + 16):
        results = {r.request_id: r for r in clf.classify(requests)}
    assert all("max_model_len 300" in results[f"near{j}"].error for j in range(2))
    assert all(results[r.request_id].error is None for r in requests if not r.request_id.startswith("near"))
    assert clf.vision_calls - before == len(fine) + 1   # near's tower ran (ahead, wasted), once
    assert not clf._features.holds(near.media_id)


def test_an_exception_mid_call_leaves_nothing_in_flight(tiny_classifier, rng, make_clip, make_request, monkeypatch):
    clf = tiny_classifier("qwen2_5_vl-gqa", max_model_len=4096)
    clips, requests = _many_step_call(rng, make_clip, make_request, "boom", 6)
    free = clf.pool.num_free_blocks
    calls, real_forward = [0], classifier_module.forward

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("device lost")
        return real_forward(*a, **k)

    monkeypatch.setattr(classifier_module, "forward", failing)
    prompt = clf._prepare(0, requests[0], -1).num_tokens
    with _Budget(clf, (2 * prompt + 15) // 16 * 16), pytest.raises(RuntimeError, match="device lost"):
        clf.classify(requests)
    assert not clf._features._clips   # neither the step's clips nor those started ahead of the next one
    assert clf.pool.num_free_blocks == free   # every block of the failed call back (free, or cached)
    monkeypatch.setattr(classifier_module, "forward", real_forward)
    again = clf.classify(requests)
    assert all(r.error is None for r in again)


@pytest.mark.parametrize("overlap", [True, False])
def test_on_queued_runs_once_per_pass_before_its_wait(tiny_classifier, rng, make_clip, make_request, monkeypatch,
                                                      overlap):
    """Chunked passes (no logits) included: the hook sees the pass queued and not yet waited for. Passes overlapped,
    nothing waits between it and the next pass's start; step by step, the pass's closing wait follows it."""
    import mlx.core as mx

    monkeypatch.setattr(classifier_module, "OVERLAP_PASSES", overlap)
    clf = tiny_classifier("qwen2_5_vl-gqa", max_model_len=4096)
    clip = make_clip(rng, f"chunks-{uuid.uuid4().hex}", num_frames=6, size=(112, 112))
    requests = [make_request(rng, f"c{j}", clip) for j in range(2)]
    events, real_forward, real_eval = [], classifier_module.forward, mx.eval

    def forward(model, batch, *a, on_queued=None, **k):
        events.append("pass")

        def hook():
            events.append("queued")
            on_queued()
        return real_forward(model, batch, *a, on_queued=hook, **k)

    def eval_(*a, **k):
        if events and events[-1] == "queued":
            events.append("wait")
        return real_eval(*a, **k)

    monkeypatch.setattr(classifier_module, "forward", forward)
    monkeypatch.setattr(mx, "eval", eval_)
    with _Budget(clf, max(16, _clip_tokens(clf, clip) // 3 // 16 * 16)):   # the leader's prompt over several passes
        results = clf.classify(requests)
    assert all(r.error is None for r in results)
    passes = events.count("pass")
    assert passes >= 3 and events == (["pass", "queued"] if overlap else ["pass", "queued", "wait"]) * passes


def test_key_groups_are_runs_of_equal_keys(rng):
    keys = [str(k) for k in rng.integers(0, 4, 30)]
    order = list(rng.permutation(30))
    groups = key_groups(keys, order)
    assert [i for g in groups for i in g.indices] == order
    assert all(keys[i] == g.key for g in groups for i in g.indices)
    assert all(a.key != b.key for a, b in zip(groups, groups[1:]))
