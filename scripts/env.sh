# Sourced by the project's scripts: the venv path and the fast-BLAS preload for MLX on Linux.
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
VENV="${BATCHJOB_VENV:-$ROOT/.venv}"
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [[ -e "$OPENBLAS" && ":${LD_PRELOAD:-}:" != *":$OPENBLAS:"* ]]; then
    export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export RAY_USAGE_STATS_ENABLED=0
export PATH="$VENV/bin:$PATH"
