"""Migration: submit → cell start for a cell whose kernel's three servers are all busy, so that a
replica moves to a fourth server first, with 100 MB and 1 GB of state; beside it, the same cell on
the same kernel when its executor's server is free (no move). Run: `.venv/bin/python -m bench migration`.

Development harness (scheduler, four agents with one fake GPU each, replica processes, the router
and a Jupyter client, all on this machine). Each trial is a fresh 1-GPU kernel: its state is made
by a cell (random float64, so no page is shared or zero), its three servers' GPUs are then taken
by other holders, and the timed cell prints ``time.time()`` first thing: the start is that print,
on the same clock as the submit. The move includes starting the new replica's unit (a Python
process importing the kernel), catching up from its peers (the state's blobs over TCP) and the
election the new replica wins.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from gpuhub.dev.cluster import DevCluster, DevKernel
from gpuhub.kernel.wait_notice import notice_text

SIZES_MB = (100, 1024)
TRIALS = {100: 5, 1024: 3}


def timed_cell(kernel: DevKernel) -> tuple[float, float, str, str]:
    """(submit → start, submit → reply) seconds of a cell, the server it ran on, and its status
    lines ("waiting for a GPU: moving this kernel to …") one per line."""
    out = {"stdout": "", "stderr": "", "notices": ""}

    def on_output(msg):
        if (text := notice_text(msg["msg_type"], msg["content"])) is not None:
            out["notices"] += text + "\n"
        elif msg["msg_type"] == "stream":
            out[msg["content"]["name"]] += msg["content"]["text"]

    t0 = time.time()
    reply = kernel.kc.execute_interactive("import time, os; print(time.time(), os.environ['GPUHUB_NODE'])\n"
                                          "n = state.size", timeout=600, output_hook=on_output)
    t1 = time.time()
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the timed cell failed: {reply['content']} {out}")
    started = float(out["stdout"].split()[0])
    return started - t0, t1 - t0, out["stdout"].split()[1], out["notices"]


def trial(cluster: DevCluster, mb: int) -> tuple[float, float, float, float]:
    """(start without a move, start with a move, reply with a move, reply without) for one fresh kernel."""
    kernel = DevKernel(cluster, gpus=1)
    holds = []
    try:
        reply = kernel.kc.execute_interactive(
            f"import numpy as np\nstate = np.random.default_rng(1).random({mb << 20} // 8)",
            timeout=600)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"making the state failed: {reply['content']}")
        timed_cell(kernel)  # the executor is warm, as it is for the next cell in a notebook
        local, local_reply, _, _ = timed_cell(kernel)
        placed = {r["node"] for r in kernel.refresh()["replicas"]}
        for node in placed:
            agent = cluster.agent(node)
            holds.append((agent, *agent.hold_gpu(f"hold-{node}-{time.monotonic_ns():x}")))
        start, total, where, err = timed_cell(kernel)
        if where in placed or "moving this kernel" not in err:
            raise RuntimeError(f"the cell ran on {where} without a move: {err!r}")
        return local, start, total, local_reply
    finally:
        for agent, token, lease_id in holds:
            agent.call("DELETE", f"/api/v1/leases/{lease_id}", token=token)
        kernel.close()


def row(mb: int, results: list[tuple[float, float, float, float]]) -> str:
    """One table row from trials of (start no move, start after a move, reply after, reply no move)."""
    def median(i: int) -> float:
        return statistics.median(r[i] for r in results)
    return (f"| {mb} MB | {len(results)} | {median(0) * 1000:.0f} ms | {median(1):.2f} s "
            f"(min {min(r[1] for r in results):.2f}, max {max(r[1] for r in results):.2f}) | "
            f"{median(3):.2f} s | {median(2):.2f} s |")


def table(title: str, command: list[str], rows: list[str]) -> str:
    return "\n".join([
        f"### {title}", "", *command, "",
        "| state | trials | start, no move (p50) | start after a move (p50) | reply, no move (p50) "
        "| reply after a move (p50) |",
        "|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in SIZES_MB:
            cluster = DevCluster(Path(tmp) / f"m{mb}", nodes=4, gpus_per_node=1).start()
            try:
                rows.append(row(mb, [trial(cluster, mb) for _ in range(TRIALS[mb])]))
            finally:
                cluster.stop()
    return table("Migration: submit → cell start when every server of the kernel is busy", [
        "Command: `.venv/bin/python -m bench migration` (development harness: four single-GPU fake",
        "servers, one replica process per server, all on this machine)."], rows)


if __name__ == "__main__":
    print(main())
