#!/usr/bin/env bash
# Runs the demo job end to end on a fresh machine: builds the environment if needed, then
# `batchjob demo` copies the tiny trained demo model (package data) and builds synthetic clips locally,
# then runs the whole pipeline on them. Extra arguments go to `batchjob demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
source "$ROOT/scripts/env.sh"
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec "$VENV/bin/batchjob" demo "$@"
