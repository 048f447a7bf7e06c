#!/usr/bin/env bash
# Thin wrapper for crontabs that call a script: everything happens in `batchjob nightly` (lock, history,
# alerts, logs under the history folder). Usage: jobs/nightly.sh [DEFINITION] [--date YYYY-MM-DD]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BATCHJOB="${BATCHJOB:-$ROOT/.venv/bin/batchjob}"
DEFINITION="$ROOT/jobs/nightly.yaml"
if [[ $# -gt 0 && "$1" != --* ]]; then DEFINITION="$1"; shift; fi
exec "$BATCHJOB" nightly "$DEFINITION" "$@"
