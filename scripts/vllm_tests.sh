#!/usr/bin/env bash
# The vLLM tests, in the separate vLLM environment (scripts/vllm_env.sh builds it):
#  1. ours: tests marked `vllm` (plugin-only processes, frames/metadata against load_video, fps counts
#     against vLLM's own loader);
#  2. vLLM 0.32.0's own video-loader tests from its source package, once per batchjob loader, with the
#     loader in the place of vLLM's default one (tests/vllm/suite_adapter.py); the cases that differ by
#     design are listed with their reasons in tests/vllm/EXPECTED_DIFFERENCES.md.
# Both run in a loopback-only network namespace (scripts/netns.sh), like the main tests.
# Fails when any test fails. Extra arguments go to every pytest call. BATCHJOB_SUITE_LOADERS picks the
# loaders for part 2 (default: all four); BATCHJOB_VLLM_OURS=0 skips part 1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION="0.32.0"
VENV="$("$ROOT/scripts/vllm_env.sh")"
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu

SDIST="$VENV/.cache/vllm-$VLLM_VERSION.tar.gz"
[[ -f "$SDIST" ]] || "$PY" "$ROOT/tests/vllm/fetch_vllm_sdist.py" "$VLLM_VERSION" "$SDIST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SDIST" -C "$WORK" --strip-components=1 "vllm-$VLLM_VERSION/tests/multimodal"
cp "$ROOT/tests/vllm/suite_adapter.py" "$WORK/tests/conftest.py"
printf '[pytest]\naddopts = -ra -p no:cacheprovider\nasyncio_mode = auto\nmarkers =\n    cpu_test\n    core_model\n' \
    > "$WORK/tests/pytest.ini"

# vLLM's tests build their clips from an image in its public S3 bucket; CI reaches only package
# registries, so a locally drawn image stands in (any picture serves: the tests compare decoded frames
# with the image the clip was made from).
export VLLM_ASSETS_CACHE="$WORK/assets"
mkdir -p "$VLLM_ASSETS_CACHE/vllm_public_assets"
"$PY" -c 'import sys, numpy as np; from PIL import Image
rng = np.random.default_rng(0); y, x = np.mgrid[0:480, 0:640]
img = np.stack([x * 255 // 640, y * 255 // 480, (x + y) % 256], -1).astype(np.uint8)
img[100:380, 200:440] = rng.integers(0, 256, 3, dtype=np.uint8)
Image.fromarray(img).save(sys.argv[1], quality=95)' "$VLLM_ASSETS_CACHE/vllm_public_assets/stop_sign.jpg"

cd "$ROOT"
status=0
if [[ "${BATCHJOB_VLLM_OURS:-1}" == 1 ]]; then
    "$ROOT/scripts/netns.sh" "$PY" -m pytest tests/vllm -m vllm -p no:cacheprovider "$@" || status=1
fi
export BATCHJOB_SUITE_DIFFERENCES="$ROOT/tests/vllm/EXPECTED_DIFFERENCES.md"
echo "== vLLM $VLLM_VERSION's video-loader tests, each run against ${BATCHJOB_SUITE_LOADERS:-every batchjob loader}"
(cd "$WORK/tests" && "$ROOT/scripts/netns.sh" "$PY" -m pytest -c pytest.ini --rootdir . multimodal/test_video.py \
    multimodal/media/test_video.py multimodal/media/test_connector.py -k "video or Video" "$@") || status=1
exit $status
