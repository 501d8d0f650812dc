"""Kernel start: a replicated CPU kernel (3 replicas, dev harness) vs a plain ipykernel, until each
answers kernel_info. Run: `.venv/bin/python -m bench start`.

The gpuhub figure covers what the provisioner does: the scheduler places three replicas, their
agents start them, the router waits until they are connected and the kernel answers kernel_info
through it. Starts alternate between the two kinds so machine noise hits both.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from jupyter_client.manager import start_new_kernel

from gpuhub.dev.cluster import DevCluster, DevKernel

STARTS = 6


def main() -> str:
    gpuhub, plain = [], []
    with tempfile.TemporaryDirectory(prefix="gpuhub-bench-") as tmp:
        cluster = DevCluster(Path(tmp), nodes=3, gpus_per_node=1).start()
        try:
            for _ in range(STARTS):
                t0 = time.monotonic()
                kernel = DevKernel(cluster, gpus=0)
                gpuhub.append(time.monotonic() - t0)
                kernel.close()
                t0 = time.monotonic()
                km, kc = start_new_kernel(kernel_name="python3")
                plain.append(time.monotonic() - t0)
                kc.stop_channels()
                km.shutdown_kernel(now=True)
        finally:
            cluster.stop()
    g, p = statistics.median(gpuhub), statistics.median(plain)
    return "\n".join([
        "## Kernel start (issue #10)", "",
        f"Command: `.venv/bin/python -m bench start` ({STARTS} starts each, alternating).", "",
        "| kernel | median | all |", "|---|---|---|",
        f"| gpuhub CPU kernel, 3 replicas | {g:.2f} s | {', '.join(f'{x:.2f}' for x in gpuhub)} |",
        f"| plain ipykernel | {p:.2f} s | {', '.join(f'{x:.2f}' for x in plain)} |",
        "", f"Ratio: {g / p:.2f}× (goal ≤ 1.5×).", ""])


if __name__ == "__main__":
    print(main())
