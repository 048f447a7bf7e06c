"""Counting host syncs: every place Python waits for the device inside a stretch of code.

On a GPU a sync inside a layer stalls the pipeline (the host waits, then the device waits for the host), so
the profile reports them, and tests assert that the hot paths have none. MLX syncs when a device array's
value reaches Python: `.item()`, `.tolist()`, `float()` / `int()` / `bool()` of an array, `np.array(a)` /
`np.asarray(a)` (the buffer protocol), and `mx.eval`. The counter wraps those entry points for the duration
of a `with` block and records where each call came from (file:line of the nearest caller outside MLX and
numpy). `mx.eval` at the end of a forward pass is a sync too and is counted separately (`evals`).
"""

from __future__ import annotations

import collections
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@dataclass
class SyncLog:
    """Host syncs seen in a `count_host_syncs` block."""

    sites: collections.Counter = field(default_factory=collections.Counter)   # "file:line kind" -> count
    evals: int = 0
    first_eval_s: float | None = None   # seconds from the block's start to the first mx.eval
    start: float = field(default_factory=time.perf_counter)
    in_layers: int = 0   # syncs while `inside()` was set (e.g. inside a decoder layer or a vision block)
    _depth: int = 0

    @property
    def syncs(self) -> int:
        return sum(self.sites.values())

    @contextmanager
    def inside(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def as_dict(self) -> dict:
        return {"host_syncs": self.syncs, "host_syncs_in_layers": self.in_layers, "evals": self.evals,
                "sites": dict(self.sites.most_common(10))}


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in ("/mlx/", "/numpy/", "syncs.py")):
        frame = frame.f_back
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    for root in ("/batchjob/", "/mlx_vlm/", "/scripts/", "/tests/"):
        if root in name:
            name = root.strip("/") + "/" + name.split(root, 1)[1]
            break
    return f"{name}:{frame.f_lineno}"


@contextmanager
def count_host_syncs() -> Iterator[SyncLog]:
    """Record every host sync in the block (see the module docstring); restores everything on exit."""
    import mlx.core as mx
    import numpy as np

    log = SyncLog()
    saved_methods = {name: getattr(mx.array, name) for name in _METHODS}
    saved_np = {name: getattr(np, name) for name in ("array", "asarray")}
    saved_eval = mx.eval

    def note(kind: str) -> None:
        log.sites[f"{_caller()} {kind}"] += 1
        if log._depth:
            log.in_layers += 1

    def method(name, original):
        def wrapped(self, *args, **kwargs):
            note(name)
            return original(self, *args, **kwargs)
        return wrapped

    def conversion(name, original):
        def wrapped(obj, *args, **kwargs):
            if isinstance(obj, mx.array):
                note(f"np.{name}")
            return original(obj, *args, **kwargs)
        return wrapped

    def evaluate(*args, **kwargs):
        log.evals += 1
        if log.first_eval_s is None:
            log.first_eval_s = time.perf_counter() - log.start
        return saved_eval(*args, **kwargs)

    try:
        for name, original in saved_methods.items():
            setattr(mx.array, name, method(name, original))
        for name, original in saved_np.items():
            setattr(np, name, conversion(name, original))
        mx.eval = evaluate
        yield log
    finally:
        for name, original in saved_methods.items():
            setattr(mx.array, name, original)
        for name, original in saved_np.items():
            setattr(np, name, original)
        mx.eval = saved_eval


@contextmanager
def layers_marked(log: SyncLog, layers: list) -> Iterator[None]:
    """Mark calls of each module in the list `layers` (replaced in place by a wrapper, restored on exit) as
    inside a layer, so `log.in_layers` counts the syncs a layer makes."""
    originals = list(layers)

    class Marked:
        def __init__(self, module):
            self.module = module

        def __call__(self, *args, **kwargs):
            with log.inside():
                return self.module(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.module, name)

    try:
        layers[:] = [Marked(m) for m in originals]
        yield
    finally:
        layers[:] = originals
