"""Ray actors: decoders (CPU, one process each) and engines (the model, loaded once per actor).

A decoder returns two objects: a small status (for the driver) and the frames, or the engine's prepared
input when the engine offers a preparer (for the engine), so they travel from the decoder's process to
the engine's through Ray's object store without passing through the driver. A decoder never raises for a
bad clip; it reports the error in the status. A decoder whose process dies (a crashing codec) is
restarted by Ray and the driver retries the clip.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from batchjob.config import ModelConfig, PromptConfig

log = logging.getLogger(__name__)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _plain(value: Any) -> Any:
    """Metadata as plain Python values, so the status stays small and engine-agnostic."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class Decoder:
    """Decodes one clip per call; with the engine's `prepare`, also turns the frames into its input."""

    def __init__(self, loader: str, num_frames: int, loader_kwargs: dict[str, Any],
                 prepare: Callable[[np.ndarray, dict], Any] | None = None):
        from batchjob.loaders import load_video  # imported here: registers the loaders in this process

        self._load = load_video
        self.loader, self.num_frames, self.kwargs = loader, num_frames, dict(loader_kwargs)
        self.node = _node_id()
        self.prepare = prepare
        if prepare is not None:
            try:
                if getattr(prepare, "runs_without_torch", False):
                    from batchjob.engine.process_setup import keep_torch_out

                    keep_torch_out()
                if hasattr(prepare, "warm_up"):
                    prepare.warm_up()
            except Exception as err:   # e.g. MLX missing on this node: ship frames, the engine prepares
                log.warning("decoder on %s: input preparation unavailable (%s: %s); sending frames",
                            self.node, type(err).__name__, err)
                self.prepare = None

    def node_id(self) -> str:
        return self.node

    def decode(self, video: str) -> tuple[dict[str, Any], Any]:
        """(status, payload): the payload is the frames, or the engine's prepared input; None on failure."""
        t0 = time.perf_counter()
        try:
            frames, meta = self._load(video, backend=self.loader, num_frames=self.num_frames, **self.kwargs)
        except Exception as err:  # LoaderError by contract; anything else is a loader bug, still one clip's loss
            return self._failed(f"decode failed: {type(err).__name__}: {err}", t0), None
        decode_ms = (time.perf_counter() - t0) * 1000.0
        meta = {k: _plain(v) for k, v in meta.items()}
        payload: Any = np.ascontiguousarray(frames)
        if self.prepare is not None:
            try:
                payload = self.prepare(payload, meta)
            except Exception as err:  # e.g. an aspect ratio the processor refuses: this clip's loss only
                return self._failed(f"preparing the frames failed: {type(err).__name__}: {err}", t0), None
        return ({"ok": True, "error": None, "decode_ms": decode_ms,
                 "busy_ms": (time.perf_counter() - t0) * 1000.0, "node": self.node, "metadata": meta,
                 "frames_indices": [int(i) for i in meta.get("frames_indices", [])]}, payload)

    def _failed(self, error: str, t0: float) -> dict[str, Any]:
        ms = (time.perf_counter() - t0) * 1000.0
        return {"ok": False, "error": error, "decode_ms": ms, "busy_ms": ms, "node": self.node}


class EngineHost:
    """Holds one engine (model weights, KV cache) for the whole job."""

    def __init__(self, model: ModelConfig, prompt: PromptConfig, cpus: float = 1.0):
        from batchjob.engine.process_setup import keep_torch_out, set_blas_threads
        from batchjob.pipeline.engines import resolve_engine

        factory = resolve_engine(model.engine)
        if getattr(factory, "runs_without_torch", False):
            keep_torch_out()
        set_blas_threads(cpus)   # the CPUs Ray reserved for this actor, no more
        self.engine = factory(model, prompt)

    def ready(self) -> str:
        return self.engine.model_id

    def runtime_info(self) -> dict[str, str]:
        """What the engine runs on (device, dtype, attention backend); {} for engines that do not say."""
        info = getattr(self.engine, "runtime_info", None)
        return dict(info()) if callable(info) else {}

    def answer(self, specs: Sequence[tuple[dict, str, Sequence[tuple[str, str, tuple[str, ...]]]]],
               *frames: np.ndarray) -> tuple[list[tuple], float]:
        """specs[i] = (metadata, media_id, questions) of the clip whose frames are frames[i].

        Frames arrive as top-level arguments so Ray resolves them here, in the engine's process.
        """
        from batchjob.pipeline.engines import timed_answer

        clips = [(f, meta, mid, qs) for f, (meta, mid, qs) in zip(frames, specs)]
        answers, ms = timed_answer(self.engine, clips)
        return [(a.row_id, a.choice, a.probs, a.prompt_tokens, a.cached_tokens, a.error) for a in answers], ms


def make_decoders(n: int, cpus: float, loader: str, num_frames: int, kwargs: dict[str, Any],
                  prepare: Callable[[np.ndarray, dict], Any] | None = None) -> list:
    import ray

    # SPREAD: on a cluster, decoders land on different nodes (that is the point of scaling out).
    # max_restarts=-1: a decoder killed by a crashing codec comes back; its clip is retried once.
    cls = ray.remote(Decoder).options(num_cpus=cpus, max_restarts=-1, max_task_retries=0,
                                      scheduling_strategy="SPREAD")
    return [cls.remote(loader, num_frames, kwargs, prepare) for _ in range(n)]


def make_engines(n: int, cpus: float, model: ModelConfig, prompt: PromptConfig) -> list:
    import ray

    cls = ray.remote(EngineHost).options(num_cpus=cpus, max_restarts=1, max_task_retries=0)
    return [cls.remote(model, prompt, cpus) for _ in range(n)]
