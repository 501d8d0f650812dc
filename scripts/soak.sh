#!/usr/bin/env bash
# The flake check: `make test` RUNS times in a row, each on a fresh clone of REF, while two busy
# loops keep both cores of this machine busy. Stops at the first failure. Logs go to LOGDIR.
#
#   scripts/soak.sh [RUNS=3] [REF=HEAD] [LOGDIR=/tmp/gpuhub-soak]
#
# It runs the molecule cluster "ci", so do not run another `make test`/`make test-cluster` beside it.
set -euo pipefail
runs=${1:-3}
ref=$(git -C "$(dirname "$0")/.." rev-parse "${2:-HEAD}")
logdir=${3:-/tmp/gpuhub-soak}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$logdir"

busy=()
stop_busy() { ((${#busy[@]})) && kill "${busy[@]}" 2>/dev/null || true; }
trap stop_busy EXIT
for _ in 1 2; do
    (while :; do :; done) &
    busy+=($!)
done

echo "soak: $runs runs of make test at ${ref:0:12}, two busy loops (pids ${busy[*]}), logs in $logdir"
for i in $(seq 1 "$runs"); do
    clone=$(mktemp -d /tmp/gpuhub-soak-clone.XXXXXX)
    git clone -q "$repo" "$clone"
    git -C "$clone" checkout -q "$ref"
    start=$(date +%s)
    if (cd "$clone" && CI=true bash .ci/run) >"$logdir/run$i.log" 2>&1; then
        summary=$(sed 's/\x1b\[[0-9;]*m//g' "$logdir/run$i.log" | grep -oE '[0-9]+ passed[^=]* in [0-9.]+s' | tr '\n' ';')
        echo "soak: run $i passed in $(($(date +%s) - start)) s ($summary)"
        rm -rf "$clone"
    else
        echo "soak: run $i FAILED after $(($(date +%s) - start)) s; log $logdir/run$i.log, clone kept in $clone"
        exit 1
    fi
done
echo "soak: all $runs runs passed"
