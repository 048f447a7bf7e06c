"""Where MLX's compiled CUDA kernels are kept, without importing MLX: a benchmark's parent process counts and
clears them (`scripts/benchlib/job_runs.py`) while engines in other processes fill them (`device.py`)."""
from __future__ import annotations

from pathlib import Path

from batchjob.cache_home import cache_home

KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def kernel_cache_root(home: str | None = None) -> Path:
    """The user's cache of compiled kernels, every MLX version and GPU architecture under it: under `home` (a
    batchjob cache root) or `cache_home()`."""
    return (Path(home) if home else cache_home()) / "mlx-cuda-kernels"
