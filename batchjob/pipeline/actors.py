"""Ray actors: decoders (CPU, one process each) and engines (the model, loaded once per actor).

A decoder returns two objects: a small `DecodeStatus` (for the driver) and the frames, or the engine's
prepared input when the engine offers an input preparer (for the engine), so they travel from the decoder's
process to the engine's through Ray's object store without passing through the driver. A decoder never
raises for a bad clip; it reports the error in the status. A decoder whose process dies (a crashing codec)
is restarted by Ray and the driver retries the clip. Neither actor imports an engine's framework until it
runs: the engine actor imports the configured engine's module, the decoder only what its preparer needs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from batchjob.config import ModelConfig, PromptConfig
from batchjob.contract import (BatchAnswers, ClipMetadata, DecodeStatus, EngineBase, EngineClip, EngineDescription,
                               InputPreparer, StartupStep)

if TYPE_CHECKING:
    from batchjob.loaders.transport import RemoteOptions

log = logging.getLogger(__name__)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class Decoder:
    """Decodes one clip per call; with the engine's input preparer, also turns the frames into its input.

    A decoder needs numpy and PyAV, nothing heavier: the MLX engine's preparer resizes with exact banded
    matrix products on numpy's BLAS and cuts patches of bytes (`engine/resize.py`, `engine/patchify.py`), so
    a decoder imports neither torch nor transformers, each of which cost every decoder process memory and
    seconds of start-up."""

    def __init__(self, loader: str, num_frames: int, loader_kwargs: dict[str, Any],
                 prepare: InputPreparer | None = None, remote: RemoteOptions | None = None):
        # A decoder holds no Ray GPU, and Ray leaves CUDA_VISIBLE_DEVICES alone for such workers: hide the
        # GPUs so no library opens a CUDA context (hundreds of MB each) on the engines' devices.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from batchjob.loaders import load_video  # imported here: registers the loaders in this process

        self._load = load_video
        self.loader, self.num_frames, self.kwargs = loader, num_frames, dict(loader_kwargs)
        self.remote = remote   # how clips named by URLs are read (retries, timeouts, the clip's I/O budget)
        self.node = _node_id()
        self.prepare = prepare
        if prepare is not None:
            try:
                prepare.warm_up()
            except Exception as err:   # e.g. MLX missing on this node: ship frames, the engine prepares
                log.warning("decoder on %s: input preparation unavailable (%s: %s); sending frames",
                            self.node, type(err).__name__, err)
                self.prepare = None
        self.ready_at = time.time()   # wall clock: the driver compares it with its own launch time

    def node_id(self) -> str:
        return self.node

    def ready_time(self) -> float:
        return self.ready_at

    def peak_rss_mb(self) -> float:
        from batchjob.pipeline.stats import peak_rss_mb

        return peak_rss_mb()

    def decode(self, video: str) -> tuple[DecodeStatus, Any]:
        """(status, payload): the payload is the frames, or the engine's prepared input; None on failure."""
        t0 = time.perf_counter()
        try:
            frames, meta = self._load(video, backend=self.loader, num_frames=self.num_frames, remote=self.remote,
                                      **self.kwargs)
        except Exception as err:  # LoaderError by contract; anything else is a loader bug, still one clip's loss
            return self._failed(f"decode failed: {type(err).__name__}: {err}", t0), None
        decode_ms = (time.perf_counter() - t0) * 1000.0
        metadata = ClipMetadata.from_loader(meta)
        payload: Any = np.ascontiguousarray(frames)
        if self.prepare is not None:
            try:
                payload = self.prepare(payload, metadata)
            except Exception as err:  # e.g. an aspect ratio the processor refuses: this clip's loss only
                return self._failed(f"preparing the frames failed: {type(err).__name__}: {err}", t0), None
        return DecodeStatus(node=self.node, decode_ms=decode_ms, busy_ms=(time.perf_counter() - t0) * 1000.0,
                            metadata=metadata), payload

    def _failed(self, error: str, t0: float) -> DecodeStatus:
        ms = (time.perf_counter() - t0) * 1000.0
        return DecodeStatus(node=self.node, decode_ms=ms, busy_ms=ms, error=error)


class EngineHost:
    """Holds one engine (model weights, KV cache) for the whole job."""

    def __init__(self, model: ModelConfig, prompt: PromptConfig, cpus: float = 1.0, created_at: float | None = None,
                 *, process_wide: bool = True, first_step: str = "actor_process"):
        """`process_wide`: this process is the engine's to configure (torch hidden, BLAS threads capped); an
        engine on a thread of a caller's process leaves both alone. `first_step` names the wait between
        `created_at` and the host's start (the actor's process start)."""
        entered = time.time()
        t0 = time.perf_counter()
        from batchjob.engine.process_setup import keep_torch_out, set_blas_threads
        from batchjob.pipeline.engines import resolve_engine

        engine_cls = resolve_engine(model.engine)
        if process_wide:
            if engine_cls.hides_torch:
                keep_torch_out()
            set_blas_threads(cpus)   # the CPUs Ray reserved for this actor, no more
        t1 = time.perf_counter()
        self.engine = engine_cls.load(model, prompt)
        self._host_steps = (StartupStep(first_step, max(0.0, entered - created_at) if created_at else 0.0),
                            StartupStep("engine_module", t1 - t0))
        self._load_s = time.perf_counter() - t1

    def describe(self) -> EngineDescription:
        """The engine's own description, its start-up completed with the host's steps (the process start and
        the engine module's import) and whatever of its load the engine did not itemise."""
        d = self.engine.describe()
        itemised = sum(s.seconds for s in d.startup)
        rest = (StartupStep("load_other", self._load_s - itemised),) if d.startup else (
            StartupStep("load", self._load_s),)
        return dataclasses.replace(d, startup=(*self._host_steps, *d.startup, *rest))

    def peak_rss_mb(self) -> float:
        from batchjob.pipeline.stats import peak_rss_mb

        return peak_rss_mb()

    def watch_device(self, busy: Callable[[], None]) -> bool:
        """Hand the engine `busy` (`Engine.watch_device`); True when it stages batches ahead (`Engine.stage`)."""
        stage = getattr(type(self.engine), "stage", None)
        if stage is None or stage is EngineBase.stage or not callable(getattr(self.engine, "watch_device", None)):
            return False
        self.engine.watch_device(busy)
        return True

    def stage(self, clips: Sequence[EngineClip], *payloads: Any) -> None:
        """The engine's host work for a batch it answers next (`Engine.stage`), on the caller's thread. Never
        raises: what fails here, `answer` meets again and reports."""
        try:
            self.engine.stage([dataclasses.replace(c, payload=p) for c, p in zip(clips, payloads)])
        except Exception as err:
            log.debug("staging a batch failed (answer redoes it): %s", err)

    def answer(self, clips: Sequence[EngineClip], *payloads: Any) -> BatchAnswers:
        """clips[i] is answered from payloads[i]; payloads arrive as top-level arguments so Ray resolves
        them here, in the engine's process."""
        t0 = time.perf_counter()
        answers = self.engine.answer([dataclasses.replace(c, payload=p) for c, p in zip(clips, payloads)])
        return BatchAnswers(tuple(answers), (time.perf_counter() - t0) * 1000.0)


def make_decoders(n: int, cpus: float, loader: str, num_frames: int, kwargs: dict[str, Any],
                  prepare: InputPreparer | None = None, remote: RemoteOptions | None = None) -> list:
    import ray

    # SPREAD: on a cluster, decoders land on different nodes (that is the point of scaling out).
    # max_restarts=-1: a decoder killed by a crashing codec comes back; its clip is retried once.
    cls = ray.remote(Decoder).options(num_cpus=cpus, max_restarts=-1, max_task_retries=0,
                                      scheduling_strategy="SPREAD")
    return [cls.remote(loader, num_frames, kwargs, prepare, remote) for _ in range(n)]


def make_engines(n: int, cpus: float, model: ModelConfig, prompt: PromptConfig, gpus: float = 0.0) -> list:
    import ray

    # num_gpus: Ray gives each replica its own GPU(s) through CUDA_VISIBLE_DEVICES.
    # max_restarts=0: a replica whose process died stays dead; the driver fails only the clips it held and
    # goes on with the others (a restart would reload the whole model, and a clip that killed it may again).
    cls = ray.remote(EngineHost).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_task_retries=0)
    return [cls.remote(model, prompt, cpus, time.time()) for _ in range(n)]
