"""Decoder availability: which decode actors may take a clip right now."""
from __future__ import annotations

import time
from typing import Any

from batchjob.pipeline.workers import TaskFailed, WorkerLost, Workers


class DecoderSlots:
    """Which decoders may take a clip: one clip each, and none whose process just died.

    Ray restarts a dead decoder, but work sent while it restarts can fail too, so a dead decoder is
    probed (a trivial call) until it answers again; only then does it get another clip.
    """

    PROBE_FOR_S = 120.0

    def __init__(self, workers: Workers):
        self.workers = workers
        self.busy: set[int] = set()
        self.dead: set[int] = set()
        self.probes: dict[Any, tuple[int, float]] = {}      # probe ref -> decoder, first failure time
        self._retry_at: dict[int, tuple[float, float]] = {}

    def free(self) -> list[int]:
        return [d for d in range(self.workers.num_decoders) if d not in self.busy]

    def died(self, d: int, since: float | None = None) -> None:
        self.busy.add(d)
        self.probes[self.workers.probe(d)] = (d, since or time.monotonic())

    def tick(self) -> None:
        now = time.monotonic()
        for d, (at, since) in list(self._retry_at.items()):
            if now >= at:
                del self._retry_at[d]
                self.died(d, since)

    def on_probe(self, ref: Any) -> None:
        d, since = self.probes.pop(ref)
        try:
            self.workers.result(ref)
            self.busy.discard(d)
        except (WorkerLost, TaskFailed):
            if time.monotonic() - since < self.PROBE_FOR_S:
                self._retry_at[d] = (time.monotonic() + 0.5, since)
            else:
                self.dead.add(d)

    def all_dead(self) -> bool:
        return len(self.dead) == self.workers.num_decoders
