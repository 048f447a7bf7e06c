"""A command measured from outside, as a user's shell sees it: wall time, exit code, the peak memory of its whole
process tree (PSS, so shared pages count once) and what the GPU did while it ran (benchlib.gpu_monitor)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from .gpu_monitor import GpuMonitor


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree_pss_mb(root: int) -> float | None:
    """Proportional set size of `root` and its descendants (shared pages counted once overall); Linux only."""
    if not os.path.isdir("/proc"):
        return None
    kids, total, stack = _children(), 0, [root]
    while stack:
        pid = stack.pop()
        stack += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total / 1024


class Sampler(threading.Thread):
    """Peak host memory of a process tree while it runs."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period, self.stop = pid, period, threading.Event()
        self.peak_mb: float | None = None

    def run(self) -> None:
        while not self.stop.wait(self.period):
            mb = tree_pss_mb(self.pid)
            if mb is not None:
                self.peak_mb = max(self.peak_mb or 0.0, mb)


def run_measured(cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group; wall time, exit code, sampled memory/GPU, output tail."""
    gpu = GpuMonitor(interval_ms=500).start()
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            timed_out = True
        end = time.perf_counter()   # the command's wall time: stopping the samplers below is not part of it
        sampler.stop.set()
        sampler.join()
    finally:
        gpu.stop()
    during = gpu.window(t0, end)
    return {"wall_s": end - t0, "returncode": proc.returncode, "timed_out": timed_out,
            "peak_host_mb": sampler.peak_mb,
            "gpu_util_mean": during["util_pct_mean"] / 100 if "util_pct_mean" in during else None, "gpu": during,
            "output_tail": (output or "")[-3000:]}
