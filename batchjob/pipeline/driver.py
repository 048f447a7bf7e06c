"""The streaming driver: keeps a bounded number of clips in flight and writes answers as they arrive.

Each decoder gets one clip at a time (so a decode timeout is measured from when it really started),
decoded clips wait in a queue bounded by `frames_in_flight`, and each engine keeps up to two batches
queued so it never idles while the driver assembles the next one. Frames (or the engine's prepared
input) move decoder -> engine as ObjectRefs; the driver only sees decode statuses and answers (the frozen
dataclasses of `batchjob.contract`). It reaches the actors through `Workers`, so tests run it without Ray.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from batchjob.config import JobConfig
from batchjob.contract import Answer, BatchAnswers, DecodeStatus, EngineClip
from batchjob.pipeline.slots import DecoderSlots
from batchjob.pipeline.work import ClipWork, result_row, take_batch
from batchjob.pipeline.workers import TaskFailed, WorkerLost, Workers

ENGINE_QUEUE = 2          # batches queued per engine actor
DECODE_ATTEMPTS = 2       # a clip whose decoder process died is retried once, on a restarted decoder


@dataclass
class RunStats:
    total_rows: int = 0          # rows in the dataset (after limit)
    skipped_rows: int = 0        # already in the output (resume)
    done_rows: int = 0           # written by this run
    error_rows: int = 0
    wall_s: float = 0.0          # whole run: Ray start-up and model load included
    stream_s: float = 0.0        # the streaming phase only (first decode submitted to last row written)
    decode_busy_s: float = 0.0   # summed over decoders (decode plus input preparation)
    engine_busy_s: float = 0.0   # summed over engines
    decoders: int = 0
    engines: int = 0
    model: str = ""
    engine_runtime: dict[str, str] = field(default_factory=dict)  # device, dtype, attention backend
    decode_nodes: set[str] = field(default_factory=set)

    @property
    def rows_per_s(self) -> float:
        return self.done_rows / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain values for `batchjob run --stats-json` (monitoring, benchmarks)."""
        out = {k: v for k, v in vars(self).items() if k != "decode_nodes"}
        return {**out, "decode_nodes": sorted(self.decode_nodes), "rows_per_s": self.rows_per_s,
                "overlap_efficiency": self.overlap_efficiency if self.done_rows else None}

    @property
    def overlap_efficiency(self) -> float:
        """Wall time over the busiest stage's busy time (per worker); 1.0 means the other stage was fully hidden."""
        busiest = max(self.decode_busy_s / max(self.decoders, 1), self.engine_busy_s / max(self.engines, 1))
        return self.stream_s / busiest if busiest > 0 else float("nan")


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

    # -- rows ------------------------------------------------------------------------------------
    def _emit(self, clip: ClipWork, answers: dict[str, Answer], engine_ms: float | None, error: str | None) -> None:
        now = datetime.now(timezone.utc)
        rows = [result_row(r, answers.get(r.row_id), labels=self.cfg.prompt.option_labels,
                           loader=self.cfg.loader.name, num_frames=self.cfg.loader.num_frames, decode=clip.status,
                           engine_ms=engine_ms, model=self.model_id, run_id=self.run_id,
                           run_started_at=self.run_started_at, finished_at=now, error=error)
                for r in clip.rows]
        self.stats.done_rows += len(rows)
        self.stats.error_rows += sum(1 for r in rows if r["error"])
        self.write(rows)

    # -- main loop -------------------------------------------------------------------------------
    def run(self, clips: list[ClipWork]) -> None:
        rt, workers = self.cfg.runtime, self.workers
        t_start = time.perf_counter()
        pending: deque[ClipWork] = deque(clips)
        decoding: dict[Any, tuple[ClipWork, Any, int, float]] = {}   # status ticket -> clip, payload, decoder, t0
        slots = DecoderSlots(workers)
        decoded: deque[tuple[ClipWork, Any]] = deque()               # waiting for an engine
        engine_jobs: dict[Any, tuple[list[tuple[ClipWork, Any]], int]] = {}
        engine_load = [0] * workers.num_engines

        def in_flight() -> int:
            return len(decoding) + len(decoded) + sum(len(b) for b, _ in engine_jobs.values())

        while pending or decoding or decoded or engine_jobs:
            # 1. decoders: one clip each, bounded by the clips in flight
            slots.tick()
            for d in slots.free():
                if not pending or in_flight() >= rt.frames_in_flight:
                    break
                clip = pending.popleft()
                clip.attempts += 1
                status_ticket, payload = workers.decode(d, clip.video)
                decoding[status_ticket] = (clip, payload, d, time.monotonic())
                slots.busy.add(d)
            if pending and slots.all_dead():
                while pending:
                    self._emit(pending.popleft(), {}, None, "no decoder process left alive (see the Ray logs)")
            # 2. engines: full batches; a partial one only when the engine would otherwise idle
            for e in range(workers.num_engines):
                while decoded and engine_load[e] < ENGINE_QUEUE:
                    more_coming = bool(pending or decoding)
                    if len(decoded) < rt.clips_per_batch and more_coming and engine_load[e] > 0:
                        break
                    batch = take_batch(decoded, rt.clips_per_batch)
                    self._submit(e, batch, engine_jobs, engine_load)
            # 3. wait for anything, then drain everything that is ready
            tickets = list(decoding) + list(engine_jobs) + list(slots.probes)
            if not tickets:          # only decoders waiting to be re-probed
                time.sleep(0.1)
                continue
            for ticket in workers.wait(tickets, timeout=0.5):
                if ticket in decoding:
                    clip, payload, d, _t0 = decoding.pop(ticket)
                    if self._on_decoded(ticket, clip, payload, pending, decoded):
                        slots.died(d)
                    else:
                        slots.busy.discard(d)
                elif ticket in slots.probes:
                    slots.on_probe(ticket)
                else:
                    batch, e = engine_jobs.pop(ticket)
                    engine_load[e] -= 1
                    self._on_answered(ticket, batch, decoded)
            self._kill_stuck_decoders(decoding)
            self.stats.stream_s = time.perf_counter() - t_start
            if self.on_progress:
                self.on_progress(self.stats)

    def _submit(self, e: int, batch: list[tuple[ClipWork, Any]], jobs: dict, load: list[int]) -> None:
        clips = [EngineClip(c.job, c.status.metadata) for c, _ in batch]
        ticket = self.workers.answer(e, clips, [p for _, p in batch])
        jobs[ticket] = (batch, e)
        load[e] += 1

    def _on_decoded(self, ticket: Any, clip: ClipWork, payload: Any, pending: deque, decoded: deque) -> bool:
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
            decoded.append((clip, payload))
        else:
            self._emit(clip, {}, None, status.error)
        return False

    def _on_answered(self, ticket: Any, batch: list[tuple[ClipWork, Any]], decoded: deque) -> None:
        try:
            result: BatchAnswers = self.workers.result(ticket)
        except (TaskFailed, WorkerLost) as err:
            if len(batch) > 1:
                # Find the culprit: retry each clip alone (the frames are still in the object store).
                for item in reversed(batch):
                    item[0].solo = True
                    decoded.appendleft(item)
                return
            clip, _ = batch[0]
            why = str(err) if isinstance(err, TaskFailed) else f"engine process died ({err})"
            self._emit(clip, {}, None, f"engine failed: {why}")
            return
        self.stats.engine_busy_s += result.engine_ms / 1000.0
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
