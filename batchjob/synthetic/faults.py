"""What the loopback object servers (tests, benchmarks) count and which faults they inject.

Both servers (`http_server`, `s3_server`) ask a `FaultInjector` before answering a request for an object and
report every body byte they send to a `TrafficLog`, so tests check bytes at the server side, independently of
what the client believes it fetched.
"""
from __future__ import annotations

import random
import threading
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

FAULTS = ("timeout", "5xx", "reset", "missing")   # what `rate` draws from
KINDS = FAULTS + ("denied",)                       # `denied` (403) only when injected: retries cannot cure it


@dataclass
class TrafficLog:
    """Bytes of response bodies and requests per object path (thread-safe)."""

    bytes_sent: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)          # (path, kind) -> injected
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request(self, path: str) -> None:
        with self._lock:
            self.requests[path] += 1

    def sent(self, path: str, n: int) -> None:
        with self._lock:
            self.bytes_sent[path] += n

    def fault(self, path: str, kind: str) -> None:
        with self._lock:
            self.faults[(path, kind)] += 1

    def total_bytes(self, suffix: str = "") -> int:
        with self._lock:
            return sum(n for p, n in self.bytes_sent.items() if p.endswith(suffix))

    def total_faults(self) -> Counter:
        with self._lock:
            out: Counter = Counter()
            for (_, kind), n in self.faults.items():
                out[kind] += n
            return out

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()
            self.faults.clear()


class FaultInjector:
    """Faults for object requests: queued for one path (`inject`), and/or drawn at `rate` per request.

    Kinds: `timeout` (the server stalls `stall_s` before it answers, longer than the client waits), `5xx` (503),
    `reset` (headers and half the body, then the connection is dropped), `missing` (404), `denied` (403, only
    by `inject`/`always`). `always` makes a path
    fail the same way on every request (a fault that retries cannot cure).
    """

    def __init__(self, rate: float = 0.0, kinds: tuple[str, ...] = FAULTS, seed: int = 0, stall_s: float = 2.0):
        unknown = set(kinds) - set(KINDS)
        if unknown or not 0 <= rate <= 1:
            raise ValueError(f"fault kinds {sorted(unknown)} unknown or rate {rate} outside [0, 1]")
        self.rate, self.kinds, self.stall_s = rate, tuple(kinds), stall_s
        self._rng = random.Random(seed)
        self._queued: dict[str, deque[str]] = defaultdict(deque)
        self._always: dict[str, str] = {}
        self._lock = threading.Lock()

    def inject(self, path: str, *kinds: str) -> None:
        """Faults for the next requests to `path`, in order; "ok" lets one request through (a fault mid-clip)."""
        if set(kinds) - set(KINDS) - {"ok"}:
            raise ValueError(f"unknown fault kinds {sorted(set(kinds) - set(KINDS))}")
        with self._lock:
            self._queued[path].extend(kinds)

    def always(self, path: str, kind: str) -> None:
        """Every request to `path`, or to anything under it (a bucket and its objects), fails as `kind`."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._always[path] = kind

    def draw(self, path: str, *, at_random: bool = True) -> str | None:
        """The fault for this request to `path`, if any (`at_random=False`: only faults set for the path)."""
        with self._lock:
            for prefix, kind in self._always.items():
                if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                    return kind
            if self._queued.get(path):
                kind = self._queued[path].popleft()
                return None if kind == "ok" else kind
            if at_random and self.rate and self._rng.random() < self.rate:
                return self._rng.choice(self.kinds)
            return None
