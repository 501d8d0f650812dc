"""Kernel cell round trip: gpuhub kernels (CPU, and GPU with a per-cell grant + fork) vs a plain ipykernel.

Run: `make bench` (or `.venv/bin/python -m bench kernel`). Everything runs on 127.0.0.1 with real
processes: a gpuhub-agent with fake GPUs starts the gpuhub kernels; the anchor is ipykernel started
by jupyter_client in the same run. Quoted: median and p99 of `execute_interactive("x = 1")`.
"""

from __future__ import annotations

import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jupyter_client import BlockingKernelClient, KernelManager

from gpuhub.dev.cluster import AgentProcess, current_user
from gpuhub.platform.curve import with_keys

CELLS = 200
WARMUP = 10


def measure(kc: BlockingKernelClient, code: str = "x = 1") -> list[float]:
    for _ in range(WARMUP):
        kc.execute_interactive(code, timeout=30)
    times = []
    for _ in range(CELLS):
        t0 = time.perf_counter()
        reply = kc.execute_interactive(code, timeout=30)
        times.append(time.perf_counter() - t0)
        assert reply["content"]["status"] == "ok"
    return times


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def gpuhub_kernel(agent: AgentProcess, name: str, gpus: int) -> BlockingKernelClient:
    key = secrets.token_hex(16)
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": gpus,
        "kernel": {"key": key, "kernel_id": name}})
    if status != 201:
        raise RuntimeError(unit)
    conn = unit["connection"]
    status, body = agent.call("PUT", f"/api/v1/units/{name}/peers", {"replicas": [{  # a group of one
        "id": 0, "node": agent.name, "raft": f"{conn['ip']}:{conn['raft_port']}",
        "blob": f"{conn['ip']}:{conn['blob_port']}"}]})
    if status != 200:
        raise RuntimeError(body)
    deadline = time.monotonic() + 60
    while True:  # the kernel's heartbeat may not be up yet ("died before replying"): connect again
        kc = BlockingKernelClient()
        kc.load_connection_info(with_keys(unit["connection"], key))
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            return kc
        except RuntimeError:
            kc.stop_channels()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        km = KernelManager(kernel_name="python3")
        km.start_kernel()
        plain = km.client()
        plain.start_channels()
        plain.wait_for_ready(timeout=60)
        agent = AgentProcess(Path(tmp), "bench", gpus=2).start()
        try:
            kernels = {
                "plain ipykernel (anchor)": plain,
                "gpuhub CPU kernel": gpuhub_kernel(agent, "gpuhub-kernel-bench-cpu", 0),
                "gpuhub 1-GPU kernel (grant + fork + delta + release)":
                    gpuhub_kernel(agent, "gpuhub-kernel-bench-gpu", 1),
            }
            results = {label: measure(kc) for label, kc in kernels.items()}
            for kc in kernels.values():
                kc.stop_channels()
        finally:
            agent.close()
            km.shutdown_kernel(now=True)
    anchor = statistics.median(results["plain ipykernel (anchor)"])
    for label, times in results.items():
        med = statistics.median(times)
        rows.append(f"| {label} | {med * 1000:.2f} | {pct(times, 0.99) * 1000:.2f} | {med / anchor:.2f}× |")
    return "\n".join([
        "## Kernel cell round trip (issue #2)",
        "",
        f"`make bench` → `python -m bench kernel`; {CELLS} cells of `x = 1` after {WARMUP} warm-up, "
        "same run, this machine.",
        "",
        "| kernel | p50 ms | p99 ms | p50 vs anchor |",
        "|---|---|---|---|",
        *rows,
        "",
    ])


if __name__ == "__main__":
    print(main())
    sys.exit(0)
