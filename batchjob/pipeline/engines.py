"""Engine registry: the seam between the pipeline and whatever answers the questions.

`model.engine` names a registered engine ("mlx") or a plugin given as `package.module:factory`, so a
site can bring its own engine (e.g. vLLM on NVIDIA servers) without patching batchjob. A factory takes
(ModelConfig, PromptConfig) and returns an object with `model_id: str` and
`answer(clips) -> list[Answer]`, where each clip is `(frames, metadata, media_id, questions)` and each
question is `(row_id, question, options)`.
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from batchjob.config import ConfigError, ModelConfig, PromptConfig
from batchjob.pipeline.work import Answer

ClipQuestions = tuple[np.ndarray, dict, str, Sequence[tuple[str, str, tuple[str, ...]]]]


class Engine(Protocol):
    model_id: str

    def answer(self, clips: Sequence[ClipQuestions]) -> list[Answer]: ...


class MlxEngine:
    """batchjob's own MLX classifier (Apple GPU, or CPU elsewhere)."""

    def __init__(self, model: ModelConfig, prompt: PromptConfig):
        from batchjob.engine import Classifier, EngineConfig

        extra: dict[str, Any] = {}
        if prompt.template is not None:
            extra["prompt_template"] = prompt.template
        cfg = EngineConfig(dtype=model.dtype, min_pixels=model.min_pixels, max_pixels=model.max_pixels,
                           max_num_batched_tokens=model.max_num_batched_tokens, max_model_len=model.max_model_len,
                           memory_budget_gb=model.memory_budget_gb, option_labels=tuple(prompt.option_labels),
                           system_prompt=prompt.system, **extra)
        self._clf = Classifier.from_pretrained(model.checkpoint, cfg)
        self.model_id = self._clf.model_id

    def answer(self, clips: Sequence[ClipQuestions]) -> list[Answer]:
        from batchjob.engine import ClassifyRequest, Clip

        requests = [ClassifyRequest(row_id, Clip(frames, meta, media_id), question, tuple(options))
                    for frames, meta, media_id, questions in clips
                    for row_id, question, options in questions]
        results = self._clf.classify(requests)
        return [Answer(r.request_id, r.choice, list(r.probs), r.prompt_tokens, r.cached_tokens, r.error)
                for r in results]


ENGINES: dict[str, Callable[[ModelConfig, PromptConfig], Engine]] = {"mlx": MlxEngine}


def resolve_engine(name: str) -> Callable[[ModelConfig, PromptConfig], Engine]:
    """The factory for `model.engine`; ConfigError naming the valid choices otherwise."""
    if name in ENGINES:
        return ENGINES[name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"model.engine: cannot import plugin engine {name!r}: {err}") from None
    raise ConfigError(f"model.engine: unknown engine {name!r}; valid: {', '.join(sorted(ENGINES))} "
                      "or a plugin 'package.module:factory'")


def timed_answer(engine: Engine, clips: Sequence[ClipQuestions]) -> tuple[list[Answer], float]:
    t0 = time.perf_counter()
    answers = engine.answer(clips)
    return answers, (time.perf_counter() - t0) * 1000.0
