"""The elastic GPU pool on the installed cluster (docs/install.md, "Elastic GPU pool"). The test
cluster's inventory names two hook commands and leaves the pool off; this test installs the hook
(it writes what it was asked to a log) and turns the pool on. An idle GPU server is lent through the
release hook and `gpuhub node list` says so; when alice's cell finds every GPU of her kernel's three
servers taken by bob's cells, the lent server is acquired back through the other hook and her cell
runs there once, with her state. The pool is turned off again at the end."""

from __future__ import annotations

import pytest

from tests.cluster.test_e2e import (
    WHERE,
    HubUser,
    four_gpu_nodes_up,
    hold_every_gpu,
    let_go,
    replica_units,
    wait_for,
)

pytestmark = pytest.mark.cluster

HOOK_PATH = "/usr/local/bin/gpuhub-test-pool-hook"
HOOK_LOG = "/var/lib/gpuhub/scheduler/pool-hooks.log"  # the scheduler's own state directory: writable
HOOK = f'#!/bin/sh\necho "$1 $2" >> {HOOK_LOG}\necho "$1 $2: done"\n'
GPUHUB = "/opt/gpuhub/venv/bin/gpuhub"


def node_states(cluster) -> dict[str, str]:
    """NODE -> STATE, as `gpuhub node list` on the hub prints them ({} while the scheduler starts)."""
    out = cluster.exec(cluster.groups["hub"][0], GPUHUB, "node", "list", check=False)
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return {row[0]: row[1] for row in rows if len(row) > 1}


def hook_calls(cluster) -> list[str]:
    return cluster.exec(cluster.groups["hub"][0], "sh", "-c", f"cat {HOOK_LOG} 2>/dev/null || true").splitlines()


def set_pool(cluster, on: bool) -> None:
    hub, value = cluster.groups["hub"][0], "true" if on else "false"
    cluster.exec(hub, "sed", "-i", f"s/^pool_enabled = .*/pool_enabled = {value}/", "/etc/gpuhub/scheduler.toml")
    cluster.exec(hub, "systemctl", "restart", "gpuhub-scheduler")


def test_an_idle_server_is_lent_through_the_hook_and_acquired_back_for_a_waiting_cell(cluster):
    nodes = four_gpu_nodes_up(cluster)
    hub = cluster.groups["hub"][0]
    cluster.exec(hub, "sh", "-c", f"cat > {HOOK_PATH} <<'EOF'\n{HOOK}EOF\nchmod 0755 {HOOK_PATH}; rm -f {HOOK_LOG}")
    set_pool(cluster, True)
    alice = HubUser(cluster, "alice")
    hogs: list[tuple[str, str]] = []
    try:
        # Four idle servers and a minimum of three active: one is drained and lent.
        calls = wait_for(lambda: hook_calls(cluster), 120)
        assert calls and calls[0].split()[0] == "release", calls
        lent = calls[0].split()[1]
        assert wait_for(lambda: node_states(cluster).get(lent) == "lent", 30), node_states(cluster)

        alice.login()
        alice.start_server("gpu1")
        kid = alice.start_kernel("gpuhub-gpu1")
        channel = alice.kernel(kid)
        try:
            channel.run("big = bytes(range(256)) * 40_000\nruns = 0\nx = 41")
            placed = wait_for(lambda: (units := replica_units(cluster, kid)) and len(units) == 3 and units, 30)
            assert placed and lent not in placed, (placed, lent)
            for node in placed:  # bob's cells take every GPU of alice's servers
                hogs.append((node, hold_every_gpu(cluster, node)))

            out = channel.run("runs += 1; x += 1\n" + WHERE + "\nprint(x, len(big), runs)", timeout=240)
            host, _cuda, x, size, runs = out["stdout"].split()
            assert (host, x, size, runs) == (lent, "42", "10240000", "1"), out
            assert hook_calls(cluster)[:2] == [f"release {lent}", f"acquire {lent}"]
            assert node_states(cluster)[lent] == "active"
        finally:
            channel.close()
            alice.api("DELETE", f"/user/alice/api/kernels/{kid}")
    finally:
        for node, name in hogs:
            let_go(cluster, node, name)
        alice.stop_server()
        set_pool(cluster, False)  # what it lent is back in service (the scheduler says so in its log)
        assert wait_for(lambda: set(node_states(cluster).get(n) for n in nodes) == {"active"}, 60), \
            node_states(cluster)
