"""`gpuhub node drain` on the installed cluster (docs/install.md, "Draining a server"): bob's CPU
kernel runs a long cell on the server an admin drains. A CPU cell holds no GPU lease, so its
replica says it runs one (gpuhub/platform/move_fence.py): the scheduler's journal says the move
waits for the cell, the cell ends as it would have, then the replica moves and bob's variables are
all there. `undrain` puts the server back."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_e2e import HubUser, four_gpu_nodes_up, replica_units, wait_for

pytestmark = pytest.mark.cluster

GPUHUB = "/opt/gpuhub/venv/bin/gpuhub"
GATE = "/home/bob/.gpuhub-test-drain-gate"  # the running cell ends once the test creates it
HOST = "import socket; print(socket.gethostname(), flush=True)"


def read_until_printed(channel, msg_id: str, text: str, timeout: float = 120) -> None:
    """Read the kernel's messages until request ``msg_id`` printed ``text`` (the cell is past it)."""
    seen = ""
    channel.ws.settimeout(timeout)
    while text not in seen:
        msg = json.loads(channel.ws.recv())
        if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["header"]["msg_type"] == "stream":
            seen += msg["content"].get("text", "")


def scheduler_journal(cluster, since: str) -> str:
    return cluster.exec(cluster.groups["hub"][0], "journalctl", "-u", "gpuhub-scheduler", "--since", since,
                        "-o", "cat", "--no-pager", check=False)


def test_a_drain_lets_the_running_cpu_cell_finish_then_moves_the_replica_losing_nothing(cluster):
    four_gpu_nodes_up(cluster)
    hub = cluster.groups["hub"][0]
    bob = HubUser(cluster, "bob")
    bob.login()
    bob.start_server("cpu")
    victim = None
    try:
        kid = bob.start_kernel("gpuhub-cpu")
        channel = bob.kernel(kid)
        try:
            out = channel.run("big = bytes(range(256)) * 40_000\nx = 41\n" + HOST)
            victim = out["stdout"].strip()  # the server of the replica that runs bob's cells
            cluster.exec(victim, "rm", "-f", GATE)
            since = cluster.exec(hub, "date", "+%Y-%m-%d %H:%M:%S").strip()
            cell = channel.send_execute(
                "import pathlib, time\nprint('started', flush=True)\n"
                f"while not pathlib.Path({GATE!r}).exists():\n    time.sleep(0.05)\nx += 1\n" + HOST)
            read_until_printed(channel, cell, "started")

            drained = cluster.exec(hub, GPUHUB, "node", "drain", victim)
            assert f"{victim}: drained" in drained, drained
            waits = f"its replica on {victim} runs a CPU cell: it moves once the cell has ended"
            assert wait_for(lambda: waits in scheduler_journal(cluster, since), 60), scheduler_journal(cluster, since)
            assert victim in replica_units(cluster, kid)  # not moved under the running cell

            cluster.exec(victim, "touch", GATE)
            out = channel.collect(cell)
            assert out["reply"]["status"] == "ok" and not out["stderr"], out
            assert out["stdout"].strip() == victim, out  # the cell ended where it began

            moved = cluster.exec(hub, GPUHUB, "node", "drain", victim, "--wait", "--timeout", "120")
            assert f"{victim}: drained; no kernel replica runs there" in moved, moved
            placed = replica_units(cluster, kid)
            assert victim not in placed and len(placed) == 3, placed
            out = channel.run("print(x, len(big), sum(big[:512]))\n" + HOST)
            x, size, head, host = out["stdout"].split()
            assert (x, size, head) == ("42", "10240000", str(2 * sum(range(256)))), out
            assert host != victim
        finally:
            channel.close()
            bob.api("DELETE", f"/user/bob/api/kernels/{kid}")
    finally:
        if victim is not None:
            cluster.exec(hub, GPUHUB, "node", "undrain", victim, check=False)
            cluster.exec(victim, "rm", "-f", GATE, check=False)
        bob.stop_server()
