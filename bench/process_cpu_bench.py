"""CPU time per no-op cell, by process: each replica of a 3-replica CPU kernel against a plain ipykernel.

Run: `.venv/bin/python -m bench.process_cpu_bench [CELLS]` (default 500). A 3-replica CPU kernel
on a local :class:`~gpuhub.dev.cluster.DevCluster` and a plain ipykernel each run 30 untimed cells
``x = 1``, then ``CELLS`` timed ones (the replicated kernel's, then the plain one's: CPU time is
read per process around each run, from ``/proc/PID/stat``). The namespace does not change, so no
image is committed: what shows is each process's share of a cell's path (the executor's run and
commit, a follower's request path and apply, the router in this process beside the client).

To compare two commits, run it from a ``git worktree`` of each, alternating: the replicas are
``python -m gpuhub.kernel`` started in the kernel's working directory, so they run that tree's code.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from bench.image_size_bench import cpu_kernel, cpu_seconds
from bench.replicated_bench import cell, plain_kernel

WARMUP = 30


def timed(kc, cells: int, pids: list) -> tuple[list[float], list[float], float]:
    """``cells`` cells ``x = 1``: their round trips, the CPU seconds of each of ``pids`` (a pid, or
    ``"PID/task/TID"`` for one thread), and this process's."""
    before, mine = [cpu_seconds(p) for p in pids], time.process_time()
    times = [cell(kc, "x = 1")[0] for _ in range(cells)]
    after, mine = [cpu_seconds(p) for p in pids], time.process_time() - mine
    return times, [b - a for a, b in zip(before, after, strict=True)], mine


def run(cells: int = 500) -> dict:
    manager, plain = plain_kernel()
    try:  # the plain kernel stopped whatever fails, its channels first
        with cpu_kernel() as kernel:
            for _ in range(WARMUP):
                cell(kernel.kc, "x = 1")
                cell(plain, "x = 1")
            pids = [kernel.pid(r["id"]) for r in kernel.record["replicas"]]
            router_thread = f"{os.getpid()}/task/{kernel.loop.thread.native_id}"  # /proc/PID/task/TID/stat
            ours, (*replica_cpu, router_cpu), ours_here = timed(kernel.kc, cells, [*pids, router_thread])
            anchor, (plain_cpu,), anchor_here = timed(plain, cells, [manager.provisioner.process.pid])
    finally:
        try:
            plain.stop_channels()
        finally:
            manager.shutdown_kernel(now=True)
    per_cell = 1e3 / cells
    return {"p50_ms": statistics.median(ours) * 1e3, "plain_p50_ms": statistics.median(anchor) * 1e3,
            "replica_cpu_ms": sorted((c * per_cell for c in replica_cpu), reverse=True),
            "plain_cpu_ms": plain_cpu * per_cell, "router_thread_cpu_ms": router_cpu * per_cell,
            "router_and_client_cpu_ms": ours_here * per_cell, "client_cpu_ms": anchor_here * per_cell}


def main(args: list[str] | tuple[str, ...] = ()) -> str:
    cells = int(args[0]) if args else 500
    r = run(cells)
    plain = r["plain_cpu_ms"]
    replicas = ", ".join(f"{c:.2f} ({c / plain:.2f}×)" for c in r["replica_cpu_ms"])
    return (f"`x = 1` × {cells}: p50 {r['p50_ms']:.1f} ms, plain {r['plain_p50_ms']:.1f} ms "
            f"({r['p50_ms'] / r['plain_p50_ms']:.2f}×); CPU per cell: replicas {replicas} ms (executor first; "
            f"× a plain ipykernel's {plain:.2f} ms), router and client {r['router_and_client_cpu_ms']:.2f} ms "
            f"(the router's thread {r['router_thread_cpu_ms']:.2f} ms) "
            f"(the client alone, with the plain kernel: {r['client_cpu_ms']:.2f} ms)\n"
            f"(`.venv/bin/python -m bench.process_cpu_bench {cells}`)")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
