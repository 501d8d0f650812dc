"""What a namespace's size costs each cell: inline in the Raft log, or a blob beside it.

Run: `.venv/bin/python -m bench.image_size_bench [PAD_BYTES [CELLS]]` (defaults 30000, 200). A
3-replica CPU kernel on a local :class:`~gpuhub.dev.cluster.DevCluster`; a setup cell puts
``pad = bytes(PAD_BYTES)`` in the namespace (in-band, so the image's stream is about that large),
then ``i += 1`` runs ``CELLS`` times after 20 untimed ones. Each cell changes the namespace, so
each commits a new image of that size. Prints the p50 round trip and the CPU time per cell of each
replica, highest first (the executor's, which captures, seals and pushes the image), and of this
process (client and router).

To compare two commits, run it from a ``git worktree`` of each, alternating: the replicas are
``python -m gpuhub.kernel`` started in the kernel's working directory, so they run that tree's code.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.replicated_bench import cell, setup
from gpuhub.dev.cluster import DevCluster, DevKernel


def cpu_seconds(pid: int | str) -> float:
    """CPU seconds (user + system) of a process, or of one thread given as ``"PID/task/TID"``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_kernel():
    """A 3-replica CPU kernel on a local DevCluster of its own, stopped with it whatever fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = DevCluster(Path(tmp) / "c", nodes=3, gpus_per_node=1)
        kernel = None
        try:
            cluster.start()
            kernel = DevKernel(cluster, gpus=0)
            yield kernel
        finally:
            try:
                if kernel is not None:
                    kernel.close()
            finally:
                cluster.stop()


def run(pad: int = 30_000, cells: int = 200) -> dict:
    with cpu_kernel() as kernel:
        setup(kernel.kc, f"pad = bytes({pad})\ni = 0")
        for _ in range(20):
            cell(kernel.kc, "i += 1")
        pids = [kernel.pid(r["id"]) for r in kernel.record["replicas"]]
        before, mine = [cpu_seconds(p) for p in pids], time.process_time()
        times = [cell(kernel.kc, "i += 1")[0] for _ in range(cells)]
        after, mine = [cpu_seconds(p) for p in pids], time.process_time() - mine
    return {"p50_ms": statistics.median(times) * 1e3,
            "replica_cpu_ms": [(b - a) / cells * 1e3 for a, b in zip(before, after, strict=True)],
            "client_cpu_ms": mine / cells * 1e3}


def main(args: list[str] | tuple[str, ...] = ()) -> str:
    pad = int(args[0]) if args else 30_000
    cells = int(args[1]) if len(args) > 1 else 200
    r = run(pad, cells)
    cpu = ", ".join(f"{c:.1f}" for c in sorted(r["replica_cpu_ms"], reverse=True))
    return (f"`pad = bytes({pad})`, `i += 1` × {cells}: p50 {r['p50_ms']:.1f} ms; CPU per cell: replicas {cpu} ms, "
            f"client and router {r['client_cpu_ms']:.1f} ms\n"
            f"(`.venv/bin/python -m bench.image_size_bench {pad} {cells}`)")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
