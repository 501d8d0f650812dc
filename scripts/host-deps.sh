#!/usr/bin/env bash
# Debian packages the controller needs to run the local podman test cluster (docs/testing.md).
# Idempotent: installs only what is missing, and does nothing at all when everything is there.
# Usage: scripts/host-deps.sh [browser]
set -euo pipefail

need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v newuidmap >/dev/null 2>&1 || need+=(uidmap)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
# With "browser" (make test-cluster): Debian's chromium for tests/cluster/test_browser.py.
if [ "${1:-}" = browser ]; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
fi

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "host-deps: missing ${need[*]}; run as root (apt-get install -y ${need[*]})" >&2
  exit 1
fi
echo "host-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
