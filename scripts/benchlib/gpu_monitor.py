"""The GPU's clocks, power and slowdowns while a benchmark runs, per section of the run.

Lent machines of one kind differ by more than the changes a benchmark compares, and a short ceiling probe can
run at a clock a long forward does not keep. A results file
therefore says what the GPU did in each section: its SM clock, power draw, temperature and the reasons the
driver gave for holding the clocks down. One `nvidia-smi -lms` process streams the samples; on a machine
without one the monitor records that it had none and every summary is empty.
"""
from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .env import environment, nvidia_smi_query, save_json

# NVML's clocks-event (formerly throttle) reason bits, as `nvidia-smi` prints them in hex.
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
SAMPLED = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu")
# Newer drivers name the reasons "event" reasons; older ones only know the "throttle" name.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


@dataclass(frozen=True)
class Sample:
    """One line of `nvidia-smi`'s stream, taken at `t` (seconds since the epoch, by nvidia-smi's own timestamp:
    a pipe may hand the lines over in bursts); None where it printed N/A."""

    t: float
    sm_mhz: float | None
    mem_mhz: float | None
    power_w: float | None
    temp_c: float | None
    util_pct: float | None
    reasons: int | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:   # "[N/A]", "[Not Supported]"
        return None


def reason_names(mask: int) -> list[str]:
    """The named bits of a reasons mask; bits NVML may add later appear as hex."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def _epoch(stamp: str) -> float | None:
    """nvidia-smi's local-time "YYYY/MM/DD HH:MM:SS.mmm" (the fraction may be missing) as epoch seconds."""
    for form in ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S"):
        try:
            return datetime.datetime.strptime(stamp, form).timestamp()
        except ValueError:
            continue
    return None


def parse_sample(line: str) -> Sample | None:
    """A `--format=csv,noheader,nounits` line of SAMPLED then a reasons field; None for anything else (a
    warning, a header, a line cut short)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(SAMPLED) + 1:
        return None
    t = _epoch(parts[0])
    numbers = [_number(p) for p in parts[1:-1]]
    if t is None or all(n is None for n in numbers):
        return None
    try:
        reasons = int(parts[-1], 16)
    except ValueError:
        reasons = None
    return Sample(t, *numbers, reasons)


_STATS = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}


def summarize(samples: list[Sample]) -> dict:
    """Medians (and the SM clock's minimum, power's and temperature's maxima) over `samples`, and the share of
    samples in which each slowdown reason was active. Empty when there are no samples."""
    if not samples:
        return {}

    def values(name):
        return [v for v in (getattr(s, name) for s in samples) if v is not None]

    out: dict = {"samples": len(samples)}
    for name, stats in (("sm_mhz", ("median", "min")), ("mem_mhz", ("median",)), ("power_w", ("median", "max")),
                        ("temp_c", ("max",)), ("util_pct", ("median", "mean"))):
        got = values(name)
        for stat in stats if got else ():
            out[f"{name}_{stat}"] = round(float(_STATS[stat](got)), 1)
    masks = [s.reasons for s in samples if s.reasons is not None]
    counts: dict[str, int] = {}
    for mask in masks:
        for name in reason_names(mask):
            counts[name] = counts.get(name, 0) + 1
    out["reasons"] = {name: round(n / len(masks), 3) for name, n in sorted(counts.items())}
    return out


def _reason_field(command: str, index: int) -> str | None:
    """The reasons field this driver's nvidia-smi answers to; None when nvidia-smi is missing or answers neither."""
    for name in REASON_FIELDS:
        got = nvidia_smi_query((name,), index, command)
        if got is not None and got[0]:
            return name
    return None


def _default_index() -> int:
    """The GPU the process sees first: CUDA_VISIBLE_DEVICES' first entry where it is a number, else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


@dataclass
class GpuMonitor:
    """`with GpuMonitor() as gpu:` streams samples every `interval_ms`; `gpu.section(name)` (a context) or
    `gpu.record(name, start)` (from a `time.perf_counter()` reading to now) summarises a stretch of the run;
    `as_dict()` is what a results file keeps."""

    interval_ms: int = 200
    index: int = field(default_factory=_default_index)
    command: str = "nvidia-smi"
    samples: list[Sample] = field(default_factory=list)
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)   # section -> perf_counter spans
    problem: str | None = None
    reasons_field: str | None = None

    def __post_init__(self):
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._offset = time.time() - time.perf_counter()   # perf_counter readings to epoch seconds

    def start(self) -> GpuMonitor:
        reasons = self.reasons_field = _reason_field(self.command, self.index)
        if reasons is None:
            self.problem = f"no samples: {self.command} is missing or answers no clocks-reason field"
            return self
        argv = [self.command, f"--id={self.index}", "--query-gpu=" + ",".join(SAMPLED + (reasons,)),
                "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        if shutil.which("stdbuf"):   # a line at a time, so that stopping loses no buffered tail
            argv = ["stdbuf", "-oL"] + argv
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-monitor", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)

    def window(self, start: float, end: float) -> dict:
        """The summary of the samples taken between two `time.perf_counter()` readings."""
        return self.over([(start, end)])

    def over(self, spans: list[tuple[float, float]]) -> dict:
        """The summary of the samples taken within any of `spans` (pairs of `time.perf_counter()` readings): one
        variant's rounds of an A/B together."""
        bounds = [(a + self._offset, b + self._offset) for a, b in spans]
        with self._lock:
            return summarize([s for s in self.samples if any(lo <= s.t <= hi for lo, hi in bounds)])

    def record(self, name: str, start: float, end: float | None = None) -> dict:
        """Keep `start` to `end` (default now) as section `name` and return its summary so far; a name met again
        (a round of an A/B) gets a numbered key."""
        key, n = name, 2
        while key in self.spans:
            key, n = f"{name} #{n}", n + 1
        self.spans[key] = [(start, time.perf_counter() if end is None else end)]
        return self.over(self.spans[key])

    @property
    def sections(self) -> dict[str, dict]:
        """Each section's summary, taken now: a sample stamped inside a section may reach the reader after it."""
        return {name: self.over(spans) for name, spans in self.spans.items()}

    @contextmanager
    def section(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, start)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._reader is not None:
            self._reader.join(timeout=10)

    def as_dict(self) -> dict:
        with self._lock:
            whole = summarize(list(self.samples))
        return {"interval_ms": self.interval_ms, "gpu_index": self.index, "reasons_field": self.reasons_field,
                "problem": self.problem, "whole_run": whole, "sections": self.sections}

    def __enter__(self) -> GpuMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def section_table(sections: dict[str, dict]) -> str:
    """A markdown table of the sections' summaries (a section with no samples says so)."""
    def num(got, key):
        return f"{got[key]:.0f}" if key in got else "n/a"

    lines = ["| section | samples | SM MHz median (min) | memory MHz | power W median (max) | temp C max | busy % | "
             "clock reasons (share of samples) |", "|---|---|---|---|---|---|---|---|"]
    for name, got in sections.items():
        if not got:
            lines.append(f"| {name} | 0 | | | | | | |")
            continue
        reasons = ", ".join(f"{k} {v:.0%}" for k, v in got.get("reasons", {}).items()) or "none"
        lines.append(f"| {name} | {got['samples']} | {num(got, 'sm_mhz_median')} ({num(got, 'sm_mhz_min')}) | "
                     f"{num(got, 'mem_mhz_median')} | {num(got, 'power_w_median')} ({num(got, 'power_w_max')}) | "
                     f"{num(got, 'temp_c_max')} | {num(got, 'util_pct_median')} | {reasons} |")
    return "\n".join(lines)


def monitored_report(name: str, args, run, modules: tuple[str, ...] = ("mlx.core", "mlx_vlm")) -> Path:
    """A diagnostic's whole run: the environment and its arguments, what `run(args, report, gpu)` adds to the
    report while one monitor streams, and the monitor's summary, saved to `<args.out>/<name>.json`."""
    env = environment(modules)
    report: dict = {"environment": env, "args": vars(args), "command": env["command"]}
    with GpuMonitor() as gpu:
        run(args, report, gpu)
    report["gpu_monitor"] = gpu.as_dict()
    path = Path(args.out) / f"{name}.json"
    save_json(report, path)
    print(f"wrote {path}")
    return path
