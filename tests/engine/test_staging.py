"""A later call's host work done ahead on another thread (`Classifier.stage`, engine/staging.py).

Checked: answers equal to the same call unstaged (to fp32 rounding: see `_same_answer`), with the staging run on a
second thread while another call is in its forward; the call takes what was staged (no second upload, no second prompt) and leaves nothing
behind; a request that fails in staging fails in its call as it would have; the hook that gives staging its turn
fires once the call's first pass is queued.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid

import numpy as np
import pytest

from batchjob.engine import Clip
from batchjob.engine.preprocess import preprocess_video


def _prepared(clf, clip, tag: str) -> Clip:
    """The clip as the pipeline's decoders send it: uint8 patch bytes made with the engine's settings."""
    inputs = preprocess_video(clip.frames, clip.metadata, clf.checkpoint.vision, normalise=False)
    return Clip(None, clip.metadata, f"{clip.media_id}-{tag}", inputs=inputs)


def _same_answer(a, b) -> None:
    """Equal to fp32 rounding, not bit for bit: two calls of the same requests may differ in the last bits (a
    leading text block computed within one call's pass and read from the prefix cache in the other's; the CPU's
    multi-threaded BLAS, whose sums come out in different orders from run to run). A staging mistake (another
    clip's features, another prompt) moves the answer by orders of magnitude more."""
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def _requests(requests, clips, tag: str, clf):
    fresh = {c.media_id: _prepared(clf, c, tag) for c in clips}
    return [dataclasses.replace(r, clip=fresh[r.clip.media_id]) for r in requests]


@pytest.fixture
def counters(monkeypatch):
    """Counts uploads (`upload_bytes`) and prompts made (`family.video_prompt`) on the classifier."""
    from batchjob.engine import classifier as classifier_module

    def install(clf):
        counts = {"upload": 0, "prompt": 0}
        real_upload, real_prompt = classifier_module.upload_bytes, clf.checkpoint.family.video_prompt
        from batchjob.engine import patchify

        real_patchify_upload = patchify.upload_bytes

        def upload(*a, **k):
            counts["upload"] += 1
            return real_upload(*a, **k)

        def patchify_upload(*a, **k):
            counts["upload"] += 1
            return real_patchify_upload(*a, **k)

        def prompt(*a, **k):
            counts["prompt"] += 1
            return real_prompt(*a, **k)

        monkeypatch.setattr(classifier_module, "upload_bytes", upload)
        monkeypatch.setattr(patchify, "upload_bytes", patchify_upload)
        monkeypatch.setattr(clf.checkpoint.family, "video_prompt", prompt)
        return counts
    return install


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_staged_on_another_thread_during_a_forward_answers_the_same(tiny_classifier, rng, make_clip, make_request,
                                                                   counters, name):
    clf = tiny_classifier(name)
    clips = [make_clip(rng, f"stage-{uuid.uuid4().hex}", num_frames=int(rng.integers(2, 6))) for _ in range(3)]
    base = [make_request(rng, f"q{i}-{j}", c) for i, c in enumerate(clips) for j in range(int(rng.integers(1, 4)))]
    running = _requests(base, clips, "running", clf)
    plain = clf.classify(_requests(base, clips, "plain", clf))
    staged = _requests(base, clips, "staged", clf)
    counts = counters(clf)

    # While a call runs, the hook fires at its first pass's first wait; the staging then runs on another thread.
    done = threading.Event()
    stager = threading.Thread(target=lambda: (clf.stage(staged), done.set()))
    fired: list[str] = []

    def busy():
        fired.append(threading.current_thread().name)
        if not stager.is_alive() and not done.is_set():
            stager.start()

    clf.on_device_busy = busy
    try:
        clf.classify(running)
        stager.join(60)
    finally:
        clf.on_device_busy = None
    assert done.is_set() and fired and set(fired) == {threading.current_thread().name}
    uploads, prompts = counts["upload"], counts["prompt"]
    assert uploads == 2 * len(clips) and prompts == 2 * len(base)   # the running call's own, and the staging's
    assert len(clf._staging) == len(clips) + len(base)

    got = clf.classify(staged)
    assert counts["upload"] == uploads and counts["prompt"] == prompts    # all taken from the staging
    assert len(clf._staging) == 0
    for a, b in zip(plain, got):
        assert a.error is None and b.error is None and a.request_id == b.request_id
        _same_answer(a, b)
        assert a.prompt_tokens == b.prompt_tokens


def test_what_staging_could_not_do_the_call_reports_and_nothing_is_left(tiny_classifier, rng, make_clip, make_request,
                                                                       counters):
    from batchjob.engine.types import ClassifyRequest

    clf = tiny_classifier("qwen2_vl-gqa", max_model_len=300)
    clip = make_clip(rng, f"ok-{uuid.uuid4().hex}", num_frames=2, size=(56, 56))
    huge = make_clip(rng, f"huge-{uuid.uuid4().hex}", num_frames=40, size=(112, 112))   # too long for 300 tokens
    ok = make_request(rng, "ok", _prepared(clf, clip, "a"))
    too_long = make_request(rng, "long", _prepared(clf, huge, "a"))
    bad_options = ClassifyRequest("opts", ok.clip, ok.question, ["only one"] * 30)      # more options than labels
    v = clf.checkpoint.vision
    from batchjob.engine.preprocess import VisionSettings
    other = Clip(None, clip.metadata, "other", inputs=preprocess_video(
        clip.frames, clip.metadata, VisionSettings(v.min_pixels, v.max_pixels * 2), normalise=False))
    wrong_settings = make_request(rng, "settings", other)
    requests = [ok, too_long, bad_options, wrong_settings]
    unstaged = {r.request_id: r for r in clf.classify(requests)}
    again = [dataclasses.replace(r, clip=dataclasses.replace(r.clip, media_id=f"{r.clip.media_id}-again",
                                                             inputs=dataclasses.replace(r.clip.inputs)))
             for r in requests]
    clf.stage(again)
    staged = {r.request_id: r for r in clf.classify(again)}
    assert len(clf._staging) == 0
    for key, a in unstaged.items():
        b = staged[key]
        assert (a.error is None) == (b.error is None) and a.error == b.error, key
        if a.error is None:
            _same_answer(a, b)
    assert unstaged["ok"].error is None and "max_model_len 300" in unstaged["long"].error
    assert "prepared with processor settings" in unstaged["settings"].error and unstaged["opts"].error
