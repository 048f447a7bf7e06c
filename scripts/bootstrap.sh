#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with everything the
# tests, benchmarks and demo need. Idempotent: a stamp of pyproject.toml skips reinstalls.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BATCHJOB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

# System OpenBLAS: MLX's Linux CPU wheel ships a reference BLAS ~30x slower in fp32.
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [[ "$(uname -s)" == Linux && ! -e "$OPENBLAS" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing libopenblas0-pthread" >&2
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
    else
        echo "bootstrap: warning: $OPENBLAS missing (apt-get install libopenblas0-pthread); MLX fp32 will be slow" >&2
    fi
fi

STAMP="$VENV/.batchjob-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# pip's machine-wide config may name local wheel folders that do not exist; drop that noise.
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
# torch first and pinned: any other torch request downloads a multi-GB CUDA build.
pip_install "torch==2.13.0"
EXTRAS="mlx,ray,opencv,report,remote,s3,test"
[[ "$(uname -s)" == Linux ]] && EXTRAS="$EXTRAS,mlx-cpu"
pip_install -e "$ROOT[$EXTRAS]"
# mlx-vlm's own dependency list drags in a web server, audio and OpenCV GUI builds;
# the model definitions need only what the mlx extra already installed.
pip_install --no-deps "mlx-vlm>=0.7.10,<0.8"
echo "$WANT" > "$STAMP"
