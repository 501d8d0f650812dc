"""Replicated kernels (B1–B7): three replicas behind the router vs a plain ipykernel, on loopback.

Run: `make bench` (all benchmarks) or `.venv/bin/python -m bench replicated`; one part only:
`.venv/bin/python -m bench.replicated_bench B2` (B1 … B7, comma- or space-separated).

Everything is real processes on 127.0.0.1: a ``DevCluster`` (scheduler + 3 agents, 1 fake GPU
each) places a 3-replica kernel, a ``KernelRouter`` in this process shows it as one kernel, and a
``BlockingKernelClient`` times ``execute_interactive`` (execute_request → reply + idle). The
anchor, a plain ipykernel (``python -m ipykernel_launcher`` via jupyter_client), runs in the same
run, its cells interleaved with the measured kernel's in rounds so that machine noise hits both.

- B1: ``x = 1`` on a CPU kernel (gpus=0) vs plain: p50/p99 over 200 cells after 20 warm-up.
- B2: ``x = 1`` on a GPU kernel (gpus=1, fake GPUs), without and with ``big = np.ones(1 << 27)``
  (1 GiB) in both namespaces: p50 minus plain's p50. B2t: the same with 0.2 s before each cell
  (a user reading the output): the next cell's process, forked after a reply, is ready by then.
- B3: a changed 1 GiB array to both followers: (a) transport only, ``bench.blob_bench`` (1 GiB
  to 2 peers); (b) end to end, ``big += 1`` on the CPU kernel minus the same cell on plain;
  GB/s = 2**30 bytes / that extra time (GB = 1e9 bytes); back to back, then (B3bt) with 3 s
  before each cell, so that what goes on after a reply is done before the next cell; (B3g) as B3bt
  on a GPU kernel (fake GPU), whose cell runs in a forked child that sends the array back.
- B5: ``pass`` on a CPU kernel with ``big`` (1 GiB) in both namespaces vs plain: the cost of a
  cell that changes nothing in a large namespace (issue: a faithful replicated kernel; goal
  ≤ 1.5× plain). Every cell captures the namespace image; without page tracking each large
  buffer is hashed once per cell. B5t: the same with 0.2 s before each cell (a user reading the
  output): work a kernel does between cells (arming the next cell's write tracker) is off the clock.
- B6: B1 again after 3,000 more cells on both kernels (a long session): a per-cell cost that
  grows with the session (IPython keeps every cell's input as a name, ``_i2999``) shows here.
- B7: B1 again with a notebook's results kept in ``Out`` on both kernels: 200 ``df.head()`` of a
  1,000-row frame and 40 ``plt.plot(...)`` (each ``[Line2D]`` holds its whole figure). Results
  are pickled once, by the cell that made them (gpuhub/kernel/sealed_outputs.py); before that,
  every later cell pickled them all again. B7c: ``i += 1`` after them, a cell that changes the
  namespace, so every replica that loads its image (both followers) gets one; B7g: the same on
  a GPU kernel, whose replica loads its cell's image from the child before the reply.
- B4: SIGKILL an idle (non-executor) replica and its node's agent, then time the next cell;
  median over 5 fresh kernels (each on a fresh DevCluster).
"""

from __future__ import annotations

import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_client import BlockingKernelClient, KernelManager

from bench.kernel_bench import pct
from gpuhub.dev.cluster import DevCluster, DevKernel

CELLS = 200
WARMUP = 20
ROUNDS = 4  # the timed cells alternate between kernels in this many blocks
BIG = "import numpy as np\nbig = np.ones(1 << 27)  # 1 GiB of float64"
GIB = 1 << 30
B3_CELLS = 5
B3_THINK_S = 3.0
B4_KERNELS = 5
PARTS = ("B1", "B2", "B3", "B4", "B5", "B6", "B7")
B6_DEPTH = 3000
B7_SETUP = ("import numpy as np, pandas as pd\nimport matplotlib.pyplot as plt\n"
            "df = pd.DataFrame({'a': np.arange(1000), 'b': np.arange(1000) / 3})")
B7_RESULTS = ["df.head()"] * 200 + ["plt.plot(np.arange(100) % 7)"] * 40
B7C_CELLS = 60
B5_CELLS = 30
B5_THINK_S = 0.2
B2T_CELLS = 60
B2_THINK_S = 0.2


def cell(kc: BlockingKernelClient, code: str, timeout: float = 120) -> tuple[float, dict]:
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    elapsed = time.perf_counter() - t0
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell {code!r} failed: {reply['content']}")
    return elapsed, reply


def setup(kc: BlockingKernelClient, code: str, tries: int = 3) -> tuple[float, list[str]]:
    """Run a setup cell, retrying a cell the kernel aborted; returns (seconds, abort messages)."""
    aborts = []
    for _ in range(tries):
        t0 = time.perf_counter()
        reply = kc.execute_interactive(code, timeout=900, output_hook=lambda msg: None)
        content = reply["content"]
        if content["status"] == "ok":
            return time.perf_counter() - t0, aborts
        aborts.append(f"{content.get('ename')}: {content.get('evalue')} (after {time.perf_counter() - t0:.0f} s)")
        if content.get("ename") not in ("ExecutorLost", "GpuWaitTimeout"):
            break
    raise RuntimeError(f"setup cell {code!r} failed: " + "; ".join(aborts))


def output_of(kc: BlockingKernelClient, code: str) -> str:
    out: list[str] = []

    def hook(msg):  # stdout only: a replica's own log lines can reach the notebook's stderr
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=60, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell {code!r} failed: {reply['content']}")
    return "".join(out)


def interleaved(kcs: dict[str, object], code: str, n: int = CELLS, warmup: int = WARMUP,
                rounds: int = ROUNDS, think_s: float = 0.0,
                timed: Callable[[object, str], float] = lambda kc, code: cell(kc, code)[0]) -> dict[str, list[float]]:
    """``n`` timed cells of ``code`` per kernel after ``warmup``, alternating kernels in rounds;
    ``think_s``: a pause before each timed cell, as a user reading the last output makes.
    ``timed(kernel, code)``: seconds for one cell (default: a ``BlockingKernelClient``'s)."""
    for kc in kcs.values():
        for _ in range(warmup):
            timed(kc, code)
    times: dict[str, list[float]] = {label: [] for label in kcs}
    per_round = -(-n // rounds)
    while any(len(t) < n for t in times.values()):
        for label, kc in kcs.items():
            for _ in range(min(per_round, n - len(times[label]))):
                time.sleep(think_s)  # a user reading the output: load shape, not a wait for an event
                times[label].append(timed(kc, code))
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def plain_kernel() -> tuple[KernelManager, BlockingKernelClient]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def row(label: str, times: list[float], anchor: list[float]) -> dict:
    p50, a50 = statistics.median(times), statistics.median(anchor)
    r = {"label": label, "p50": p50, "p99": pct(times, 0.99), "anchor_p50": a50,
         "anchor_p99": pct(anchor, 0.99), "ratio": p50 / a50, "extra": p50 - a50, "n": len(times)}
    progress(f"{label}: p50 {ms(p50)} ms, p99 {ms(r['p99'])} ms; plain p50 {ms(a50)} ms, p99 {ms(r['anchor_p99'])} ms")
    return r


def progress(text: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {text} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)


# --- the parts ---------------------------------------------------------------------------------------
def run_b1_b2_b3b(parts: set[str], tmp: Path, plain: BlockingKernelClient, results: dict) -> None:
    cluster = DevCluster(tmp / "cluster", nodes=3, gpus_per_node=1).start()
    try:
        if parts & {"B1", "B6"}:
            k = DevKernel(cluster, gpus=0)
            try:
                t = interleaved({"cpu": k.kc, "plain": plain}, "x = 1")
                results["B1"] = row("B1 CPU kernel, 3 replicas", t["cpu"], t["plain"])
                if "B6" in parts:
                    for i in range(B6_DEPTH):
                        cell(k.kc, "x = 1")
                        cell(plain, "x = 1")
                        if (i + 1) % 1000 == 0:
                            progress(f"B6 {i + 1} of {B6_DEPTH} cells on both kernels")
                    t = interleaved({"cpu": k.kc, "plain": plain}, "x = 1", warmup=0)
                    results["B6"] = row(f"B6 as B1, {B6_DEPTH:,} cells later", t["cpu"], t["plain"])
            finally:
                k.close()
        if "B7" in parts:
            run_b7(cluster, plain, results)
        if "B2" in parts:
            k = DevKernel(cluster, gpus=1)
            try:
                t = interleaved({"gpu": k.kc, "plain": plain}, "x = 1")
                results["B2-small"] = row("B2 GPU kernel, 3 replicas, no big array", t["gpu"], t["plain"])
                t = interleaved({"gpu": k.kc, "plain": plain}, "x = 1", n=B2T_CELLS, warmup=0, think_s=B2_THINK_S)
                results["B2t-small"] = row(f"B2t as B2 without `big`, {B2_THINK_S:g} s between cells",
                                           t["gpu"], t["plain"])
                results["B2-setup-s"], results["B2-setup-aborts"] = setup(k.kc, BIG)
                progress(f"B2 setup {results['B2-setup-s']:.1f} s, aborts: {results['B2-setup-aborts']}")
                cell(plain, BIG)
                t = interleaved({"gpu": k.kc, "plain": plain}, "x = 1")
                results["B2-big"] = row("B2 GPU kernel, 3 replicas, 1 GiB `big` in both", t["gpu"], t["plain"])
                t = interleaved({"gpu": k.kc, "plain": plain}, "x = 1", n=B2T_CELLS, warmup=0, think_s=B2_THINK_S)
                results["B2t-big"] = row(f"B2t as B2 with `big`, {B2_THINK_S:g} s between cells",
                                         t["gpu"], t["plain"])
                cell(plain, "del big")
            finally:
                k.close()
        if "B3" in parts:
            k = DevKernel(cluster, gpus=0)
            try:
                results["B3-setup-s"], results["B3-setup-aborts"] = setup(k.kc, BIG)
                cell(plain, BIG)
                # back to back (rounds=1): each cell also waits for the followers still loading the last value
                t = interleaved({"cpu": k.kc, "plain": plain}, "big += 1", n=B3_CELLS, warmup=1, rounds=1)
                r = row("B3b `big += 1`, CPU kernel, 3 replicas", t["cpu"], t["plain"])
                r["gbps"] = GIB / r["extra"] / 1e9 if r["extra"] > 0 else float("inf")
                results["B3b"] = r
                # the same with a pause before each cell (a user reading the output): what goes on
                # after a reply (the last follower's receive) is then done before the next cell
                t = interleaved({"cpu": k.kc, "plain": plain}, "big += 1", n=B3_CELLS, warmup=0, rounds=1,
                                think_s=B3_THINK_S)
                r = row(f"B3bt as B3b, {B3_THINK_S:g} s between cells", t["cpu"], t["plain"])
                r["gbps"] = GIB / r["extra"] / 1e9 if r["extra"] > 0 else float("inf")
                results["B3bt"] = r
                same = output_of(k.kc, "print(float(big[0]), float(big[-1]))").split()
                if same != [str(float(2 + 2 * B3_CELLS))] * 2:
                    r["label"] += f" (**values after the cells: {same}, expected {2 + 2 * B3_CELLS}.0**)"
                cell(plain, "del big")
            finally:
                k.close()
            # the same on a GPU kernel: the cell runs in a forked child, whose changed array comes
            # back to the replica through a pipe (gpuhub/kernel/pipe.py) before it is pushed
            k = DevKernel(cluster, gpus=1)
            try:
                setup(k.kc, BIG)
                cell(plain, "big = np.ones(1 << 27)")
                t = interleaved({"gpu": k.kc, "plain": plain}, "big += 1", n=B3_CELLS, warmup=1, rounds=1,
                                think_s=B3_THINK_S)
                r = row("B3g as B3bt, GPU kernel (a child per cell)", t["gpu"], t["plain"])
                r["gbps"] = GIB / r["extra"] / 1e9 if r["extra"] > 0 else float("inf")
                results["B3g"] = r
                cell(plain, "del big")
            finally:
                k.close()
        if "B5" in parts:
            k = DevKernel(cluster, gpus=0)
            try:
                results["B5-setup-s"], results["B5-setup-aborts"] = setup(k.kc, BIG)
                cell(plain, BIG)
                t = interleaved({"cpu": k.kc, "plain": plain}, "pass", n=B5_CELLS, warmup=3)
                results["B5"] = row("B5 `pass`, CPU kernel, 3 replicas, 1 GiB `big` in both", t["cpu"], t["plain"])
                # the same with a pause before each cell: what runs between cells has time to run
                t = interleaved({"cpu": k.kc, "plain": plain}, "pass", n=B5_CELLS, warmup=0, think_s=B5_THINK_S)
                results["B5t"] = row(f"B5t as B5, {B5_THINK_S:g} s between cells", t["cpu"], t["plain"])
                cell(plain, "del big")
            finally:
                k.close()
    finally:
        cluster.stop()


def b7_results(kc, what: str) -> None:
    cell(kc, B7_SETUP)
    for i, code in enumerate(B7_RESULTS):
        cell(kc, code)
        if (i + 1) % 80 == 0:
            progress(f"B7 {i + 1} of {len(B7_RESULTS)} results on the {what}")
    cell(kc, "i = 0")


def run_b7(cluster: DevCluster, plain: BlockingKernelClient, results: dict) -> None:
    b7_results(plain, "plain kernel")
    k = DevKernel(cluster, gpus=0)
    try:
        b7_results(k.kc, "CPU kernel")
        t = interleaved({"cpu": k.kc, "plain": plain}, "x = 1")
        results["B7"] = row(f"B7 as B1, {len(B7_RESULTS)} results in `Out`", t["cpu"], t["plain"])
        t = interleaved({"cpu": k.kc, "plain": plain}, "i += 1", n=B7C_CELLS, warmup=5)
        results["B7c"] = row("B7c `i += 1` (a changed namespace), CPU kernel, as B7", t["cpu"], t["plain"])
    finally:
        k.close()
    k = DevKernel(cluster, gpus=1)
    try:
        b7_results(k.kc, "GPU kernel")
        t = interleaved({"gpu": k.kc, "plain": plain}, "i += 1", n=B7C_CELLS, warmup=5)
        results["B7g"] = row("B7g as B7c, GPU kernel (fake GPU)", t["gpu"], t["plain"])
    finally:
        k.close()
    cell(plain, "Out.clear()")


def run_b3a(results: dict) -> None:
    from bench import blob_bench

    r = blob_bench.run(GIB, 3, configs=("cold", "warm", "memfd"), verbose=False)
    results["B3a"] = r
    progress("B3a: " + ", ".join(f"{name} {p['gbps']:.2f} GB/s" for name, p in r["push"].items()))


def run_b4(tmp: Path, results: dict, kernels: int = B4_KERNELS) -> None:
    times, notes = [], []
    for i in range(kernels):
        cluster = DevCluster(tmp / f"b4-{i}", nodes=3, gpus_per_node=1).start()
        try:
            k = DevKernel(cluster, gpus=0)
            try:
                for _ in range(3):
                    cell(k.kc, "x = 1")
                node = output_of(k.kc, "import os; print(os.environ['GPUHUB_NODE'])").strip()
                idle = next(r for r in k.record["replicas"] if r["node"] != node)
                pid = k.pid(idle["id"])
                cluster.agent(idle["node"]).stop(kill=True)
                os.kill(pid, signal.SIGKILL)
                elapsed, _ = cell(k.kc, "x += 1", timeout=120)
                times.append(elapsed)
                progress(f"B4 kernel {i + 1}: next cell after the kill took {elapsed:.2f} s")
                after = output_of(k.kc, "import os; print(os.environ['GPUHUB_NODE'], x)").split()
                notes.append(f"executor {node}, killed {idle['node']}; next cell on {after[0]}")
                if after[1] != "2":
                    notes[-1] += f" (**x is {after[1]}, expected 2**)"
            finally:
                k.close()
        finally:
            cluster.stop()
    results["B4"] = {"times": times, "median": statistics.median(times), "notes": notes}


# --- report ---------------------------------------------------------------------------------------
def machine() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            total = next(line for line in f if line.startswith("MemTotal"))
        mem = f", {int(total.split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} CPU(s){mem}, Linux {platform.release()}, Python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f} at the end")


def table(results: dict, parts: set[str], command: str, soft_dirty: bool) -> str:
    lines = [
        "## Replicated kernels (B1–B7)",
        "",
        (f"Command: `{command}` — {machine()}. Soft-dirty bits on this kernel: "
         f"{'yes' if soft_dirty else 'no'} (GPU cells use copy-on-write bits in the forked child)."),
        "",
        "| figure | measured | anchor (same run) | result | goal | met |",
        "|---|---|---|---|---|---|",
    ]

    def kernel_row(key: str, goal: str, met: bool | None, result: str) -> None:
        r = results[key]
        lines.append(f"| {r['label']} (n={r['n']}) | p50 {ms(r['p50'])} ms, p99 {ms(r['p99'])} ms "
                     f"| plain p50 {ms(r['anchor_p50'])} ms, p99 {ms(r['anchor_p99'])} ms | {result} | {goal} "
                     f"| {'' if met is None else ('yes' if met else '**no**')} |")

    if "B1" in results:
        r = results["B1"]
        kernel_row("B1", "p50 ≤ 1.5× plain", r["ratio"] <= 1.5, f"{r['ratio']:.2f}× plain")
    if "B6" in results:
        r, r1 = results["B6"], results["B1"]
        kernel_row("B6", "p50 ≤ 1.5× plain, as B1", r["ratio"] <= 1.5,
                   f"{r['ratio']:.2f}× plain (B1 {r1['ratio']:.2f}×)")
    if "B7" in results:
        r = results["B7"]
        kernel_row("B7", "p50 ≤ 1.5× plain, as B1", r["ratio"] <= 1.5, f"{r['ratio']:.2f}× plain")
        r = results["B7c"]
        kernel_row("B7c", "p50 ≤ 1.5× plain, as B1", r["ratio"] <= 1.5, f"{r['ratio']:.2f}× plain")
        kernel_row("B7g", "(reported)", None, f"+{ms(results['B7g']['extra'])} ms")
    for key in ("B2-small", "B2t-small"):
        if key in results:
            kernel_row(key, "(reported)", None, f"+{ms(results[key]['extra'])} ms")
    for key in ("B2-big", "B2t-big"):
        if key in results:
            r = results[key]
            kernel_row(key, "p50 ≤ plain + 10 ms", r["extra"] <= 0.010, f"+{ms(r['extra'])} ms")
    if "B3a" in results:
        a = results["B3a"]
        for name, p in a["push"].items():
            lines.append(f"| B3a blob push of 1 GiB to 2 peers, {name} store (n={a['repeats']}) "
                         f"| median {p['median_s']:.2f} s | — | {p['gbps']:.2f} GB/s | ≥ 1 GB/s "
                         f"| {'yes' if p['gbps'] >= 1 else '**no**'} |")
    for r in (results[k] for k in ("B3b", "B3bt", "B3g") if k in results):
        lines.append(f"| {r['label']} (n={r['n']}) | p50 {r['p50']:.2f} s | plain p50 {r['anchor_p50']:.2f} s "
                     f"| +{r['extra']:.2f} s → {r['gbps']:.2f} GB/s | ≥ 1 GB/s "
                     f"| {'yes' if r['gbps'] >= 1 else '**no**'} |")
    if "B5" in results:
        r = results["B5"]
        kernel_row("B5", "p50 ≤ 1.5× plain", r["ratio"] <= 1.5, f"{r['ratio']:.2f}× plain, +{ms(r['extra'])} ms")
        r = results["B5t"]
        kernel_row("B5t", "p50 ≤ 1.5× plain", r["ratio"] <= 1.5, f"{r['ratio']:.2f}× plain, +{ms(r['extra'])} ms")
    if "B4" in results:
        b = results["B4"]
        lines.append(f"| B4 kill idle replica + its agent → next cell done (n={len(b['times'])}) "
                     f"| median {b['median']:.2f} s (all: {', '.join(f'{t:.2f}' for t in b['times'])}) | — "
                     f"| {b['median']:.2f} s | ≤ 3 s | {'yes' if b['median'] <= 3 else '**no**'} |")
    for part, where in (("B2", "GPU"), ("B3", "CPU"), ("B5", "CPU")):
        if f"{part}-setup-s" in results:
            aborts = results[f"{part}-setup-aborts"]
            lines += ["", f"{part} setup: the cell creating the 1 GiB `big` on the {where} kernel took "
                          f"{results[f'{part}-setup-s']:.1f} s"
                          + (f", after {len(aborts)} aborted attempt(s): {'; '.join(aborts)}" if aborts else "") + "."]
    if "B4" in results:
        lines += ["", "B4 runs: " + "; ".join(results["B4"]["notes"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    from gpuhub.kernel import dirty

    args = [p.strip().upper() for a in (argv or []) for p in a.split(",") if p.strip()]
    parts = set(args) or set(PARTS)
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}; choose from {PARTS}")
    command = ".venv/bin/python -m bench replicated" if parts == set(PARTS) else \
        f".venv/bin/python -m bench.replicated_bench {' '.join(sorted(parts))}"
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpuhub-bench-") as tmp:
        if parts & {"B1", "B2", "B3", "B5", "B6", "B7"}:
            km, plain = plain_kernel()
            try:
                run_b1_b2_b3b(parts, Path(tmp), plain, results)
            finally:
                plain.stop_channels()
                km.shutdown_kernel(now=True)
        if "B3" in parts:
            run_b3a(results)
        if "B4" in parts:
            run_b4(Path(tmp), results)
    return table(results, parts, command, dirty.SOFT_DIRTY)


if __name__ == "__main__":
    print(main(sys.argv[1:]), flush=True)
