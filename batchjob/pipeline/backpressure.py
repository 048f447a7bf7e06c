"""Back-pressure between decoders and engine replicas: how deep each replica's queue of decoded clips should
be, which replica a decoded clip joins, and whether a decoder may start another clip.

Decoded clips are memory (frames or prepared inputs in the object store), so the total in flight never
exceeds `runtime.frames_in_flight`; within that, each replica's queue only needs to cover the time a decode
takes at the rate the replica answers, plus one batch. Pure functions and a small rate meter, so the rules
are tested without Ray.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Collection, Sequence

SAFETY = 1.5     # margin over the measured decode latency x engine rate (rates drift, clips differ)
WINDOW = 32      # recent clips and batches the rates are measured over


def target_depth(decode_ms: float | None, engine_clips_per_s: float | None, clips_per_batch: int,
                 frames_in_flight: int, replicas: int) -> int:
    """Decoded clips to keep queued ahead of one replica.

    Enough to cover one decode's latency at the replica's rate (with a margin), plus one batch, clamped to
    [clips_per_batch, frames_in_flight / replicas]. Before both rates are measured: two batches (a modest
    start, so the first clips reach the engine fast and memory stays small until the rates are known).
    """
    hi = max(1, frames_in_flight // max(replicas, 1))
    lo = min(clips_per_batch, hi)
    return max(lo, min(wanted_depth(decode_ms, engine_clips_per_s, clips_per_batch), hi))


def wanted_depth(decode_ms: float | None, engine_clips_per_s: float | None, clips_per_batch: int) -> int:
    """`target_depth` before the memory bound: when it is larger, frames_in_flight is what starves the engine."""
    if not decode_ms or not engine_clips_per_s:
        return 2 * clips_per_batch
    return math.ceil(decode_ms * engine_clips_per_s / 1000.0 * SAFETY) + clips_per_batch


def pick_replica(queue_lens: Sequence[int], loads: Sequence[int], alive: Collection[int]) -> int:
    """The live replica with the shortest queue; ties go to the one with the least work sent, then the lowest index."""
    if not alive:
        raise ValueError("no live engine replica")
    return min(alive, key=lambda r: (queue_lens[r], loads[r], r))


def may_start_decode(in_flight: int, frames_in_flight: int, decoding: int, queued: int, target: int,
                     live_replicas: int) -> bool:
    """A decoder may take a new clip when the memory bound allows one more clip and the live replicas' queues,
    counting the decodes already under way, are below their target depth."""
    return in_flight < frames_in_flight and decoding + queued < target * live_replicas


class Rates:
    """Recent decode latency and per-replica engine rate, for `target_depth`."""

    def __init__(self) -> None:
        self.decode_ms: deque[float] = deque(maxlen=WINDOW)
        self.batches: deque[tuple[int, float]] = deque(maxlen=WINDOW)   # (clips, engine seconds)

    def decoded(self, ms: float) -> None:
        self.decode_ms.append(ms)

    def answered(self, clips: int, engine_s: float) -> None:
        self.batches.append((clips, engine_s))

    @property
    def decode_ms_median(self) -> float | None:
        return statistics.median(self.decode_ms) if self.decode_ms else None

    @property
    def engine_clips_per_s(self) -> float | None:
        """Clips one replica answers per second of its own busy time."""
        busy = sum(s for _, s in self.batches)
        return sum(c for c, _ in self.batches) / busy if busy > 0 else None
