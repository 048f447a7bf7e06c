"""Where batchjob keeps what it builds once per machine and reuses: the demo's clips and model, MLX's compiled
CUDA kernels, benchmarks' clips and checkpoints. One rule for all of them, so that one setting moves them all
(a home directory on a small disk, a shared cache on a cluster):

`$BATCHJOB_CACHE` when set, else `$XDG_CACHE_HOME/batchjob`, else `~/.cache/batchjob`.

Imports nothing heavy: processes that only count or clear a cache (a benchmark's parent) use it too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

CACHE_ENV = "BATCHJOB_CACHE"


def cache_home(environ: Mapping[str, str] | None = None) -> Path:
    """The root of batchjob's caches (module docstring), `~` expanded; not created here."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "batchjob"
