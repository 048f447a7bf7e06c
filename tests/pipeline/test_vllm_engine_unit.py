"""The vLLM engine's own logic without vLLM: a recording stand-in for `vllm.LLM` checks what we send it
(token prompts, vLLM's six metadata keys only, option-token restriction, two waves) and how its log-probs
become answers. The real vLLM runs in tests/vllm/test_engine_vllm.py."""
from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

from batchjob.config import ConfigError, ModelConfig, PromptConfig, VllmConfig
from batchjob.contract import VLLM_METADATA_KEYS, ClipJob, ClipMetadata, EngineClip, Question
from batchjob.synthetic.tiny_model import write_tiny_checkpoint


@dataclass
class FakeLogprob:
    logprob: float


class FakeLLM:
    """Answers from fixed logits per option label token, as a softmax over the allowed tokens (what
    `processed_logprobs` with `allowed_token_ids` returns); records every call."""

    def __init__(self, tokenizer, rng, reject: str | None = None):
        self.tokenizer, self.rng, self.reject = tokenizer, rng, reject
        self.calls: list[list[dict]] = []
        self.logits: dict[tuple, np.ndarray] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(prompts)
        outs = []
        for prompt, p in zip(prompts, params):
            if self.reject and self.reject in self.tokenizer.decode(prompt["prompt_token_ids"]):
                raise ValueError("prompt too long")
            key = tuple(prompt["prompt_token_ids"])
            logits = self.logits.setdefault(key, self.rng.normal(0, 2, len(p.allowed_token_ids)))
            lp = logits - np.log(np.exp(logits).sum())
            top = {t: FakeLogprob(float(v)) for t, v in zip(p.allowed_token_ids, lp)}
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(logprobs=[top])],
                                              prompt_token_ids=prompt["prompt_token_ids"] * 3, num_cached_tokens=7))
        return outs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake_vllm(monkeypatch):
    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams))


def _clip(i: int, n_questions: int, rng) -> EngineClip:
    meta = ClipMetadata.from_loader({"fps": 30.0, "total_num_frames": 90, "frames_indices": [0, 30, 60],
                                     "duration": 3.0, "video_backend": "pyav_keyframes", "do_sample_frames": False,
                                     "keyframe_source": "index", "num_keyframes": 3})
    qs = tuple(Question(f"c{i}q{j}", f"question {j} of clip {i}" + (" TOO_LONG" if (i, j) == (1, 1) else ""),
                        tuple(f"opt {k}" for k in range(int(rng.integers(2, 6))))) for j in range(n_questions))
    return EngineClip(ClipJob(f"v{i}.mp4", f"v{i}|pyav_keyframes|3", qs), meta,
                      rng.integers(0, 256, (3, 28, 56, 3), dtype=np.uint8))


def test_a_rejected_request_alone_in_its_wave_is_an_error_row(checkpoint, fake_vllm, np_rng):
    """Wave 2 holding only the rejected question (every other clip has one question): an error row for it, answers
    for the rest, nothing raised."""
    from transformers import AutoTokenizer

    from batchjob.pipeline.vllm_engine import VllmEngine

    rng = np_rng
    llm = FakeLLM(AutoTokenizer.from_pretrained(checkpoint), rng, reject="TOO_LONG")
    engine = VllmEngine(llm, ModelConfig(checkpoint=str(checkpoint), engine="vllm"), PromptConfig())
    clips = [_clip(i, 2 if i == 1 else 1, rng) for i in range(int(rng.integers(2, 5)))]
    answers = {a.row_id: a for a in engine.answer(clips)}
    assert [len(c) for c in llm.calls] == [len(clips), 1]
    assert answers["c1q1"].choice is None and answers["c1q1"].error.startswith("vLLM rejected the request")
    assert all(a.error is None and a.choice is not None for k, a in answers.items() if k != "c1q1")


def test_requests_answers_and_waves(checkpoint, fake_vllm, np_rng):
    from transformers import AutoTokenizer

    from batchjob.pipeline.vllm_engine import VllmEngine

    rng = np_rng
    tok = AutoTokenizer.from_pretrained(checkpoint)
    llm = FakeLLM(tok, rng, reject="TOO_LONG")
    engine = VllmEngine(llm, ModelConfig(checkpoint=str(checkpoint), engine="vllm"), PromptConfig())
    clips = [_clip(i, int(rng.integers(1, 4)) if i != 1 else 2, rng) for i in range(4)]
    answers = engine.answer(clips)
    questions = [q for c in clips for q in c.job.questions]
    assert [a.row_id for a in answers] == [q.row_id for q in questions]   # in order, every question once
    # wave 1: each clip's first question; wave 2: the rest (the failing call is then retried one by one)
    assert [len(c) for c in llm.calls[:2]] == [len(clips), len(questions) - len(clips)]
    video_id = engine.prompts.video_token_id
    for call in llm.calls:
        for prompt in call:
            assert prompt["prompt_token_ids"].count(video_id) == 1      # vLLM expands the placeholder
            (frames, meta), = prompt["multi_modal_data"]["video"]
            assert set(meta) == set(VLLM_METADATA_KEYS) and meta["do_sample_frames"] is False
            assert prompt["multi_modal_uuids"]["video"][0].endswith("|pyav_keyframes|3")
    by_id = {a.row_id: a for a in answers}
    assert by_id["c1q1"].error.startswith("vLLM rejected the request: prompt too long")
    for q in questions:
        a = by_id[q.row_id]
        if q.row_id == "c1q1":
            continue
        logits = llm.logits[tuple(engine.prompts.token_ids(q.text, q.options, 1).tolist())]
        expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(a.probs, expected, atol=1e-12)
        assert a.choice == int(np.argmax(expected)) and a.cached_tokens == 7 and a.error is None
    bad = EngineClip(clips[0].job, clips[0].metadata, "not frames")
    assert all(a.error and "decoded frames" in a.error for a in engine.answer([bad]))


def test_llm_kwargs_and_checks(checkpoint, monkeypatch):
    from batchjob.pipeline import vllm_engine
    from batchjob.pipeline.vllm_engine import VllmEngine, llm_kwargs, option_probs

    kw = llm_kwargs(ModelConfig(checkpoint=str(checkpoint), engine="vllm", dtype="bfloat16", max_pixels=28 * 28 * 8,
                                vllm=VllmConfig(tensor_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=2048,
                                                enforce_eager=True, max_videos_per_prompt=2)))
    assert kw["enable_prefix_caching"] and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.5 and kw["max_model_len"] == 2048
    assert kw["enforce_eager"] and kw["limit_mm_per_prompt"] == {"video": 2, "image": 0} and kw["dtype"] == "bfloat16"
    # one bound given: the other comes from the checkpoint (28*28*4 in the tiny one's processor config)
    assert kw["mm_processor_kwargs"] == {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 8}}
    assert "max_model_len" not in llm_kwargs(ModelConfig(checkpoint="org/model", engine="vllm"))
    lp = {5: FakeLogprob(math.log(0.2)), 9: FakeLogprob(math.log(0.6)), 2: FakeLogprob(-1.0)}
    np.testing.assert_allclose(option_probs(lp, [5, 9]), [0.25, 0.75])
    with pytest.raises(KeyError):
        option_probs(lp, [5, 7])
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError, match="model.temporal_step"):
        VllmEngine.check(ModelConfig(checkpoint="c", engine="vllm", temporal_step="actual"), PromptConfig())
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"batchjob\[vllm\]"):
        VllmEngine.check(ModelConfig(checkpoint="c", engine="vllm"), PromptConfig())
