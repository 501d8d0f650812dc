"""Migration on the installed cluster (docs/architecture.md, "Migration"): alice's cell finds
every GPU of her kernel's three servers taken by another user's cells; one replica moves to the
fourth server, the cell runs there once, with her state, and she is told in one line."""

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


def test_a_cell_whose_servers_are_all_busy_runs_on_the_spare_server_after_a_move(cluster):
    nodes = four_gpu_nodes_up(cluster)
    alice = HubUser(cluster, "alice")
    alice.login()
    alice.start_server("gpu1")
    hogs: list[tuple[str, str]] = []
    try:
        kid = alice.start_kernel("gpuhub-gpu1")
        channel = alice.kernel(kid)
        try:
            channel.run("big = bytes(range(256)) * 200_000\nruns = 0\nx = 41")  # 51 MB, sent out of band
            placed = wait_for(lambda: (units := replica_units(cluster, kid)) and len(units) == 3 and units, 30)
            assert placed, f"replicas of {kid}: {replica_units(cluster, kid)}"
            spare = next(n for n in nodes if n not in placed)
            for node in placed:  # bob's cells take every GPU of alice's servers
                hogs.append((node, hold_every_gpu(cluster, node)))

            out = channel.run("runs += 1; x += 1\n" + WHERE + "\nprint(x, len(big), sum(big[:512]), runs)", timeout=180)
            host, _cuda, x, size, head, runs = out["stdout"].split()
            assert (host, x, size, head, runs) == (spare, "42", "51200000", str(2 * sum(range(256))), "1"), out
            moving = f"[gpuhub] waiting for a GPU: moving this kernel to {spare}…"
            assert out["notices"].count(moving) == 1 and not out["stderr"], out
            moved = replica_units(cluster, kid)
            assert spare in moved and len(moved) == 3, moved
            # The next cell runs where the GPU is, without another move.
            again = channel.run("runs += 1\n" + WHERE + "\nprint(runs)")
            assert again["stdout"].split()[0] == spare and again["stdout"].split()[-1] == "2", again
            assert "moving" not in again["stderr"]
        finally:
            channel.close()
            alice.api("DELETE", f"/user/alice/api/kernels/{kid}")
    finally:
        for node, name in hogs:
            let_go(cluster, node, name)
        alice.stop_server()
