"""One-time settings for worker processes that host the MLX engine or prepare its inputs.

Both are process-wide, so they are applied only in processes batchjob owns (the pipeline's Ray actors),
never in a caller's own process.
"""
from __future__ import annotations

import ctypes
import os
import sys


def keep_torch_out() -> bool:
    """Make `torch` look absent to this process; False when it was already imported or hidden (no change).

    transformers imports PyTorch whenever it is installed, even for the tokenizer and the PIL image
    processor the MLX engine uses: on the 2-core CI machine, loading the tiny checkpoint took 6.5 s with
    torch installed and 2.3 s with it hidden, and torch adds about 300 MB to each such process.
    """
    if "torch" in sys.modules:
        return False
    # A None entry is Python's documented "not importable" marker: importlib.util.find_spec (what
    # transformers' availability check uses) returns None and `import torch` raises ImportError.
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers then logs "PyTorch was not found" at import; that is expected here.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return True


def set_blas_threads(cpus: float) -> int | None:
    """Cap the preloaded OpenBLAS's pool at `cpus` threads (whole, at least 1); returns the new count, None
    when no OpenBLAS is loaded.

    OpenBLAS sizes its pool from the environment when the library loads, at process start, so Ray's
    per-actor OMP_NUM_THREADS arrives too late (measured: 2 threads in a 1-CPU actor on a 2-core box).
    Idle OpenBLAS threads spin; beside busy decoders that cost the tiny benchmark model half its speed.
    """
    try:
        lib = ctypes.CDLL(None)
        setter, getter = lib.openblas_set_num_threads, lib.openblas_get_num_threads
    except (OSError, AttributeError):
        return None
    setter(max(1, int(cpus)))
    return int(getter())
