"""What the GPU did while a block of code ran, from torch.profiler's CUPTI trace: CUPTI sees every kernel in the
process, MLX's included, so a trace of MLX work needs no torch ops. Host phases are marked with
`torch.profiler.record_function` (`marked`) and land on the trace's timeline beside the kernels, so the GPU's idle
gaps can be charged to the phase the host was in (`idle_by_phase`)."""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATEGORIES = ("cuda_runtime", "cuda_driver")


def _events(trace: Path) -> list[dict]:
    return json.loads(Path(trace).read_text()).get("traceEvents", [])


def gpu_spans(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every kernel, copy and memset, sorted."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0)) for e in events
                  if e.get("cat", "") in GPU_CATEGORIES)


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted spans with overlaps joined: the intervals the GPU was busy."""
    out: list[list[float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def cupti_summary(trace: Path) -> dict:
    """GPU busy ms (union of kernel and copy intervals), kernel count, and host ms of runtime/driver calls by
    name, from a chrome trace written by torch.profiler."""
    events = _events(trace)
    calls, free_by_thread = {}, {}
    for e in events:
        if e.get("cat", "") in API_CATEGORIES:
            dur = float(e.get("dur", 0) or 0)
            c = calls.setdefault(e.get("name", "?"), [0, 0.0])
            c[0] += 1
            c[1] += dur / 1e3
            if e.get("name") == "cudaFree":
                tid = str(e.get("tid"))
                free_by_thread[tid] = round(free_by_thread.get(tid, 0.0) + dur / 1e3, 3)
    spans = gpu_spans(events)
    busy = sum(hi - lo for lo, hi in merged(spans))
    top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:12]
    return {"gpu_busy_ms": busy / 1e3, "kernels": sum(e.get("cat") == "kernel" for e in events),
            "gpu_span_ms": (max(h for _, h in spans) - min(lo for lo, _ in spans)) / 1e3 if spans else 0.0,
            "cuda_free_ms_by_thread": free_by_thread,
            "host_calls": {name: {"count": n, "ms": round(ms, 3)} for name, (n, ms) in top}}


def api_calls(gap: tuple[float, float], calls: list[tuple[float, float, str]], most: int = 4,
              least_us: float = 50.0) -> dict[str, float]:
    """The CUDA runtime and driver calls that overlap `gap` by at least `least_us` in all, by name: ms of overlap,
    the `most` longest (equal times by name). A host blocked in a call that waits for the device (a free, a stream
    sync) while the device idles shows here."""
    lo, hi = gap
    by_name: dict[str, float] = {}
    for a, b, name in calls:
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            by_name[name] = by_name.get(name, 0.0) + overlap
    kept = sorted(((us, name) for name, us in by_name.items() if us >= least_us), key=lambda t: (-t[0], t[1]))
    return {name: round(us / 1e3, 3) for us, name in kept[:most]}


def charge(gap: tuple[float, float], phases: list[tuple[float, float, str]]) -> dict[str, float]:
    """Microseconds of `gap` by the innermost host phase running then (of those that cover a moment, the latest
    started, then the first to end: a nested range starts no earlier and ends no later; equal ranges by name),
    "outside phases" where none does."""
    lo, hi = gap
    cuts = sorted({lo, hi, *(p for a, b, _ in phases for p in (a, b) if lo < p < hi)})
    out: dict[str, float] = {}
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        active = [p for p in phases if p[0] <= mid < p[1]]
        name = max(active, key=lambda p: (p[0], -p[1], p[2]))[2] if active else "outside phases"
        out[name] = out.get(name, 0.0) + (b - a)
    return out


def top_kernels(events: list[dict], lo: float, hi: float, count: int) -> dict[str, dict]:
    """The `count` kernel names with the most GPU time starting within [lo, hi): calls, ms and the largest launch
    grid each (names cut to 100 characters: templated kernels' names run long; the grid hints at the size)."""
    totals: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "kernel" and lo <= float(e["ts"]) < hi:
            t = totals.setdefault(str(e.get("name", "?"))[:100], [0, 0.0, []])
            t[0] += 1
            t[1] += float(e.get("dur", 0) or 0)
            t[2] = max(t[2], list(e.get("args", {}).get("grid", [])))
    top = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:count]   # equal times: by name
    return {name: {"count": n, "ms": round(us / 1e3, 3), "grid": grid} for name, (n, us, grid) in top}


def idle_by_phase(trace: Path, call: str = "call", min_gap_us: float = 20.0, kernels: int = 0,
                  timeline_gap_us: float = 2000.0) -> list[dict]:
    """Per host range named `call` (in trace order): its wall ms, the GPU's busy ms inside it, and its idle ms
    (gaps of at least `min_gap_us` between busy intervals, from the range's start to its end) charged to the
    host phase running then (`charge`); the gaps of at least `timeline_gap_us` in order (`gaps`: ms from the
    call's start, length, the phases charged, and the CUDA runtime and driver calls the host was in then,
    `api_calls`); with `kernels`, that many of its costliest kernels (`top_kernels`)."""
    events = _events(trace)
    marks = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0), e.get("name", "?")) for e in events
                   if e.get("cat") == "user_annotation")
    api = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0), str(e.get("name", "?"))) for e in events
           if e.get("cat") in API_CATEGORIES]
    calls = [m for m in marks if m[2] == call]
    phases = [m for m in marks if m[2] != call]
    busy = merged(gpu_spans(events))
    rows = []
    for lo, hi, _ in calls:
        inside = [(max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi]
        idle: dict[str, float] = {}
        gaps = []
        edge = lo
        for a, b in inside + [(hi, hi)]:
            if a - edge >= min_gap_us:
                charged = charge((edge, a), phases)
                for name, us in charged.items():
                    idle[name] = idle.get(name, 0.0) + us
                if a - edge >= timeline_gap_us:
                    gaps.append({"at_ms": round((edge - lo) / 1e3, 2), "ms": round((a - edge) / 1e3, 2),
                                 "phases": {k: round(v / 1e3, 2) for k, v in charged.items()},
                                 "api_calls": api_calls((edge, a), api)})
            edge = max(edge, b)
        rows.append({"wall_ms": (hi - lo) / 1e3, "gpu_busy_ms": sum(b - a for a, b in inside) / 1e3,
                     "idle_ms": {k: round(v / 1e3, 3) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])},
                     "gaps": gaps})
        if kernels:
            rows[-1]["kernels"] = top_kernels(events, lo, hi, kernels)
    return rows


@contextmanager
def marked(targets: list[tuple[object, str, str | Callable[..., str]]]) -> Iterator[None]:
    """Each `(owner, attribute, label)`: calls of `owner.attribute` recorded as a host range named `label` (or
    `label(*args, **kwargs)`, named per call) for the block's duration; the attribute is restored after."""
    from torch.profiler import record_function

    def recorded(fn, label):
        def inner(*a, **k):
            with record_function(label if isinstance(label, str) else label(*a, **k)):
                return fn(*a, **k)
        return inner

    with ExitStack() as undo:
        for owner, attr, label in targets:
            real = getattr(owner, attr)
            setattr(owner, attr, recorded(real, label))
            undo.callback(setattr, owner, attr, real)
        yield


def forward_label(model, batch, *args, **kwargs) -> str:
    """A pass of a call's new prompts, or of followers only, each over a cached video."""
    followers = all(s.seq.num_computed > s.seq.video_span[0] for s in batch)
    return "forward: followers" if followers else "forward: prompts"


def engine_phases(clf, call: tuple[object, str]) -> list[tuple[object, str, str | Callable[..., str]]]:
    """The engine's host phases to mark (`marked`) around a classifier `clf`, with `call` = (owner, attribute) of
    the call whose wall time is charged (the job engine's `answer`, or the classifier's own `classify`)."""
    import mlx.core as mx

    from batchjob.engine import classifier as classifier_module
    from batchjob.engine import runner
    from batchjob.engine.scheduler import Scheduler

    try:
        from batchjob.engine import intake   # the call's start and each step's look-ahead
    except ImportError:   # an older engine's A/B copy: its call started with Classifier._start_towers
        intake = None
    CallIntake, StepAhead = (getattr(intake, name, None) for name in ("CallIntake", "StepAhead"))
    phases = [(*call, "call"), (clf, "_start_towers", "towers first"), (CallIntake, "start", "towers first"),
              (CallIntake, "look_ahead", "look-ahead"), (StepAhead, "piece", "look-ahead"),
              (StepAhead, "finish", "look-ahead"),
              (StepAhead, "towers", "look-ahead"), (clf, "_prepare", "prepare"),
              (Scheduler, "schedule", "schedule"), (Scheduler, "finish_step", "finish step"),
              (clf, "_video_rows", "video rows"), (classifier_module, "_result", "results"),
              (clf, "_read_answers", "results"),   # with passes overlapped, the wait for a call's last pass
              (runner, "build_attention_metadata", "forward: metadata"), (runner, "_embed", "forward: embed"),
              (runner, "_video_injection", "forward: video rows"), (mx, "eval", "waits (mx.eval)"),
              (classifier_module, "forward", forward_label)]
    return [p for p in phases if p[0] is not None and hasattr(p[0], p[1])]   # an older engine's copy may lack one


def traced_idle(run: Callable[[], object], phases: list, kernels: int = 0) -> list[dict]:
    """`run()` under torch.profiler (CUPTI) with `phases` marked: per call, its wall, the GPU's busy time and its
    idle time by phase, and its `kernels` costliest kernels (`idle_by_phase`)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory(prefix="bj-cupti-") as folder:
        trace = Path(folder) / "trace.json"
        with marked(phases), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
        prof.export_chrome_trace(str(trace))
        return idle_by_phase(trace, kernels=kernels)
