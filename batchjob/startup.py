"""Start-up, step by step: where the seconds before the first answer go.

A nightly job's start-up is paid every night, and with a 7B model it can rival the streaming itself. Each side
records consecutive steps with a `StepClock` (every step ends where the next begins, so a list adds up to the
time it covers); the driver's steps run from the process's launch to the first answer written, and the engine's
steps break its load down. Steps that overlap the driver's critical path (decoders starting) are reported apart.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.contract import StartupStep


def seconds_since_launch() -> float | None:
    """How long ago this process was started (Linux: /proc; exec keeps the start time, so the CLI's re-exec
    with the BLAS preload counts too); None where the system does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class LoadCancelled(Exception):
    """A load the job no longer needs (a refused config, nothing left to answer) stopped at a step's end."""


_thread_state = threading.local()


def cancel_marks_on(event: threading.Event | None) -> None:
    """From now on, a `StepClock.mark` on the calling thread raises LoadCancelled once `event` is set: an
    engine loading on the driver's thread stops at its next step instead of outliving the job's process."""
    _thread_state.cancel = event


class StepClock:
    """Consecutive steps: `mark(name)` closes the step that began at the previous mark (or at `origin`)."""

    def __init__(self, origin: float | None = None):
        self.origin = self._last = time.perf_counter() if origin is None else origin
        self.steps: list[StartupStep] = []

    def mark(self, name: str) -> float:
        cancel = getattr(_thread_state, "cancel", None)
        if cancel is not None and cancel.is_set():
            raise LoadCancelled(name)
        now = time.perf_counter()
        self.steps.append(StartupStep(name, now - self._last))
        self._last = now
        return now

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.steps)


@dataclass
class Startup:
    """A run's start-up: the driver's steps (summing to `total_s`, launch to first answer), the engine's load
    broken down, and what ran beside them."""
    total_s: float = 0.0
    steps: list[StartupStep] = field(default_factory=list)
    engine: list[StartupStep] = field(default_factory=list)
    overlapped: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"total_s": self.total_s, "steps": {s.name: s.seconds for s in self.steps},
                "engine_load": {s.name: s.seconds for s in self.engine}, "overlapped": dict(self.overlapped)}
