"""Kernel start: a replicated CPU kernel (3 replicas, dev harness) vs a plain ipykernel, until each
answers kernel_info. Run: `.venv/bin/python -m bench start`.

Both are timed the same way, the way a Jupyter server meets a new kernel: from the request to start
it until the reply to a ``kernel_info_request`` sent right away (the router holds it until the
replicas are up; a plain kernel's socket queues it until the kernel binds). The gpuhub figure covers
what the provisioner does: the scheduler places three replicas, their agents start them, the router
connects to them.

On a machine with fewer cores than replicas the three replicas' start-up work queues for the CPU, so
the benchmark also reports the CPU time each kernel process had used when it answered: on a cluster
each replica starts on its own server, where its CPU time, not the sum, bounds the start.
Starts alternate between the two kinds so machine noise hits both.
"""

from __future__ import annotations

import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from jupyter_client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from gpuhub.dev.cluster import DevCluster, LoopThread
from gpuhub.server.router import KernelRouter

STARTS = 6
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def first_reply(kc: BlockingKernelClient, timeout_s: float = 60) -> None:
    msg_id = kc.kernel_info()
    deadline = time.monotonic() + timeout_s
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return


def start_gpuhub(cluster: DevCluster) -> tuple[float, list[float], object]:
    """Seconds until the replicated kernel answered, each replica's CPU seconds then, and a closer."""
    t0 = time.monotonic()
    key = secrets.token_hex(16)
    status, record = cluster.scheduler_call("POST", "/api/v1/kernels", {
        "kernel_id": "bench-" + secrets.token_hex(5), "key": key, "gpus": 0, "replicas": 3, "cwd": os.getcwd()})
    if status not in (200, 201):
        raise RuntimeError(f"the scheduler refused the kernel: {record}")
    loop = LoopThread()
    router = KernelRouter([{"id": r["id"], **r["connection"]} for r in record["replicas"]], key.encode())
    kc = BlockingKernelClient()
    kc.load_connection_info({**loop.run(router.start()), "key": key.encode()})
    kc.start_channels()
    first_reply(kc)
    took = time.monotonic() - t0
    cpu = []
    for r in record["replicas"]:
        _, unit = cluster.agent(r["node"]).call("GET", f"/api/v1/units/{r['unit']}")
        cpu.append(cpu_s(unit["main_pid"]))

    def close() -> None:
        kc.stop_channels()
        loop.run(router.stop())
        loop.close()
        cluster.scheduler_call("DELETE", f"/api/v1/kernels/{record['kernel_id']}")

    return took, cpu, close


def start_plain() -> tuple[float, float]:
    t0 = time.monotonic()
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        first_reply(kc)
        took = time.monotonic() - t0
        return took, cpu_s(km.provisioner.process.pid)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> str:
    gpuhub, plain, replica_cpu, plain_cpu = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="gpuhub-bench-") as tmp:
        cluster = DevCluster(Path(tmp), nodes=3, gpus_per_node=1).start()
        try:
            for _ in range(STARTS):
                took, cpu, close = start_gpuhub(cluster)
                close()
                gpuhub.append(took)
                replica_cpu += cpu
                took, cpu1 = start_plain()
                plain.append(took)
                plain_cpu.append(cpu1)
        finally:
            cluster.stop()
    g, p = statistics.median(gpuhub), statistics.median(plain)
    rc, pc = statistics.median(replica_cpu), statistics.median(plain_cpu)
    return "\n".join([
        "## Kernel start (issue #10)", "",
        f"Command: `.venv/bin/python -m bench start` ({STARTS} starts each, alternating; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end).", "",
        "| kernel | until kernel_info answered, median | all | CPU s per process when it answered, median |",
        "|---|---|---|---|",
        f"| gpuhub CPU kernel, 3 replicas | {g:.2f} s | {', '.join(f'{x:.2f}' for x in gpuhub)} "
        f"| {rc:.2f} (each replica) |",
        f"| plain ipykernel | {p:.2f} s | {', '.join(f'{x:.2f}' for x in plain)} | {pc:.2f} |",
        "", f"Ratio: {g / p:.2f}× (goal ≤ 1.5×). CPU per replica ÷ plain: {rc / pc:.2f}×; three replicas "
        f"need {3 * rc:.2f} CPU s, {3 * rc / (os.cpu_count() or 1):.2f} s of this machine's cores at best.", ""])


if __name__ == "__main__":
    print(main())
