"""Engine registry: the seam between the pipeline and whatever answers the questions.

`model.engine` names a registered engine ("mlx") or a plugin given as `package.module:factory`, so a
site can bring its own engine (e.g. vLLM on NVIDIA servers) without patching batchjob. A factory takes
(ModelConfig, PromptConfig) and returns an object with `model_id: str` and
`answer(clips) -> list[Answer]`, where each clip is `(frames, metadata, media_id, questions)` and each
question is `(row_id, question, options)`.

A factory may also offer `clip_preparer(model) -> callable | None`: a picklable `(frames, metadata) -> payload`
that decode workers apply before shipping, so the CPU-heavy part of input preparation runs in parallel
across decoders instead of serially in the engine's process; the payload then replaces the frames.
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


class MlxClipPreparer:
    """Resize + normalize + patchify a clip (the checkpoint's own processor) inside a decode worker.

    In the engine's process this took about half of the engine's time per clip on the tiny benchmark model
    (28 ms of preprocessing against 15 ms of vision tower); in the decoders it runs beside other clips.
    """

    runs_without_torch = True   # a decoder hosting it hides torch from transformers (2 s less start-up)

    def __init__(self, settings):
        self.settings = settings
        self._processor = None

    def warm_up(self) -> None:
        """Import transformers and build the processor now (at actor start, beside the model load)."""
        from batchjob.engine.preprocess import image_processor

        self._processor = image_processor(self.settings)

    def __call__(self, frames: np.ndarray, metadata: dict):
        from batchjob.engine.preprocess import preprocess_video

        if self._processor is None:
            self.warm_up()
        return preprocess_video(frames, metadata, self.settings, self._processor)

    def __getstate__(self) -> dict:
        return {"settings": self.settings, "_processor": None}   # the processor is rebuilt where it runs


class MlxEngine:
    """batchjob's own MLX classifier (Apple GPU, or CPU elsewhere)."""

    runs_without_torch = True   # its actor hides torch from transformers (see batchjob.engine.process_setup)

    @staticmethod
    def clip_preparer(model: ModelConfig) -> MlxClipPreparer | None:
        """Decoder-side preparation from the checkpoint's processor settings; None (the engine prepares
        clips itself) when the checkpoint is a hub id not on disk yet or its settings are unreadable: the
        engine's own load then reports the problem."""
        from pathlib import Path

        from batchjob.engine.preprocess import load_vision_settings
        from batchjob.engine.types import EngineError

        path = Path(model.checkpoint).expanduser()
        if not path.is_dir():
            return None
        try:
            return MlxClipPreparer(load_vision_settings(path, model.min_pixels, model.max_pixels, model.temporal_step))
        except EngineError:
            return None

    def __init__(self, model: ModelConfig, prompt: PromptConfig):
        from batchjob.engine import Classifier, EngineConfig

        extra: dict[str, Any] = {}
        if prompt.template is not None:
            extra["prompt_template"] = prompt.template
        cfg = EngineConfig(dtype=model.dtype, device=model.device, min_pixels=model.min_pixels,
                           max_pixels=model.max_pixels,
                           max_num_batched_tokens=model.max_num_batched_tokens, max_model_len=model.max_model_len,
                           memory_budget_gb=model.memory_budget_gb, temporal_step=model.temporal_step,
                           option_labels=tuple(prompt.option_labels),
                           system_prompt=prompt.system, **extra)
        self._clf = Classifier.from_pretrained(model.checkpoint, cfg)
        self.model_id = self._clf.model_id

    def runtime_info(self) -> dict[str, str]:
        """Device, dtype and attention backend the engine chose (run summary, Parquet metadata)."""
        return self._clf.runtime.as_dict()

    def answer(self, clips: Sequence[ClipQuestions]) -> list[Answer]:
        from batchjob.engine import ClassifyRequest, Clip, VideoInputs

        def clip(payload, meta: dict, media_id: str) -> Clip:
            if isinstance(payload, VideoInputs):
                return Clip(None, meta, media_id, inputs=payload)
            return Clip(payload, meta, media_id)

        requests = [ClassifyRequest(row_id, clip(payload, meta, media_id), question, tuple(options))
                    for payload, meta, media_id, questions in clips
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


def clip_preparer(model: ModelConfig) -> Callable[[np.ndarray, dict], Any] | None:
    """The engine's decoder-side preparation for this model, if it offers one."""
    offer = getattr(resolve_engine(model.engine), "clip_preparer", None)
    return offer(model) if offer else None


def timed_answer(engine: Engine, clips: Sequence[ClipQuestions]) -> tuple[list[Answer], float]:
    t0 = time.perf_counter()
    answers = engine.answer(clips)
    return answers, (time.perf_counter() - t0) * 1000.0
