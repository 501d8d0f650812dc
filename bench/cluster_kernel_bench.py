"""B1, B2, B3 and B5 on the podman test cluster, as a notebook meets them: cells sent over Jupyter
Server's websocket, through JupyterHub's proxy, to gpuhub kernels whose three replicas run as systemd
units, one per GPU-server container; the anchor is a plain ipykernel (the ``python3`` kernelspec) in
the same user's server, its cells interleaved with the measured kernel's so that machine noise hits
both. The same figures on loopback processes are ``bench.replicated_bench``.

- K1: ``x = 1``, CPU kernel (``gpuhub-cpu``) vs plain, p50/p99.
- K2: ``x = 1``, one-GPU kernel (``gpuhub-gpu1``, fake GPUs) vs plain; K2t: with 1 GiB ``big`` in both
  namespaces and 0.2 s before each cell (a user reading the output).
- K5t: ``pass``, CPU kernel, 1 GiB ``big`` in both, 0.2 s before each cell.
- K3: ``big += 1`` (1 GiB), CPU kernel, 3 s before each cell; GB/s = 2**30 / (extra over plain).

Run on a cluster whose kernels have numpy and room for a new 1 GiB array in a GPU cell (held twice
while handed back: the test cluster's 2 GiB kernel limit is too small)::

    echo numpy > /tmp/extra.txt
    GPUHUB_GPU_NODES=3 scripts/cluster.sh up kb
    GPUHUB_GPU_NODES=3 GPUHUB_ANSIBLE_ARGS="-e gpuhub_python_extra_requirements=/tmp/extra.txt \\
        -e gpuhub_agent_kernel_memory_max=8G" scripts/cluster.sh deploy kb
    GPUHUB_CLUSTER=kb .venv/bin/python -m bench cluster-kernel

GPUHUB_BENCH_CELLS sets the cells of K1 and K2 per kernel (default 100).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import replicated_bench
from bench.load_bench import pct

CELLS = int(os.environ.get("GPUHUB_BENCH_CELLS", "100"))
WARMUP = 10
ROUNDS = 4
BIG = "import numpy as np\nbig = np.ones(1 << 27)  # 1 GiB of float64"
THINK_S = 0.2
THINK_CELLS = 40
B3_CELLS = 5
B3_THINK_S = 3.0
TIMEOUT_S = 600
USER = "alice"


def progress(text: str) -> None:
    print(f"[cluster-kernel {time.strftime('%H:%M:%S')}] {text} (load {os.getloadavg()[0]:.1f})",
          file=sys.stderr, flush=True)


def timed_cell(channel, code: str) -> float:
    """Seconds from sending ``code`` to its execute_reply and the idle after it (what
    jupyter_client's execute_interactive waits for); a failed cell stops the benchmark."""
    t0 = time.perf_counter()
    msg_id = channel.send_execute(code)
    reply, idle, errors = None, False, ""
    deadline = time.monotonic() + TIMEOUT_S
    while not (reply and idle):
        channel.ws.settimeout(max(1.0, deadline - time.monotonic()))
        msg = json.loads(channel.ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg.get("content", {})
        if kind == "execute_reply":
            reply = content
        elif kind == "status":
            idle = content.get("execution_state") == "idle"
        elif kind == "error" or (kind == "stream" and content.get("name") == "stderr"):
            errors += content.get("text", "") or "\n".join(content.get("traceback", []))
    elapsed = time.perf_counter() - t0
    if reply.get("status") != "ok":
        raise SystemExit(f"bench cluster-kernel: the cell {code!r} failed: {errors[-1500:] or reply}")
    return elapsed


def interleaved(channels: dict, code: str, n: int, warmup: int = WARMUP, think_s: float = 0.0,
                rounds: int = ROUNDS) -> dict[str, list[float]]:
    return replicated_bench.interleaved(channels, code, n, warmup, rounds, think_s, timed=timed_cell)


def row(label: str, times: list[float], anchor: list[float]) -> dict:
    p50, a50 = statistics.median(times), statistics.median(anchor)
    r = {"label": label, "p50": p50, "p99": pct(times, 0.99), "anchor_p50": a50, "anchor_p99": pct(anchor, 0.99),
         "n": len(times)}
    progress(f"{label}: p50 {p50 * 1e3:.1f} ms, p99 {r['p99'] * 1e3:.1f} ms; plain {a50 * 1e3:.1f} / "
             f"{r['anchor_p99'] * 1e3:.1f} ms")
    return r


class Kernels:
    """A plain ipykernel and one gpuhub kernel in the user's server (a server offers the kernelspec of
    its own profile and ``python3``), each with its websocket; shut down on leaving."""

    def __init__(self, user, profile: str):
        self.user, self.ids, self.channels = user, {}, {}
        user.start_server(profile)
        try:
            for name, spec in (("plain", "python3"), ("gpuhub", f"gpuhub-{profile}")):
                self.ids[name] = user.start_kernel(spec)
                self.channels[name] = user.kernel(self.ids[name])
        except BaseException:
            self.__exit__()
            raise
        progress(f"server with profile {profile}, kernels {self.ids}")

    def __enter__(self) -> dict:
        return self.channels

    def __exit__(self, *exc) -> None:
        try:
            for ch in self.channels.values():
                ch.close()
            for kid in self.ids.values():
                self.user.api("DELETE", f"/user/{self.user.name}/api/kernels/{kid}")
        finally:
            self.user.stop_server()  # its replicas give their memory back before the next profile's


def measure(user) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    with Kernels(user, "gpu1") as ch:
        t = interleaved(ch, "x = 1", CELLS)
        rows["K2"] = row("K2 `x = 1`, GPU kernel", t["gpuhub"], t["plain"])
        for c in ch.values():
            timed_cell(c, BIG)
        t = interleaved(ch, "x = 1", THINK_CELLS, warmup=3, think_s=THINK_S)
        rows["K2t"] = row(f"K2t `x = 1`, GPU kernel, 1 GiB `big`, {THINK_S:g} s between cells", t["gpuhub"],
                          t["plain"])
    with Kernels(user, "cpu") as ch:
        t = interleaved(ch, "x = 1", CELLS)
        rows["K1"] = row("K1 `x = 1`, CPU kernel", t["gpuhub"], t["plain"])
        for c in ch.values():
            timed_cell(c, BIG)
        t = interleaved(ch, "pass", THINK_CELLS, warmup=3, think_s=THINK_S)
        rows["K5t"] = row(f"K5t `pass`, CPU kernel, 1 GiB `big`, {THINK_S:g} s between cells", t["gpuhub"],
                          t["plain"])
        t = interleaved(ch, "big += 1", B3_CELLS, warmup=1, think_s=B3_THINK_S, rounds=1)
        rows["K3"] = row(f"K3 `big += 1` (1 GiB), CPU kernel, {B3_THINK_S:g} s between cells", t["gpuhub"],
                         t["plain"])
    return rows


def report(cluster_name: str, nodes: int, rows: dict[str, dict]) -> str:
    def ms(s: float) -> str:
        return f"{s * 1e3:.1f}"

    lines = [
        "### Replicated kernels on the podman test cluster, through the hub",
        "",
        f"`GPUHUB_CLUSTER={cluster_name} .venv/bin/python -m bench cluster-kernel` ({time.strftime('%Y-%m-%d')}, "
        f"{platform.node()}, {os.cpu_count()} cores, hub and {nodes} GPU servers in podman containers; "
        "every cell over Jupyter Server's websocket through the hub's proxy; anchor: a plain ipykernel in the "
        "same user's server, cells interleaved)",
        "",
        "| figure | gpuhub p50 / p99 ms | plain p50 / p99 ms | p50 ratio | p50 extra |",
        "|---|---|---|---|---|",
    ]
    for r in rows.values():
        ratio, extra = r["p50"] / r["anchor_p50"], r["p50"] - r["anchor_p50"]
        lines.append(f"| {r['label']} ({r['n']} cells) | {ms(r['p50'])} / {ms(r['p99'])} | "
                     f"{ms(r['anchor_p50'])} / {ms(r['anchor_p99'])} | {ratio:.2f}× | +{ms(extra)} ms |")
    if "K3" in rows:
        extra = rows["K3"]["p50"] - rows["K3"]["anchor_p50"]
        lines += ["", f"K3: a changed GiB reaches the followers at {(1 << 30) / extra / 1e9:.2f} GB/s "
                      f"(2**30 bytes / {extra:.2f} s of extra time)."]
    return "\n".join(lines)


def main() -> str:
    from tests.cluster.conftest import load_cluster
    from tests.cluster.test_e2e import HubUser, every_gpu_node_heartbeats

    with tempfile.TemporaryDirectory() as tmp:
        cluster = load_cluster(Path(tmp))
        if isinstance(cluster, str):
            raise SystemExit(f"bench cluster-kernel: {cluster}")
        if USER not in cluster.passwords:
            raise SystemExit(f"bench cluster-kernel: the cluster has no user {USER!r}")
        every_gpu_node_heartbeats(cluster)
        user = HubUser(cluster, USER)
        user.login()
        rows = measure(user)
        return report(cluster.name, len(cluster.groups["gpu_nodes"]), rows)


if __name__ == "__main__":
    print(main())
