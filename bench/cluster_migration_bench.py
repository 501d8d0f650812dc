"""Migration on the podman test cluster: submit → cell start for a cell whose kernel's three servers
are all busy, so that one replica moves to the fourth server (one replica per container, real
systemd units, the hub's proxy and a JupyterLab-style websocket client), with 100 MB and 1 GB of
state; beside it, the same cell when the kernel's executor is free. Run on a deployed cluster of
four GPU servers (`GPUHUB_GPU_NODES=4 scripts/cluster.sh up e2e && scripts/cluster.sh deploy e2e`):
`GPUHUB_CLUSTER=e2e .venv/bin/python -m bench cluster-migration`.

The timed cell prints ``time.time()`` first; the containers share this machine's clock, so the
start is that print minus the submit. Each trial is a fresh kernel of alice's; bob's "cells" are
admin-started units holding every GPU of the kernel's servers (as tests/cluster/test_migration.py).
The state is a ``bytes`` value (out of band, as large arrays are; the cluster's kernels have no
numpy).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.migration_bench import row, table

SIZES_MB = (100, 1024)
TRIALS = {100: 3, 1024: 2}
TIMED = "import time; print(time.time())\nruns += 1\n" + "import socket; print(socket.gethostname())"


def timed(channel) -> tuple[float, float, str, str]:
    t0 = time.time()
    out = channel.run(TIMED, timeout=600)
    t1 = time.time()
    started, host = out["stdout"].split()[:2]
    return float(started) - t0, t1 - t0, host, "\n".join(out["notices"])


def trial(cluster, alice, mb: int) -> tuple[float, float, float, float]:
    from tests.cluster.test_e2e import hold_every_gpu, let_go, replica_units, wait_for

    kid = alice.start_kernel("gpuhub-gpu1")
    channel = alice.kernel(kid)
    hogs: list[tuple[str, str]] = []
    try:
        channel.run(f"big = bytes(range(256)) * ({mb << 20} // 256)\nruns = 0", timeout=600)
        timed(channel)
        local, local_reply, _, _ = timed(channel)
        placed = wait_for(lambda: (units := replica_units(cluster, kid)) and len(units) == 3 and units, 60)
        for node in placed:
            hogs.append((node, hold_every_gpu(cluster, node)))
        start, total, host, err = timed(channel)
        if host in placed or "moving this kernel" not in err:
            raise RuntimeError(f"the cell ran on {host} without a move: {err!r}")
        return local, start, total, local_reply
    finally:
        for node, name in hogs:
            let_go(cluster, node, name)
        channel.close()
        alice.api("DELETE", f"/user/alice/api/kernels/{kid}")


def main() -> str:
    from tests.cluster.conftest import load_cluster
    from tests.cluster.test_e2e import HubUser, every_gpu_node_heartbeats

    with tempfile.TemporaryDirectory() as tmp:
        cluster = load_cluster(Path(tmp))
        if isinstance(cluster, str):
            raise SystemExit(f"bench cluster-migration: {cluster}")
        if len(cluster.groups["gpu_nodes"]) < 4:
            raise SystemExit("bench cluster-migration: needs four GPU servers (GPUHUB_GPU_NODES=4)")
        every_gpu_node_heartbeats(cluster)
        alice = HubUser(cluster, "alice")
        alice.login()
        alice.start_server("gpu1")
        rows = []
        try:
            for mb in SIZES_MB:
                rows.append(row(mb, [trial(cluster, alice, mb) for _ in range(TRIALS[mb])]))
        finally:
            alice.stop_server()
    return table("Migration on the podman test cluster: submit → cell start when every server of the kernel is busy", [
        "Command: `GPUHUB_CLUSTER=e2e .venv/bin/python -m bench cluster-migration` (four GPU servers",
        "with two fake GPUs each, one replica per container, through the hub's proxy)."], rows)


if __name__ == "__main__":
    print(main())
