"""Timing device work from Python: medians, with the queue kept full the way a real forward keeps it."""
from __future__ import annotations

import time

from .ceilings import median


def ms_per_call(fn, inner: int = 10, repeats: int = 5) -> float:
    """Median milliseconds per call of `fn` (returns arrays or lists of arrays): `inner` independent calls are
    queued and evaluated with one sync, so a step is charged its device time, not a launch-and-wait round trip
    per call. The first evaluation (compilation, cuDNN graph build) is not timed."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return median(times)


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(median seconds, all runs) of `fn()` called `repeats` times; `fn` syncs itself."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times), times
