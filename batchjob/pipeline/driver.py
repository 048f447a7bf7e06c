"""The streaming driver: keeps a bounded number of clips in flight and writes answers as they arrive.

Each decoder gets one clip at a time (so a decode timeout is measured from when it really started). A
decoded clip joins the queue of one engine replica (the shortest), with all its questions: the replica that
answers a clip holds its prefix, so a clip never splits across replicas, not even when its batch is retried.
Each queue is kept as deep as the measured rates call for (`batchjob.pipeline.backpressure`), and the clips
in flight never exceed `frames_in_flight`. Each replica keeps up to two batches sent so it never idles while
the driver assembles the next one. A replica whose process dies costs the clips it held; the others carry
on. Frames (or the engine's prepared input) move decoder -> engine as ObjectRefs; the driver only sees
decode statuses and answers (the frozen dataclasses of `batchjob.contract`). It reaches the actors through
`Workers`, so tests run it without Ray.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone
from typing import Any, Callable

from batchjob.config import JobConfig
from batchjob.contract import Answer, BatchAnswers, DecodeStatus, EngineClip
from batchjob.pipeline.backpressure import Rates, may_start_decode, pick_replica, target_depth, wanted_depth
from batchjob.pipeline.slots import DecoderSlots
from batchjob.pipeline.stats import DepthSampler, RunStats, fetch_summary, median_and_p90, peak_rss_mb
from batchjob.pipeline.work import ClipWork, result_row, take_batch
from batchjob.pipeline.workers import TaskFailed, WorkerLost, Workers

__all__ = ["Driver", "NoEngineLeft", "RunStats", "DECODE_ATTEMPTS", "ENGINE_QUEUE"]

ENGINE_QUEUE = 2          # batches sent ahead to each engine replica
DECODE_ATTEMPTS = 2       # a clip whose decoder process died is retried once, on a restarted decoder


class NoEngineLeft(RuntimeError):
    """Every engine replica died: the run stops; clips never sent to an engine have no rows (a rerun resumes them).
    No `--stats-json` then: the nightly runner reads a stats file as "the run finished"."""


class Driver:
    def __init__(self, cfg: JobConfig, workers: Workers, model_id: str,
                 write: Callable[[list[dict[str, Any]]], None], stats: RunStats,
                 on_progress: Callable[[RunStats], None] | None = None, run_started_at: datetime | None = None):
        self.cfg, self.workers, self.model_id = cfg, workers, model_id
        self.write, self.stats, self.on_progress = write, stats, on_progress
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        # The run's start, for throughput in reports: the caller passes when the job began (Ray start-up
        # and model load included), so `batchjob report` shows what a user waits for.
        self.run_started_at = run_started_at or datetime.now(timezone.utc)
        self.first_row_at: float | None = None   # perf_counter when the first row was written (start-up's end)

    # -- rows ------------------------------------------------------------------------------------
    def _emit(self, clip: ClipWork, answers: dict[str, Answer], engine_ms: float | None, error: str | None) -> None:
        now = datetime.now(timezone.utc)
        rows = [result_row(r, answers.get(r.row_id), labels=self.cfg.prompt.option_labels,
                           loader=self.cfg.loader.name, num_frames=self.cfg.loader.num_frames, decode=clip.status,
                           engine_ms=engine_ms, model=self.model_id, run_id=self.run_id,
                           run_started_at=self.run_started_at, finished_at=now, error=error)
                for r in clip.rows]
        self.stats.done_rows += len(rows)
        self.stats.done_clips += 1
        self.stats.error_rows += sum(1 for r in rows if r["error"])
        self.write(rows)
        if self.first_row_at is None:
            self.first_row_at = time.perf_counter()

    # -- main loop -------------------------------------------------------------------------------
    def run(self, clips: list[ClipWork]) -> None:
        rt, workers = self.cfg.runtime, self.workers
        n_eng = workers.num_engines
        self.stats.engines, self.stats.decoders = n_eng, workers.num_decoders
        self.stats.engine_busy_s_by_replica = [0.0] * n_eng
        t_start = time.perf_counter()
        pending: deque[ClipWork] = deque(clips)
        decoding: dict[Any, tuple[ClipWork, Any, int, float]] = {}   # status ticket -> clip, payload, decoder, t0
        slots = DecoderSlots(workers)
        self.queues: list[deque[tuple[ClipWork, Any]]] = [deque() for _ in range(n_eng)]  # decoded, per replica
        engine_jobs: dict[Any, tuple[list[tuple[ClipWork, Any]], int]] = {}
        self.engine_load = [0] * n_eng                                # batches sent, per replica
        self.alive: set[int] = set(range(n_eng))
        self.rates, self.depths = Rates(), DepthSampler(n_eng)
        self._decode_ms: list[float] = []
        self._engine_ms: list[float] = []
        self._fetched: list[tuple[int, int, int]] = []               # clips read from URLs: bytes, size, retries
        self._lost: str | None = None                                # why the last replica died
        self._unsent = self._unsent_rows = 0                         # clips (rows) never sent when all died

        def in_flight() -> int:
            return (len(decoding) + sum(len(q) for q in self.queues)
                    + sum(len(b) for b, _ in engine_jobs.values()))

        try:
            while pending or decoding or any(self.queues) or engine_jobs:
                # 1. decoders: one clip each, within the memory bound and the replicas' queue targets
                slots.tick()
                target = target_depth(self.rates.decode_ms_median, self.rates.engine_clips_per_s,
                                      rt.clips_per_batch, rt.frames_in_flight, max(len(self.alive), 1))
                self.stats.queue_target = target
                self.stats.queue_target_wanted = wanted_depth(self.rates.decode_ms_median,
                                                              self.rates.engine_clips_per_s, rt.clips_per_batch)
                for d in slots.free():
                    if not pending or not may_start_decode(in_flight(), rt.frames_in_flight, len(decoding),
                                                           sum(len(q) for q in self.queues), target,
                                                           len(self.alive)):
                        break
                    clip = pending.popleft()
                    clip.attempts += 1
                    status_ticket, payload = workers.decode(d, clip.video)
                    decoding[status_ticket] = (clip, payload, d, time.monotonic())
                    slots.busy.add(d)
                if pending and slots.all_dead():
                    while pending:
                        self._emit(pending.popleft(), {}, None, "no decoder process left alive (see the Ray logs)")
                # 2. engines: full batches; a partial one only when the replica would otherwise idle
                more_coming = bool(pending or decoding)
                for e in sorted(self.alive):
                    q = self.queues[e]
                    while q and self.engine_load[e] < ENGINE_QUEUE:
                        if len(q) < rt.clips_per_batch and more_coming and self.engine_load[e] > 0:
                            break
                        self._submit(e, take_batch(q, rt.clips_per_batch), engine_jobs)
                self.depths.observe(time.perf_counter(), [len(q) for q in self.queues])
                # 3. wait for anything, then drain everything that is ready
                tickets = list(decoding) + list(engine_jobs) + list(slots.probes)
                if not tickets:          # only decoders waiting to be re-probed
                    time.sleep(0.1)
                    continue
                for ticket in workers.wait(tickets, timeout=0.5):
                    if ticket in decoding:
                        clip, payload, d, _t0 = decoding.pop(ticket)
                        if self._on_decoded(ticket, clip, payload, pending):
                            slots.died(d)
                        else:
                            slots.busy.discard(d)
                    elif ticket in slots.probes:
                        slots.on_probe(ticket)
                    else:
                        batch, e = engine_jobs.pop(ticket)
                        self.engine_load[e] -= 1
                        self._on_answered(ticket, batch, e)
                if not self.alive:
                    self._stop_dispatching(pending, decoding)
                self._kill_stuck_decoders(decoding)
                self.stats.stream_s = time.perf_counter() - t_start
                if self.on_progress:
                    self.on_progress(self.stats)
        finally:
            self.stats.stream_s = time.perf_counter() - t_start
            self._finish_stats()
        if not self.alive and self._unsent:
            unsent, rows = self._unsent, self._unsent_rows
            raise NoEngineLeft(
                f"all {n_eng} engine replica(s) died (last: {self._lost}); {unsent} clip(s) ({rows} rows) were "
                "never sent to an engine and have no rows: fix the cause (the Ray logs name it; "
                "BATCHJOB_RAY_LOGS=1 shows them, e.g. GPU out of memory: lower runtime.clips_per_batch), then "
                "rerun the same command to resume them")

    def _stop_dispatching(self, pending: deque, decoding: dict) -> None:
        """No replica left: drop every clip not sent to an engine, writing nothing for it (a rerun resumes
        it); the clips the dead replicas held still get their error rows as their batches report."""
        clips = [*pending, *(c for c, *_ in decoding.values()), *(c for q in self.queues for c, _ in q)]
        self._unsent += len(clips)
        self._unsent_rows += sum(len(c.rows) for c in clips)
        pending.clear()
        decoding.clear()
        for q in self.queues:
            q.clear()

    def _finish_stats(self) -> None:
        s = self.stats
        s.queue_depth, s.queue_depth_by_replica = self.depths.summary()
        s.decode_ms_per_clip, s.decode_ms_per_clip_p90 = median_and_p90(self._decode_ms)
        s.engine_ms_per_clip, s.engine_ms_per_clip_p90 = median_and_p90(self._engine_ms)
        fetched = fetch_summary(self._fetched)
        if fetched:
            s.fetched = {self.cfg.loader.name: fetched}
        s.dead_replicas = sorted(set(range(self.workers.num_engines)) - self.alive)
        s.peak_rss_mb = peak_rss_mb()

    def _submit(self, e: int, batch: list[tuple[ClipWork, Any]], jobs: dict) -> None:
        clips = [EngineClip(c.job, c.status.metadata) for c, _ in batch]
        ticket = self.workers.answer(e, clips, [p for _, p in batch])
        jobs[ticket] = (batch, e)
        self.engine_load[e] += 1

    def _enqueue(self, item: tuple[ClipWork, Any]) -> None:
        if not self.alive:   # the run is stopping: never sent, no row (a rerun resumes it)
            self._unsent += 1
            self._unsent_rows += len(item[0].rows)
            return
        e = pick_replica([len(q) for q in self.queues], self.engine_load, self.alive)
        self.queues[e].append(item)

    def _on_decoded(self, ticket: Any, clip: ClipWork, payload: Any, pending: deque) -> bool:
        """Route a decoded clip; True when the decoder's process died (the clip is retried once)."""
        try:
            status: DecodeStatus = self.workers.result(ticket)
        except WorkerLost as err:
            if clip.attempts < DECODE_ATTEMPTS:
                pending.appendleft(clip)   # maybe collateral of another clip's crash, or a timeout kill
                return True
            why = (f"decode timed out after {self.cfg.runtime.decode_timeout_s:g} s" if clip.timed_out
                   else f"decoder process died on this clip ({err})")
            clip.status = None
            self._emit(clip, {}, None, why)
            return True
        except TaskFailed as err:   # e.g. the frames could not be stored: this clip's loss only
            clip.status = None
            self._emit(clip, {}, None, f"decode failed: {err}")
            return False
        clip.status = status
        self.stats.decode_busy_s += status.busy_ms / 1000.0
        if status.node:
            self.stats.decode_nodes.add(status.node)
        if status.ok:
            extra = status.metadata.extra if status.metadata is not None else {}
            if "fetched_bytes" in extra:
                self._fetched.append((int(extra["fetched_bytes"]), int(extra.get("object_bytes", 0)),
                                      int(extra.get("fetch_retries", 0))))
            self._decode_ms.append(status.busy_ms)
            self.rates.decoded(status.busy_ms)
            self._enqueue((clip, payload))
        else:
            self._emit(clip, {}, None, status.error)
        return False

    def _on_answered(self, ticket: Any, batch: list[tuple[ClipWork, Any]], e: int) -> None:
        try:
            result: BatchAnswers = self.workers.result(ticket)
        except WorkerLost as err:
            # The replica's process is gone (no restart: a GPU replica would reload a whole model). Its clips
            # in flight get error rows; its queue moves to the live replicas.
            why = f"engine replica {e} died: {err}"
            if e in self.alive:
                self.alive.discard(e)
                self._lost = why
                orphans, self.queues[e] = self.queues[e], deque()
                for item in orphans:
                    self._enqueue(item)
            for clip, _ in batch:
                self._emit(clip, {}, None, why)
            return
        except TaskFailed as err:
            if len(batch) > 1:
                # Find the culprit: retry each clip alone on the same replica (the frames are still in the
                # object store, and the replica holds the clips' prefixes).
                for item in reversed(batch):
                    item[0].solo = True
                    if e in self.alive:
                        self.queues[e].appendleft(item)
                    else:                # its replica died since: another one must take it
                        self._enqueue(item)
                return
            self._emit(batch[0][0], {}, None, f"engine failed: {err}")
            return
        busy = result.engine_ms / 1000.0
        self.stats.engine_busy_s += busy
        self.stats.engine_busy_s_by_replica[e] += busy
        self.rates.answered(len(batch), busy)
        self._engine_ms.extend([result.engine_ms / len(batch)] * len(batch))
        answers = {a.row_id: a for a in result.answers}
        for clip, _ in batch:
            self._emit(clip, answers, result.engine_ms, None)

    def _kill_stuck_decoders(self, decoding: dict) -> None:
        """A decode past the timeout: kill its decoder (Ray restarts it); the clip is retried, then an error row."""
        limit = self.cfg.runtime.decode_timeout_s
        now = time.monotonic()
        for ticket, (clip, payload, d, t0) in list(decoding.items()):
            if now - t0 > limit:
                clip.attempts = max(clip.attempts, DECODE_ATTEMPTS)   # a clip that hangs once will hang again
                clip.timed_out = True
                self.workers.kill_decoder(d)
                decoding[ticket] = (clip, payload, d, float("inf"))   # kill once; the ticket then fails
