"""The GPU path on a real GPU (G1–G4): gpuhub kernels vs a plain ipykernel on the same device.

Run on a machine with an NVIDIA GPU and PyTorch: `.venv/bin/python -m bench gpu`. Without a GPU
it says so and measures nothing; `.venv/bin/python -m bench.gpu_bench --fake` runs the same cells
with fake GPUs and torch on the CPU, to try the script itself.

A ``DevCluster`` whose three agents serve the machine's GPUs through NVML (one machine plays three
servers) places 3-replica kernels; the anchor is a plain ipykernel that sees the same GPU. Cells
of the kernels alternate in rounds (``bench.replicated_bench.interleaved``):

- G1: ``x = 1`` on a CPU kernel, a GPU kernel and plain (the GPU kernel takes a grant and forks a
  child per cell, but the cell touches no GPU).
- G2: the same with ``big`` (1 GiB of numpy) in every namespace: GPU cell minus CPU cell.
- G3: ``v = float((w @ w).norm())`` with ``w``, a 4096×4096 float32 CUDA tensor, in the namespace:
  each gpuhub cell runs in a fresh child, which creates its CUDA context and puts ``w`` back on
  the GPU before the cell.
- G4: 25 training steps of a small MLP with Adam on the GPU (tests/integration/test_real_gpu.py).

After each part the GPU's used memory is read (NVML): a cell's child frees what it held.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.replicated_bench import cell, interleaved, machine, ms, plain_kernel, progress, row, setup
from gpuhub.dev.cluster import DevCluster, DevKernel
from gpuhub.gpus.nvml import NvmlInventory, NvmlUnavailable

BIG = "import numpy as np\nbig = np.ones(1 << 27)  # 1 GiB of float64"
TORCH = "import torch\ndev = 'cuda' if torch.cuda.is_available() else 'cpu'"
MATMUL_SETUP = TORCH + "\ntorch.manual_seed(0)\nw = torch.randn(4096, 4096, device=dev)"
MATMUL = "v = float((w @ w).norm())"
TRAIN_SETUP = TORCH + """
torch.manual_seed(0)
X = torch.randn(512, 32, device=dev)
y = X @ torch.randn(32, 1, device=dev)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()"""
TRAIN = "loss = train(25)"
N_SMALL, N_TORCH = int(os.environ.get("GPUHUB_BENCH_CELLS", 200)), 30


def gpu_used_mib() -> str:
    try:
        inv = NvmlInventory()
    except NvmlUnavailable:
        return "n/a"
    return ", ".join(f"{g.memory_used_bytes / 2**20:.0f} MiB" for g in inv.gpus())


def nvml_gpus() -> list:
    try:
        return NvmlInventory().gpus()
    except NvmlUnavailable:
        return []


def run(tmp: Path, fake: bool) -> tuple[dict, list[str]]:
    results: dict = {}
    notes: list[str] = []
    agents = {} if fake else {"agent_settings": {"gpus": {"backend": "nvml"}}}
    cluster = DevCluster(tmp / "cluster", nodes=3, gpus_per_node=1 if fake else 0, **agents).start()
    km, plain = plain_kernel()
    cpu = gpu = None
    try:
        cpu, gpu = DevKernel(cluster, gpus=0), DevKernel(cluster, gpus=1)
        notes.append(f"GPU memory used before: {gpu_used_mib()}")
        t = interleaved({"cpu": cpu.kc, "gpu": gpu.kc, "plain": plain},
                        "x = 1", n=N_SMALL)
        results["G1-cpu"] = row("G1 `x = 1`, CPU kernel", t["cpu"], t["plain"])
        results["G1-gpu"] = row("G1 `x = 1`, GPU kernel", t["gpu"], t["plain"])
        results["G1-gpu-cpu"] = statistics.median(t["gpu"]) - statistics.median(t["cpu"])

        for k in (cpu, gpu):
            s, aborts = setup(k.kc, BIG)
            notes.append(f"1 GiB `big` set up in {s:.1f} s" + (f" after {aborts}" if aborts else ""))
        cell(plain, BIG)
        t = interleaved({"cpu": cpu.kc, "gpu": gpu.kc, "plain": plain}, "x = 1", n=N_SMALL)
        results["G2-cpu"] = row("G2 `x = 1`, CPU kernel, 1 GiB `big`", t["cpu"], t["plain"])
        results["G2-gpu"] = row("G2 `x = 1`, GPU kernel, 1 GiB `big`", t["gpu"], t["plain"])
        results["G2-gpu-cpu"] = statistics.median(t["gpu"]) - statistics.median(t["cpu"])
        for kc in (cpu.kc, gpu.kc, plain):
            cell(kc, "del big")

        s, aborts = setup(gpu.kc, MATMUL_SETUP)
        notes.append(f"first torch cell of the GPU kernel (imports torch, creates `w` on the GPU): {s:.1f} s")
        cell(plain, MATMUL_SETUP)
        t = interleaved({"gpu": gpu.kc, "plain": plain}, MATMUL, n=N_TORCH, warmup=3)
        results["G3"] = row("G3 4096² matmul on the GPU, `w` (64 MiB) in the namespace", t["gpu"], t["plain"])
        notes.append(f"GPU memory used after G3: {gpu_used_mib()}")

        setup(gpu.kc, TRAIN_SETUP)
        cell(plain, TRAIN_SETUP)
        t = interleaved({"gpu": gpu.kc, "plain": plain}, TRAIN, n=N_TORCH, warmup=3)
        results["G4"] = row("G4 25 training steps (MLP, Adam) on the GPU", t["gpu"], t["plain"])
        notes.append(f"GPU memory used after G4: {gpu_used_mib()}")
    finally:
        for k in (cpu, gpu):
            if k is not None:
                k.close()
        plain.stop_channels()
        km.shutdown_kernel(now=True)
        cluster.stop()
    notes.append(f"GPU memory used after the kernels stopped: {gpu_used_mib()}")
    return results, notes


def table(results: dict, notes: list[str], command: str) -> str:
    gpus = nvml_gpus()
    device = ", ".join(sorted({g.name for g in gpus})) or "fake GPUs, torch on the CPU"
    lines = [
        "## The GPU path on a real GPU (G1–G4)",
        "",
        f"Command: `{command}` — {device}; {machine()}.",
        "",
        "| figure | gpuhub | plain ipykernel (same run) | result |",
        "|---|---|---|---|",
    ]
    for key in ("G1-cpu", "G1-gpu", "G2-cpu", "G2-gpu", "G3", "G4"):
        r = results.get(key)
        if r is None:
            continue
        lines.append(f"| {r['label']} (n={r['n']}) | p50 {ms(r['p50'])} ms, p99 {ms(r['p99'])} ms "
                     f"| p50 {ms(r['anchor_p50'])} ms, p99 {ms(r['anchor_p99'])} ms "
                     f"| {r['ratio']:.2f}× plain, +{ms(r['extra'])} ms |")
    for key, label in (("G1-gpu-cpu", "G1"), ("G2-gpu-cpu", "G2")):
        if key in results:
            lines.append(f"| {label}: GPU cell minus CPU cell (p50) | {ms(results[key])} ms | — | "
                         f"goal ≤ 10 ms{'' if label == 'G1' else ' (1 GiB namespace)'} |")
    return "\n".join([*lines, "", *(f"- {n}" for n in notes)]) + "\n"


def main(argv: list[str] | None = None) -> str:
    fake = "--fake" in (argv or [])
    if not fake and not nvml_gpus():
        return "## The GPU path on a real GPU (G1–G4)\n\nNot measured: NVML finds no GPU on this machine.\n"
    command = ".venv/bin/python -m bench.gpu_bench --fake" if fake else ".venv/bin/python -m bench gpu"
    progress("starting a DevCluster on " + ("fake GPUs" if fake else "the real GPUs"))
    with tempfile.TemporaryDirectory(prefix="gpuhub-gpu-bench-") as tmp:
        results, notes = run(Path(tmp), fake)
    return table(results, notes, command)


if __name__ == "__main__":
    print(main(sys.argv[1:]), flush=True)
