"""The engine on one thread of the driver's process (`runtime.engine_placement`, see pipeline/placement.py).

The thread starts at launch and loads the model while the main thread checks the job, scans the output and
starts Ray and the decoders; then it answers batches one at a time, in order. Everything MLX computes happens on
that one thread (MLX's default device and streams are process state, and a model is not shared across
threads; the staging thread below only makes arrays from host data). MLX releases the GIL while the device
computes, so the driver's loop keeps dispatching decodes.
Payloads still travel decoder -> engine as ObjectRefs: a second thread resolves them (zero-copy from Ray's
object store) so the driver's loop never waits on them, and has the engine do the next batch's host work
(uploads, prompts: `Engine.stage`) while the engine's thread waits on the device for the current one.

`DriverWorkers` puts this engine behind the driver's `Workers` seam beside Ray's decoders: its tickets are
futures, and a batch that raises comes back as `TaskFailed`, as from an actor.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Hashable, Sequence

from batchjob.config import ModelConfig, PromptConfig
from batchjob.contract import BatchAnswers, EngineClip, EngineDescription
from batchjob.pipeline.workers import RayWorkers, TaskFailed, _first_line

POLL_S = 0.005          # how often the driver looks at the engine's futures while it waits on Ray's objects
CLOSE_WAIT_S = 30.0     # a batch (or a load step) still running when the job ends


class DriverEngine:
    """Loads the engine on its own thread at once; `description()` waits for the load, `submit` queues a batch."""

    hosted = False   # set once any engine loaded in this process: the CLI then ends it with os._exit

    def __init__(self, model: ModelConfig, prompt: PromptConfig, *, cpus: float = 1.0,
                 process_wide: bool = False, resolve: Callable[[list], list] | None = None):
        """`resolve` turns the payload handles into payloads on the staging thread (default: `ray.get`)."""
        self._resolve = resolve
        self.started = time.perf_counter()
        self.ready_at: float | None = None        # perf_counter when the load finished
        self._ready: Future[EngineDescription] = Future()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(model, prompt, cpus, process_wide, time.time()),
                                        name="batchjob-engine", daemon=True)
        DriverEngine.hosted = True
        self._thread.start()

    # -- the engine's thread ---------------------------------------------------------------------------
    def _serve(self, model: ModelConfig, prompt: PromptConfig, cpus: float, process_wide: bool,
               created_at: float) -> None:
        from batchjob.pipeline.actors import EngineHost
        from batchjob.startup import cancel_marks_on

        cancel_marks_on(self._cancel)
        try:
            host = EngineHost(model, prompt, cpus, created_at, process_wide=process_wide, first_step="thread_start")
            description = host.describe()
        except BaseException as err:   # LoadCancelled included: whoever waits learns why
            self._ready.set_exception(err)
            return
        self.ready_at = time.perf_counter()
        self._ready.set_result(description)
        if self._resolve is None:
            import ray

            self._resolve = ray.get
        staged: queue.Queue = queue.Queue(maxsize=1)
        turn = threading.Event()
        stager = threading.Thread(target=self._stage_batches, args=(host, staged, turn, host.watch_device(turn.set)),
                                  name="batchjob-engine-stage", daemon=True)
        stager.start()
        self._answer_batches(host, staged, turn)

    def _stage_batches(self, host, staged: queue.Queue, turn: threading.Event, stages: bool) -> None:
        """The staging thread: takes the batches in order and resolves their payloads; where the engine stages,
        waits for `turn` and has it do the batch's host work ahead (`EngineHost.stage`). `turn` is set when the
        running batch's device work is queued and the engine's thread waits on it, or when that thread is idle;
        it is cleared as a batch starts, and by this thread as it takes its turn."""
        while True:
            job = self._jobs.get()
            if job is None:
                staged.put(None)
                return
            future, clips, refs = job
            try:
                payloads = self._resolve(list(refs)) if refs else []
            except BaseException as err:
                staged.put((future, clips, None, err))
                continue
            if stages and not future.cancelled():
                turn.wait()
                turn.clear()
                host.stage(clips, *payloads)
            staged.put((future, clips, payloads, None))

    def _answer_batches(self, host, staged: queue.Queue, turn: threading.Event) -> None:
        while True:
            turn.clear()            # this batch's host work comes first: staging waits for its device work
            try:
                job = staged.get_nowait()
            except queue.Empty:
                turn.set()          # idle: the next batch may be staged at once
                job = staged.get()
            if job is None:
                return
            future, clips, payloads, error = job
            if not future.set_running_or_notify_cancel():
                continue
            if error is not None:
                future.set_exception(error)
                continue
            try:
                future.set_result(host.answer(clips, *payloads))
            except BaseException as err:
                future.set_exception(err)

    # -- the driver's side -----------------------------------------------------------------------------
    def description(self) -> EngineDescription:
        """The loaded engine's description (waits for the load); re-raises the load's error."""
        return self._ready.result()

    def submit(self, clips: Sequence[EngineClip], payload_refs: Sequence[Any]) -> Future:
        future: Future[BatchAnswers] = Future()
        self._jobs.put((future, list(clips), list(payload_refs)))
        return future

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the thread: a load still running stops at its next step, a batch being answered finishes.
        Waits (bounded) so the process never exits with the device busy under a live thread."""
        self._cancel.set()
        self._jobs.put(None)
        self._thread.join(wait_s)


class DriverWorkers(RayWorkers):
    """Ray's decoder actors and the driver's own engine behind one `Workers` seam (engine tickets are futures)."""

    def __init__(self, decoders: list, engine: DriverEngine):
        super().__init__(decoders, [])
        self.engine, self.num_engines = engine, 1

    def answer(self, engine: int, clips: Sequence[EngineClip], payloads: Sequence[Any]) -> Hashable:
        return self.engine.submit(clips, payloads)

    def wait(self, tickets: Sequence[Hashable], timeout: float) -> list[Hashable]:
        futures = [t for t in tickets if isinstance(t, Future)]
        refs = [t for t in tickets if not isinstance(t, Future)]
        if not futures:
            return super().wait(refs, timeout) if refs else []
        deadline = time.monotonic() + timeout
        while True:
            done = [f for f in futures if f.done()]
            if done:
                return done + (super().wait(refs, 0) if refs else [])
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if not refs:
                wait_futures(futures, timeout=left, return_when=FIRST_COMPLETED)
                continue
            ready = super().wait(refs, min(left, POLL_S))
            if ready:
                return ready + [f for f in futures if f.done()]

    def result(self, ticket: Hashable) -> Any:
        if not isinstance(ticket, Future):
            return super().result(ticket)
        try:
            return ticket.result()
        except Exception as err:   # the batch raised in the engine: as an actor's task error would say it
            raise TaskFailed(f"{type(err).__name__}: {_first_line(err)}") from None
