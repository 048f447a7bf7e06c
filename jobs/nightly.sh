#!/usr/bin/env bash
# The nightly run: every job config in turn, each resumable (a rerun after a crash continues where the
# last run stopped), a report appended to the log, and a non-zero exit if any job failed so cron's
# mail (or your monitoring) notices. Usage: jobs/nightly.sh [CONFIG...]  (default: jobs/nightly.list)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BATCHJOB="${BATCHJOB:-$ROOT/.venv/bin/batchjob}"
LOG_DIR="${BATCHJOB_LOG_DIR:-$ROOT/results/logs}"
mkdir -p "$LOG_DIR"
if [[ $# -gt 0 ]]; then
    configs=("$@")
else
    mapfile -t configs < <(grep -v '^\s*\(#\|$\)' "$ROOT/jobs/nightly.list" | sed "s|^|$ROOT/|")
fi
status=0
for cfg in "${configs[@]}"; do
    name="$(basename "$cfg" .yaml)"
    log="$LOG_DIR/$name-$(date -u +%Y%m%d).log"
    echo "[$(date -u +%FT%TZ)] batchjob run $cfg" >>"$log"
    "$BATCHJOB" run "$cfg" --quiet >>"$log" 2>&1
    rc=$?
    echo "[$(date -u +%FT%TZ)] exit $rc (0 done, 1 runtime failure or too many error rows, 2 bad config)" >>"$log"
    "$BATCHJOB" report "$cfg" >>"$log" 2>&1
    (( rc > status )) && status=$rc
done
exit "$status"
