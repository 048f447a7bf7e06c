"""Where MLX's compiled CUDA kernels are kept, without importing MLX: a benchmark's parent process counts and
clears them (`scripts/benchlib/job_runs.py`) while engines in other processes fill them (`device.py`)."""
from __future__ import annotations

import os
from pathlib import Path

KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def kernel_cache_root(cache_home: str | None = None) -> Path:
    """The user's cache of compiled kernels, every MLX version and GPU architecture under it."""
    home = Path(cache_home or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "batchjob" / "mlx-cuda-kernels"
