"""Diagnostic: what handing one clip's patch bytes to the engine costs on an MLX CUDA device, and where.

MLX's CUDA allocator hands out managed (unified) memory: `mx.array(numpy)` writes the bytes on the host, and the
first kernel that reads them migrates the pages to the GPU on demand. This times, per clip-sized upload, the host
write alone, the first device read (the migration), a second read of the same array (no migration), and, for
scale, the same bytes as a pinned-host to device copy in torch. `--prefetch`: each upload's pages sent to the GPU
right after the array is made, as the engine does. `--behind-matmul N`: each upload made right after one N^3 bf16
matmul was queued, to see whether making the array waits for the device's queued work.

    python3 scripts/diag_upload.py [--mib 9.6] [--repeats 20] [--prefetch] [--behind-matmul 16384]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=9.6, help="bytes per upload (a Qwen3-VL 16-frame clip: 9.6)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prefetch", action="store_true",
                    help="prefetch each upload to the GPU as the engine does (batchjob.engine.managed_upload)")
    ap.add_argument("--behind-matmul", type=int, default=0, metavar="N",
                    help="queue one N x N x N bf16 matmul (one kernel) before each upload")
    a = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    from batchjob.engine.managed_upload import prefetch_to_gpu

    n = int(a.mib * 2**20)
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(4)]
    rows = {"host_write_ms": [], "first_device_read_ms": [], "second_device_read_ms": [], "total_ms": []}
    prefetched = 0
    queued = None
    if a.behind_matmul:
        w = mx.random.normal((a.behind_matmul, a.behind_matmul)).astype(mx.bfloat16)
        mx.eval(w @ w)                 # the matmul's kernel chosen and built before any timing
        rows["queue_done_after_ms"] = []
    for i in range(a.repeats + 2):
        if a.behind_matmul:
            queued = w @ w
            mx.async_eval(queued)
        t0 = time.perf_counter()
        x = mx.array(host[i % 4])
        mx.eval(x)
        if a.prefetch:
            prefetched += prefetch_to_gpu(x)
        t1 = time.perf_counter()
        if queued is not None:          # when the work queued before the upload finished, from the same start
            mx.eval(queued)
        done = time.perf_counter()
        y = x.astype(mx.bfloat16)
        mx.eval(y)
        t2 = time.perf_counter()
        z = (x + 1).astype(mx.bfloat16)
        mx.eval(z)
        t3 = time.perf_counter()
        if i >= 2:
            figures = (t1 - t0, t2 - done, t3 - t2, t1 - t0 + t2 - done) + ((done - t0,) if queued is not None else ())
            for key, v in zip(rows, figures):
                rows[key].append(v * 1e3)
        if i == a.repeats + 1 and not np.array_equal(np.array(y.astype(mx.uint8)), host[i % 4]):
            raise SystemExit("the bytes read on the device are not the bytes uploaded")
        del x, y, z
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    out["gb_per_s_first_read"] = round(n / out["first_device_read_ms"] / 1e6, 2)
    if a.prefetch:
        out["prefetches_queued"] = prefetched
    try:
        import torch

        pinned = torch.from_numpy(host[0]).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        times = []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out["torch_pinned_h2d_ms"] = round(statistics.median(times), 3)
    except Exception as exc:      # no torch or no CUDA: the MLX figures stand alone
        out["torch_pinned_h2d_error"] = f"{type(exc).__name__}: {exc}"[:200]
    print(f"{a.mib} MiB per upload, median of {a.repeats}, device {mx.default_device()}: {out}")


if __name__ == "__main__":
    main()
