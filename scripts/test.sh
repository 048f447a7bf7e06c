#!/usr/bin/env bash
# The project's test command: builds the environment if needed, then runs pytest inside a
# private network namespace with only loopback up, so no test (Ray included) can send
# traffic off this machine. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
source "$ROOT/scripts/env.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=disabled
cd "$ROOT"
exec "$ROOT/scripts/netns.sh" "$VENV/bin/python" -m pytest "$@"
