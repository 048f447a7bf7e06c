"""A run's statistics: what `batchjob run` prints at the end and writes with `--stats-json`.

Besides rows and times, they say whether the engines were kept busy (busy fraction per replica, the queue of
decoded clips ahead of each replica over time) and which stage bounded the run, so a slow night can be read
from the summary alone.
"""
from __future__ import annotations

import resource
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from batchjob.startup import Startup

BUSY_ENOUGH = 0.75   # a stage busier than this (per worker, over the stream) is what bounded the run


@dataclass
class RunStats:
    total_rows: int = 0          # rows in the dataset (after limit)
    skipped_rows: int = 0        # already in the output (resume)
    edited_rows: int = 0         # answered again: their question or options were edited in the dataset
    rescored_rows: int = 0       # re-scored in place: their answer key or category was edited
    retried_rows: int = 0        # error rows answered again (--retry-errors)
    repaired_parts: list[str] = field(default_factory=list)   # damaged parts --repair moved to _damaged/
    done_rows: int = 0           # written by this run
    done_clips: int = 0          # clips whose rows this run wrote
    error_rows: int = 0
    wall_s: float = 0.0          # whole run: Ray start-up and model load included
    stream_s: float = 0.0        # the streaming phase only (first decode submitted to last row written)
    decode_busy_s: float = 0.0   # summed over decoders (decode plus input preparation)
    engine_busy_s: float = 0.0   # summed over engines
    decoders: int = 0
    engines: int = 0
    engine_gpus: float = 0.0     # Ray num_gpus per engine replica
    model: str = ""
    engine_runtime: dict[str, str] = field(default_factory=dict)  # device, dtype, attention backend
    decode_nodes: set[str] = field(default_factory=set)
    engine_busy_s_by_replica: list[float] = field(default_factory=list)
    dead_replicas: list[int] = field(default_factory=list)
    queue_depth: dict[str, float] | None = None                  # decoded clips waiting, all replicas together
    queue_depth_by_replica: list[dict[str, float] | None] = field(default_factory=list)
    queue_target: int = 0             # the last target depth per replica (from the measured rates)
    queue_target_wanted: int = 0      # the same before the frames_in_flight cap
    decode_ms_per_clip: float | None = None                       # medians over this run's clips
    decode_ms_per_clip_p90: float | None = None
    engine_ms_per_clip: float | None = None                       # a batch's engine time / its clips
    engine_ms_per_clip_p90: float | None = None
    peak_rss_mb: float = 0.0                                      # the driver process
    fetched: dict[str, dict[str, float]] = field(default_factory=dict)  # loader -> network cost of URL clips
    actor_peak_rss_mb: dict[str, list[float]] = field(default_factory=dict)   # engines, decoders (best effort)
    memory: dict[str, Any] = field(default_factory=dict)          # the engine's budget, its source, KV blocks
    startup: Startup | None = None                                # launch to first answer, step by step

    @property
    def host_peak_mb(self) -> float | None:
        """The job's processes' peak resident memory added up (driver, engines, decoders; each its own peak,
        so an upper bound on their simultaneous use); None until the actors reported."""
        if not self.actor_peak_rss_mb:
            return None
        return self.peak_rss_mb + sum(sum(v) for v in self.actor_peak_rss_mb.values())

    @property
    def rows_per_s(self) -> float:
        return self.done_rows / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def overlap_efficiency(self) -> float:
        """Wall time over the busiest stage's busy time (per worker); 1.0 means the other stage was fully hidden."""
        busiest = max(self.decode_busy_s / max(self.decoders, 1), self.engine_busy_s / max(self.engines, 1))
        return self.stream_s / busiest if busiest > 0 else float("nan")

    @property
    def gpu_busy(self) -> float | None:
        """Engine busy time over the streaming time of all replicas (1.0: no replica ever waited)."""
        if self.stream_s <= 0 or not self.engines:
            return None
        return self.engine_busy_s / (self.stream_s * self.engines)

    @property
    def engine_busy_by_replica(self) -> list[float]:
        """Each replica's busy fraction of the streaming time."""
        if self.stream_s <= 0:
            return []
        return [b / self.stream_s for b in self.engine_busy_s_by_replica]

    @property
    def bound_by(self) -> str | None:
        if self.stream_s <= 0 or not self.done_rows:
            return None
        return bound_by(self.decode_busy_s / (self.stream_s * max(self.decoders, 1)), self.gpu_busy or 0.0)

    def as_dict(self) -> dict[str, Any]:
        """Plain values for `batchjob run --stats-json` (monitoring, benchmarks)."""
        out = {k: v for k, v in vars(self).items() if k not in ("decode_nodes", "startup")}
        return {**out, "decode_nodes": sorted(self.decode_nodes), "rows_per_s": self.rows_per_s,
                "startup": self.startup.as_dict() if self.startup else None, "host_peak_mb": self.host_peak_mb,
                "overlap_efficiency": self.overlap_efficiency if self.done_rows else None,
                "gpu_busy": self.gpu_busy, "engine_busy_by_replica": self.engine_busy_by_replica,
                "bound_by": self.bound_by}


def bound_by(decode_busy: float, engine_busy: float) -> str:
    """Which stage set the pace, from each stage's busy fraction (per worker).

    The busier stage when it was busy most of the time; when neither was, both waited on something else:
    the driver (dispatch, object transfer, scheduling).
    """
    if max(decode_busy, engine_busy) < BUSY_ENOUGH:
        return "driver"
    return "engine" if engine_busy >= decode_busy else "decode"


def median_and_p90(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not len(values):
        return None, None
    arr = np.asarray(values, dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))


def fetch_summary(samples: Sequence[tuple[int, int, int]]) -> dict[str, float] | None:
    """What the clips read from URLs cost on the network, from (fetched bytes, object bytes, retried requests)
    per clip: MB per clip (median, p90), the median fraction of each file fetched, totals."""
    if not samples:
        return None
    arr = np.asarray(samples, dtype=float)
    mb, mb_p90 = median_and_p90(arr[:, 0] / 1e6)
    sized = arr[arr[:, 1] > 0]
    return {"clips": len(samples), "mb_per_clip": mb, "mb_per_clip_p90": mb_p90,
            "file_fraction": float(np.median(sized[:, 0] / sized[:, 1])) if len(sized) else None,
            "total_mb": float(arr[:, 0].sum() / 1e6), "retries": int(arr[:, 2].sum())}


def weighted_summary(durations: Counter) -> dict[str, float] | None:
    """min / median / max of a value observed over time, each value weighted by how long it held."""
    held = sorted((v, w) for v, w in durations.items() if w > 0)
    if not held:
        return None
    half, acc = sum(w for _, w in held) / 2.0, 0.0
    median = held[-1][0]
    for v, w in held:
        acc += w
        if acc >= half:
            median = v
            break
    return {"min": float(held[0][0]), "median": float(median), "max": float(held[-1][0])}


class DepthSampler:
    """The queue depth of every replica over time: each observed depth holds until the next observation."""

    def __init__(self, replicas: int):
        self.per_replica = [Counter() for _ in range(replicas)]
        self.total: Counter = Counter()
        self._last: tuple[float, tuple[int, ...]] | None = None

    def observe(self, now: float, depths: Sequence[int]) -> None:
        if self._last is not None:
            t, prev = self._last
            dt = max(now - t, 0.0)
            for r, d in enumerate(prev):
                self.per_replica[r][d] += dt
            self.total[sum(prev)] += dt
        self._last = (now, tuple(depths))

    def summary(self) -> tuple[dict[str, float] | None, list[dict[str, float] | None]]:
        return weighted_summary(self.total), [weighted_summary(c) for c in self.per_replica]


def peak_rss_mb(status_file: str = "/proc/self/status") -> float:
    """This process's own peak resident memory.

    Linux: `VmHWM`, the high-water mark of this process image. Not `ru_maxrss`: it survives fork + exec, so a
    process started by one that once held 15 GB reports 15 GB whatever it used itself. Elsewhere ru_maxrss
    (bytes on macOS), the best the system offers."""
    try:
        with open(status_file) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024   # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
