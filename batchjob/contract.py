"""The contract between the pipeline and any engine: what crosses a process boundary, and what an engine is.

Imports neither MLX nor torch (nor Ray), so the driver, the decode actors and the tests can use it on any
node. Everything that travels between processes is a frozen dataclass: a clip's job (its questions), its
decode status, the clip as an engine receives it, and the answers. An engine implements `Engine`; the MLX
and vLLM engines live in modules imported only where they run (see `batchjob.pipeline.engines`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:   # annotations only: the config schema never imports this module, so imports flow one way
    from batchjob.config import ModelConfig, PromptConfig

# vLLM's video metadata keys (its `VideoMetadata` accepts nothing else); our loaders' other keys travel in
# `ClipMetadata.extra` and are never handed to vLLM.
VLLM_METADATA_KEYS = ("total_num_frames", "fps", "duration", "video_backend", "frames_indices", "do_sample_frames")


@dataclass(frozen=True)
class Question:
    """One dataset row's question: the engine answers with an index into `options`."""
    row_id: str
    text: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class ClipJob:
    """One clip and every question about it: decoded once, classified in one engine call.

    `media_id` is the decoded clip's identity (file + how it was decoded): engines key prefix sharing on it.
    """
    video: str
    media_id: str
    questions: tuple[Question, ...]

    @property
    def row_ids(self) -> tuple[str, ...]:
        return tuple(q.row_id for q in self.questions)


def _plain(value: Any) -> Any:
    """numpy scalars/arrays as plain Python values (small, picklable anywhere, JSON-able)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class ClipMetadata:
    """A loader's metadata: vLLM's six standard keys, and whatever else the loader reported in `extra`."""
    total_num_frames: int | None = None
    fps: float | None = None
    duration: float | None = None
    video_backend: str | None = None
    frames_indices: tuple[int, ...] = ()
    do_sample_frames: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_loader(cls, metadata: Mapping[str, Any]) -> "ClipMetadata":
        plain = {k: _plain(v) for k, v in metadata.items()}
        std = {k: plain.pop(k) for k in VLLM_METADATA_KEYS if k in plain}
        if "frames_indices" in std:
            std["frames_indices"] = tuple(int(i) for i in std["frames_indices"])
        return cls(**std, extra=plain)

    def standard(self) -> dict[str, Any]:
        """The six keys vLLM's video metadata accepts (what an engine that hands frames to vLLM passes)."""
        out = {k: getattr(self, k) for k in VLLM_METADATA_KEYS}
        out["frames_indices"] = list(self.frames_indices)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Everything, as the loader returned it (the MLX engine's preprocessing reads this)."""
        return {**self.extra, **{k: v for k, v in self.standard().items() if v is not None}}


@dataclass(frozen=True)
class DecodeStatus:
    """What a decode actor reports to the driver (the frames travel separately, straight to the engine)."""
    node: str | None
    decode_ms: float
    busy_ms: float                       # decode plus the engine's input preparation
    metadata: ClipMetadata | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def frames_indices(self) -> list[int] | None:
        return list(self.metadata.frames_indices) if self.metadata is not None else None


@dataclass(frozen=True)
class EngineClip:
    """A decoded clip as an engine receives it. `payload` is the frames (uint8 [T, H, W, 3]) or, when the
    engine prepared its input on the decode actor (`Engine.input_preparer`), whatever that preparer made."""
    job: ClipJob
    metadata: ClipMetadata
    payload: Any = None


@dataclass(frozen=True)
class Answer:
    """What an engine returns for one question. `probs` is over the question's options only."""
    row_id: str
    choice: int | None
    probs: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "probs", tuple(float(p) for p in self.probs))


@dataclass(frozen=True)
class BatchAnswers:
    """One engine call's answers and how long the engine was busy with it."""
    answers: tuple[Answer, ...]
    engine_ms: float


@dataclass(frozen=True)
class StartupStep:
    """One step of a start-up, in the order it ran: steps of one list follow each other, so they add up."""
    name: str
    seconds: float


@dataclass(frozen=True)
class EngineDescription:
    """Who answered, for the output's metadata: engine name, model id and the settings that shaped answers.
    `startup` is the engine's load, step by step (empty when the engine does not say)."""
    engine: str
    model_id: str
    details: Mapping[str, Any] = field(default_factory=dict)
    startup: tuple[StartupStep, ...] = ()


@runtime_checkable
class InputPreparer(Protocol):
    """Turns decoded frames into an engine's input inside a decode actor (picklable; built where it runs)."""

    def warm_up(self) -> None: ...

    def __call__(self, frames: Any, metadata: ClipMetadata) -> Any: ...


@runtime_checkable
class Engine(Protocol):
    """What `model.engine` names. `load` runs in the engine actor; `input_preparer` in the driver, and the
    preparer it returns in the decode actors; `hides_torch` asks the hosting process to keep transformers
    from importing torch (the MLX engine never needs it)."""

    hides_torch: bool

    @classmethod
    def load(cls, model: "ModelConfig", prompt: "PromptConfig") -> "Engine": ...

    @classmethod
    def input_preparer(cls, model: "ModelConfig") -> InputPreparer | None: ...

    @classmethod
    def check(cls, model: "ModelConfig", prompt: "PromptConfig") -> None:
        """Before anything starts: raise `batchjob.config.ConfigError` naming the key (or the missing
        package) for settings this engine would reject at load or on every row."""

    def answer(self, clips: Sequence[EngineClip]) -> list[Answer]: ...

    def describe(self) -> EngineDescription: ...


class EngineBase:
    """Defaults for an engine plugin: constructed as `cls(model, prompt)`, frames only, no torch hiding."""

    hides_torch = False
    runs_in_driver = False   # may load and answer on a thread of the driver's process (pipeline/placement.py)
    name = "plugin"          # what `describe` reports as the engine
    model_id: str = "unknown"

    @classmethod
    def load(cls, model: "ModelConfig", prompt: "PromptConfig") -> "Engine":
        return cls(model, prompt)  # type: ignore[call-arg]

    @classmethod
    def input_preparer(cls, model: "ModelConfig") -> InputPreparer | None:
        return None

    @classmethod
    def check(cls, model: "ModelConfig", prompt: "PromptConfig") -> None:
        return None

    @classmethod
    def check_local(cls, model: "ModelConfig") -> None:
        """Before anything starts, when the engines will run on this machine (no cluster): raise ConfigError
        for settings this machine's devices cannot hold."""
        return None

    @classmethod
    def on_gpu(cls, model: "ModelConfig") -> bool:
        """Whether the engine would run on a GPU here (asked, before the load, by `engine_placement: auto`)."""
        return False

    def answer(self, clips: Sequence[EngineClip]) -> list[Answer]:
        raise NotImplementedError

    def stage(self, clips: Sequence[EngineClip]) -> None:
        """Optional: host work for clips `answer` gets next, done ahead on another thread of the engine's process
        while the current batch runs (pipeline/driver_engine.py). Must not change what `answer` returns."""
        return None

    def watch_device(self, busy: Callable[[], None]) -> None:
        """Optional, with `stage`: call `busy()` when an answer's device work is queued and its thread is about
        to wait on it, the moment when staging slows the answer least."""
        return None

    def describe(self) -> EngineDescription:
        return EngineDescription(self.name, self.model_id)


ENGINE_METHODS = ("load", "input_preparer", "check", "answer", "describe")


def missing_engine_methods(obj: Any) -> list[str]:
    """The `Engine` members `obj` lacks (a plugin check that names what to add)."""
    missing = [m for m in ENGINE_METHODS if not callable(getattr(obj, m, None))]
    if not isinstance(getattr(obj, "hides_torch", None), bool):
        missing.append("hides_torch")
    return missing
