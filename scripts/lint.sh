#!/usr/bin/env bash
# Lint: ruff on the Python tree (rules in pyproject.toml), ansible-lint (production profile, offline)
# on the playbooks and roles, and a byte-compile of the package. Fast enough for every `make test`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN="$ROOT/.venv/bin"
[ -x "$BIN/ansible-lint" ] || BIN=$(dirname "$(command -v ansible-lint)")

echo "lint: ruff"
"$BIN/ruff" check --no-cache "$ROOT"

echo "lint: ansible-lint (production profile)"
PATH="$BIN:$PATH" ANSIBLE_CONFIG="$ROOT/ansible.cfg" "$BIN/ansible-lint" -q --nocolor \
  -c "$ROOT/scripts/ansible-lint.yml" site.yml playbooks roles molecule

echo "lint: python -m compileall gpuhub"
"$BIN/python" -m compileall -q gpuhub
echo "lint: ok"
