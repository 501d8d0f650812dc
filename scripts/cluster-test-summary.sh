#!/usr/bin/env bash
# After a failed `molecule test -s cluster`: print pytest's short summary (the failed tests and
# their errors) last, below molecule's destroy output, where a CI log's tail shows it.
set -uo pipefail
log=${1:-.cache/cluster-tests.log}
echo
if [[ ! -s $log ]]; then
    echo "== cluster tests: no pytest output ($log is missing): the failure came before verify, see above"
    exit 0
fi
echo "== cluster tests failed; pytest's summary (whole output: $log) =="
if grep -q "short test summary info" "$log"; then
    sed -n '/short test summary info/,$p' "$log" | cut -c1-400
else
    tail -n 20 "$log" | cut -c1-400
fi
