"""scripts/benchlib/cupti.py: the GPU's idle time inside each marked call, charged to the innermost host phase
running then, against a brute-force count over a microsecond grid of random synthetic traces."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib.cupti import idle_by_phase  # noqa: E402


def _trace(tmp_path, calls, phases, kernels) -> Path:
    events = [{"cat": "user_annotation", "name": "call", "ts": a, "dur": b - a} for a, b in calls]
    events += [{"cat": "user_annotation", "name": n, "ts": a, "dur": b - a} for a, b, n in phases]
    events += [{"cat": c, "name": "k", "ts": a, "dur": b - a} for a, b, c in kernels]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _brute(call, phases, kernels) -> tuple[float, dict]:
    """Busy and idle microseconds by innermost phase, one microsecond at a time."""
    lo, hi = call
    busy, idle = 0, {}
    for t in range(lo, hi):
        if any(a <= t < b for a, b, _ in kernels):
            busy += 1
            continue
        active = [p for p in phases if p[0] <= t < p[1]]
        name = max(active, key=lambda p: (p[0], -p[1], p[2]))[2] if active else "outside phases"   # innermost
        idle[name] = idle.get(name, 0) + 1
    return busy, idle


def test_idle_time_is_charged_to_the_innermost_phase(tmp_path):
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for trial in range(20):
        calls, phases, kernels, start = [], [], [], 0
        for _ in range(int(rng.integers(1, 4))):
            lo = start + int(rng.integers(0, 50))
            hi = lo + int(rng.integers(200, 600))
            calls.append((lo, hi))
            for _ in range(int(rng.integers(1, 5))):   # phases, some nested in others
                a = int(rng.integers(lo, hi - 10))
                b = int(rng.integers(a + 1, min(hi, a + 200) + 1))
                phases.append((a, b, str(rng.choice(["prepare", "forward", "schedule"]))))
                if rng.random() < 0.5:
                    c = int(rng.integers(a, b))
                    phases.append((c, int(rng.integers(c + 1, b + 1)), "inner"))
            for _ in range(int(rng.integers(0, 8))):   # kernels, overlapping one another and the call's edges
                a = int(rng.integers(lo - 20, hi))
                kernels.append((a, a + int(rng.integers(1, 80)), str(rng.choice(["kernel", "gpu_memcpy"]))))
            start = hi
        rows = idle_by_phase(_trace(tmp_path, calls, phases, kernels), min_gap_us=0)
        assert len(rows) == len(calls)
        for row, call in zip(rows, calls):
            busy, idle = _brute(call, phases, kernels)
            assert abs(row["gpu_busy_ms"] * 1e3 - busy) < 1e-6, trial
            assert {k: round(v / 1e3, 3) for k, v in idle.items()} == row["idle_ms"], trial
            assert abs(row["wall_ms"] * 1e3 - (call[1] - call[0])) < 1e-6


def test_gaps_shorter_than_the_threshold_are_not_idle(tmp_path):
    kernels = [(0, 100, "kernel"), (110, 200, "kernel"), (300, 400, "kernel")]   # gaps of 10 and 100 us
    rows = idle_by_phase(_trace(tmp_path, [(0, 400)], [(0, 400, "forward")], kernels), min_gap_us=20)
    assert rows[0]["idle_ms"] == {"forward": 0.1} and abs(rows[0]["gpu_busy_ms"] - 0.29) < 1e-9


def _idle_runs(call, kernels) -> list[tuple[int, int]]:
    """Maximal runs of microseconds inside `call` with no kernel running, one microsecond at a time."""
    runs, start = [], None
    for t in range(*call):
        idle = not any(a <= t < b for a, b, _ in kernels)
        if idle and start is None:
            start = t
        if not idle and start is not None:
            runs.append((start, t))
            start = None
    return runs + ([(start, call[1])] if start is not None else [])


def test_the_timeline_lists_the_long_gaps_and_the_costliest_kernels(tmp_path):
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    for trial in range(20):
        lo, hi = int(rng.integers(0, 100)), int(rng.integers(600, 900))
        kernels, names = [], ["gemm", "norm", "copy", "rope"]
        for _ in range(int(rng.integers(0, 12))):
            a = int(rng.integers(lo - 30, hi))
            kernels.append((a, a + int(rng.integers(1, 90)), "kernel"))
        named = [(a, b, str(rng.choice(names))) for a, b, _ in kernels]
        api = []   # host calls into CUDA, overlapping one another, the kernels and the call's edges
        for _ in range(int(rng.integers(0, 10))):
            a = int(rng.integers(lo - 50, hi))
            api.append((a, a + int(rng.integers(1, 120)), str(rng.choice(["cudaFree", "cuStreamSynchronize",
                                                                           "cudaLaunchKernel"]))))
        events = [{"cat": "user_annotation", "name": "call", "ts": lo, "dur": hi - lo}]
        events += [{"cat": str(rng.choice(["cuda_runtime", "cuda_driver"])), "name": n, "ts": a, "dur": b - a}
                   for a, b, n in api]
        events += [{"cat": "kernel", "name": n, "ts": a, "dur": b - a, "args": {"grid": [b - a, 1, 1]}}
                   for a, b, n in named]
        path = tmp_path / "trace.json"
        path.write_text(json.dumps({"traceEvents": events}))
        threshold = int(rng.integers(1, 60))
        (row,) = idle_by_phase(path, min_gap_us=0, kernels=2, timeline_gap_us=threshold)
        runs = [(a, b) for a, b in _idle_runs((lo, hi), kernels) if b - a >= threshold]
        assert [(g["at_ms"], g["ms"]) for g in row["gaps"]] == [(round((a - lo) / 1e3, 2), round((b - a) / 1e3, 2))
                                                                for a, b in runs], trial
        for gap, (a, b) in zip(row["gaps"], runs):   # microseconds of each call's name inside the gap, 50 or more
            inside: dict[str, int] = {}
            for t in range(a, b):
                for c, d, n in api:
                    inside[n] = inside.get(n, 0) + (c <= t < d)
            kept = sorted(((us, n) for n, us in inside.items() if us >= 50), key=lambda t: (-t[0], t[1]))[:4]
            assert gap["api_calls"] == {n: round(us / 1e3, 3) for us, n in kept}, trial
        totals: dict[str, list] = {}
        for a, b, n in named:
            if lo <= a < hi:   # a kernel counts for the call it starts in
                t = totals.setdefault(n, [0, 0, []])
                t[0], t[1], t[2] = t[0] + 1, t[1] + b - a, max(t[2], [b - a, 1, 1])
        top = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:2]   # ties drawn often
        assert {n: (c, round(us / 1e3, 3)) for n, (c, us, _) in top} == \
            {n: (k["count"], k["ms"]) for n, k in row["kernels"].items()}, trial
        assert all(row["kernels"][n]["grid"] == g for n, (_, _, g) in top)
