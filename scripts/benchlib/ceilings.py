"""The hardware's measured bf16 matmul rate: the denominator of every MFU figure, taken in the same run."""
from __future__ import annotations

import statistics
import time


def median(xs) -> float:
    return float(statistics.median(xs))


def _bf16_operands(n: int):
    """Two random n x n bf16 matrices, evaluated: the ceilings' operands."""
    import mlx.core as mx

    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    return a, b


def mlx_matmul_ceiling(n: int = 8192, reps: int = 5, inner: int = 10, warmup: int = 4) -> float:
    """FLOP/s of an n x n x n bf16 matmul in MLX on its default device: `inner` matmuls queued per sync (as a
    forward's GEMMs run, back to back), the median of `reps` such runs after `warmup` of them, long enough for the
    clocks to settle. Why queued: one sync per matmul charges each its launch and the host's wake-up, so those
    readings moved from run to run on one GPU more than queued ones do (docs/gpu_run.md has the figures)."""
    import mlx.core as mx

    a, b = _bf16_operands(n)
    for _ in range(warmup):
        mx.eval([a @ b for _ in range(inner)])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([a @ b for _ in range(inner)])
        times.append((time.perf_counter() - t0) / inner)
    return 2 * n**3 / median(times)


def mlx_matmul_ceiling_synced(n: int = 8192) -> float:
    """The reading bench_gpu took before the eighteenth session (a sync per matmul, the median of ten after three),
    kept for comparison with older results files."""
    return mlx_matmul_ceiling(n, reps=10, inner=1, warmup=3)


def mlx_matmul_ceiling_sustained(n: int = 8192, seconds: float = 10.0, inner: int = 10) -> float:
    """The same matmuls back to back for `seconds`, FLOP/s over the second half: the rate the board holds once its
    power cap has pulled the clocks down, as it does through a job's seconds of prefill. The start's short reading
    runs at idle clocks, which a job of several seconds does not keep: this says how much of a wall-time miss
    that denominator accounts for."""
    import mlx.core as mx

    a, b = _bf16_operands(n)
    stamps = [time.perf_counter()]
    while stamps[-1] - stamps[0] < seconds or len(stamps) < 5:
        mx.eval([a @ b for _ in range(inner)])
        stamps.append(time.perf_counter())
    half = len(stamps) // 2
    return 2 * n**3 * inner * (len(stamps) - 1 - half) / (stamps[-1] - stamps[half])


def mlx_copy_bandwidth(nbytes: int = 2**30, reps: int = 5, inner: int = 10, warmup: int = 2) -> float:
    """Bytes/s an elementwise pass moves in MLX on its default device (`x + 1` over `nbytes` of fp32: read once,
    written once), `inner` passes queued per sync, median of `reps`: the memory-bound parts' ceiling, recorded
    beside the matmul one so that a machine with slower memory is told from slower code."""
    import mlx.core as mx

    x = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(x)

    def passes():
        y = x
        for _ in range(inner):
            y = y + 1   # a chain: each pass frees the one before, so memory stays at three buffers
        mx.eval(y)

    for _ in range(warmup):
        passes()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        passes()
        times.append((time.perf_counter() - t0) / inner)
    return 2 * (nbytes // 4) * 4 / median(times)


def torch_matmul_ceiling(n: int = 8192, reps: int = 10) -> float:
    """The same in torch on CUDA, timed with CUDA events (a sync per matmul; CUDA events leave out the host)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / median(times)
