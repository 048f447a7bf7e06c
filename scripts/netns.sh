#!/usr/bin/env bash
# Runs a command inside a private network namespace with only loopback up, so nothing it
# starts (Ray probes a public address to learn its own) can send traffic off this machine.
# unshare(CLONE_NEWUSER) fails with "Invalid argument" in a multithreaded process, and a
# preloaded OpenBLAS starts threads at load: so unshare runs without LD_PRELOAD and the
# command gets it back inside. A marker file tells a namespace that never came up apart
# from the command's own failure.
set -uo pipefail
export BATCHJOB_NETNS=1
MARK="$(mktemp -u)"
rc=1
for attempt in 1 2 3 4 5 6 7 8; do
    env -u LD_PRELOAD SAVED_PRELOAD="${LD_PRELOAD:-}" unshare -rn sh -c \
        'touch "$0" && ip link set lo up && { [ -z "$SAVED_PRELOAD" ] || export LD_PRELOAD="$SAVED_PRELOAD"; } && unset SAVED_PRELOAD && exec "$@"' \
        "$MARK" "$@"
    rc=$?
    if [[ -e "$MARK" ]]; then rm -f "$MARK"; exit "$rc"; fi
    echo "netns.sh: network namespace did not start (attempt $attempt), retrying" >&2
    sleep "$attempt"
done
echo "netns.sh: could not create a loopback-only network namespace (unshare -rn); it needs unprivileged user namespaces or root" >&2
exit "$rc"
