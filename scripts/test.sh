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
if unshare -rn true 2>/dev/null; then
    export BATCHJOB_NETNS=1
    exec unshare -rn sh -c 'ip link set lo up && exec "$@"' sh "$VENV/bin/python" -m pytest "$@"
fi
echo "test.sh: warning: cannot create a network namespace (unshare -rn); Ray tests will refuse to run" >&2
exec "$VENV/bin/python" -m pytest "$@"
