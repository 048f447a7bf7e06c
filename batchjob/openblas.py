"""The system OpenBLAS, preloaded: MLX's Linux CPU wheel ships a slow reference BLAS, and the system OpenBLAS
makes its fp32 work many times faster. A library preloaded is read when a process starts, so the `batchjob`
command and the demo model's training script each start again once with the environment made here;
`BATCHJOB_NO_OPENBLAS=1` opts out (and marks the second start, so nothing loops)."""
from __future__ import annotations

from typing import Mapping

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
NO_PRELOAD_ENV = "BATCHJOB_NO_OPENBLAS"


def preloaded(environ: Mapping[str, str]) -> bool:
    return OPENBLAS in environ.get("LD_PRELOAD", "").split(":")


def with_openblas(environ: Mapping[str, str], *, linux: bool, openblas_exists: bool) -> dict[str, str]:
    """A copy of `environ` with the system OpenBLAS first in LD_PRELOAD; unchanged where it is already there,
    where this is not Linux, or where the library is not installed."""
    env = dict(environ)
    if linux and openblas_exists and not preloaded(env):
        env["LD_PRELOAD"] = ":".join(p for p in (OPENBLAS, env.get("LD_PRELOAD")) if p)
    return env
