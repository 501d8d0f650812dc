"""Simulator benchmarks (issue #4). Prints a markdown section; run from the repository root:

    .venv/bin/python -m bench.sim_bench [--runs 3] [--e1-sessions 22000] [--quick]

E1: throughput, about 1,000,000 cells through the gpuhub policy (median of --runs runs), plus the
    time to write and load the trace as CSV through the loader.
E2: a trace sized like the NotebookOS workload (60 sessions over 48 h), reservation / batch / gpuhub
    side by side on the same cluster: GPU-hours saved against the bound (reserved - busy) and the
    delay percentiles; once on a fixed cluster sized for reservation, once with --autoscale, once on
    a cluster half that size, then over several seeds.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

from gpuhub.sim.engine import POLICIES, SimConfig, default_nodes, simulate
from gpuhub.sim.generate import GenConfig, generate, trace_stats
from gpuhub.sim.trace import load_trace, write_trace


def _fmt_h(x: float) -> str:
    return f"{x:,.0f}"


def e1(sessions: int, hours: float, runs: int) -> list[str]:
    out = []
    t = time.perf_counter()
    trace = generate(GenConfig(sessions=sessions, hours=hours, seed=7))
    gen_s = time.perf_counter() - t
    cells = trace.cell_count
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        write_trace(trace, d)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        trace = load_trace(d)
        load_s = time.perf_counter() - t
    times = []
    res = None
    for _ in range(runs):
        t = time.perf_counter()
        res = simulate(trace, SimConfig(policy="gpuhub"))
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out.append(
        f"### E1 — throughput ({cells:,} cells, {sessions:,} sessions over {hours:,.0f} h)\n"
    )
    out.append("| step | seconds | cells/s |")
    out.append("|---|---:|---:|")
    out.append(f"| generate (in memory) | {gen_s:.1f} | {cells / gen_s:,.0f} |")
    out.append(f"| write CSV | {write_s:.1f} | {cells / write_s:,.0f} |")
    out.append(f"| load + validate CSV | {load_s:.1f} | {cells / load_s:,.0f} |")
    out.append(
        f"| **simulate, gpuhub policy** (median of {runs}: {', '.join(f'{x:.1f}' for x in times)}) "
        f"| **{med:.1f}** | **{cells / med:,.0f}** |"
    )
    out.append("")
    out.append(
        f"Cluster: {res.nodes} nodes x {res.gpus_per_node} GPUs (default sizing), {res.events:,} events; "
        f"goal <= 60 s for 1,000,000 cells: **{'met' if med * 1e6 / cells <= 60 else 'missed'}** "
        f"({med * 1e6 / cells:.1f} s per million cells, load excluded; "
        f"{(med + load_s) * 1e6 / cells:.1f} s with the CSV load).\n"
    )
    return out


def _row(r, label: str) -> str:
    return (
        f"| {label} | {r.policy} | {r.nodes} | {r.mean_active_nodes:.1f} | {_fmt_h(r.gpu_hours_committed)} "
        f"| {_fmt_h(r.gpu_hours_provisioned)} | {_fmt_h(r.gpu_hours_saved_vs_reservation)} "
        f"| {r.saved_frac_of_bound:.1%} "
        f"| {(r.gpu_hours_reserved - r.gpu_hours_provisioned) / r.gpu_hours_saved_bound:.1%} "
        f"| {r.delay_p50_s:.2f} | {r.delay_p95_s:.2f} | {r.delay_p99_s:.1f} | {r.frac_started_within_1s:.1%} |"
    )


HEAD = (
    "| cluster | policy | nodes | active (mean) | committed | provisioned | saved | saved / bound "
    "| (reserved − provisioned) / bound | p50 s | p95 s | p99 s | ≤ 1 s |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def e2(seeds: list[int]) -> list[str]:
    out = []
    trace = generate(GenConfig(sessions=60, hours=48, seed=seeds[0]))
    st = trace_stats(trace)
    full = default_nodes(trace, 8, 3)
    half = max(3, full // 2)
    out.append(f"### E2 — paper-sized trace (60 sessions over 48 h, seed {seeds[0]})\n")
    out.append(
        f"Trace: {st['cells']:,} cells, reserved {_fmt_h(st['gpu_hours_reserved'])} GPU-hours, busy "
        f"{st['busy_frac_of_reserved']:.1%} of reserved, so the bound reserved − busy is "
        f"{_fmt_h(trace.reserved_gpu_seconds() / 3600 - trace.busy_gpu_seconds() / 3600)} GPU-hours. "
        f"8 GPUs per node, R = 3, max SR 7, open loop, batch start cost 5 s. GPU-hours below; "
        f"*saved* = reserved − committed.\n"
    )
    out.append(HEAD)
    best = {}
    for label, kw in (
        (f"fixed {full} nodes (reservation peak)", {"nodes": full}),
        (f"autoscale (cap {full})", {"nodes": full, "autoscale": True}),
        (f"fixed {half} nodes (half)", {"nodes": half}),
        (f"fixed {half} nodes, closed loop", {"nodes": half, "closed_loop": True}),
    ):
        for policy in POLICIES:
            r = simulate(trace, SimConfig(policy=policy, **kw))
            out.append(_row(r, label))
            best[(label, policy)] = r
    out.append("")
    # cluster-size sweep: how small can a fixed cluster get before delays grow?
    out.append(
        "Fixed cluster size sweep, same trace (hardware saving = (reserved − provisioned) / bound):\n"
    )
    out.append(
        "| nodes | GPUs | gpuhub p95 s | gpuhub p99 s | gpuhub ≤ 1 s | batch p95 s | batch p99 s "
        "| reservation p95 s | hardware saving |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in range(3, full + 1):
        g = simulate(trace, SimConfig(policy="gpuhub", nodes=n))
        b = simulate(trace, SimConfig(policy="batch", nodes=n))
        rv = simulate(trace, SimConfig(policy="reservation", nodes=n))
        out.append(
            f"| {n} | {n * 8} | {g.delay_p95_s:.2f} | {g.delay_p99_s:.1f} | {g.frac_started_within_1s:.1%} "
            f"| {b.delay_p95_s:.2f} | {b.delay_p99_s:.1f} | {rv.delay_p95_s:.0f} "
            f"| {(g.gpu_hours_reserved - g.gpu_hours_provisioned) / g.gpu_hours_saved_bound:.1%} |"
        )
    out.append("")
    # robustness over seeds: gpuhub only, fixed reservation-sized cluster and autoscale
    out.append(
        f"Over seeds {', '.join(map(str, seeds))} (gpuhub policy; batch for comparison):\n"
    )
    out.append(
        "| seed | cells | gpuhub p95 s (fixed) | gpuhub p99 s (fixed) | gpuhub p95 s (autoscale) "
        "| gpuhub p99 s (autoscale) "
        "| gpuhub (reserved − provisioned) / bound, autoscale | batch p95 s (fixed) |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in seeds:
        tr = generate(GenConfig(sessions=60, hours=48, seed=seed))
        n = default_nodes(tr, 8, 3)
        f = simulate(tr, SimConfig(policy="gpuhub", nodes=n))
        a = simulate(tr, SimConfig(policy="gpuhub", nodes=n, autoscale=True))
        b = simulate(tr, SimConfig(policy="batch", nodes=n))
        out.append(
            f"| {seed} | {tr.cell_count:,} | {f.delay_p95_s:.2f} | {f.delay_p99_s:.1f} | {a.delay_p95_s:.2f} "
            f"| {a.delay_p99_s:.1f} | {(a.gpu_hours_reserved - a.gpu_hours_provisioned) / a.gpu_hours_saved_bound:.1%} "
            f"| {b.delay_p95_s:.2f} |"
        )
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--runs", type=int, default=3, help="E1 runs (median reported)")
    p.add_argument("--e1-sessions", type=int, default=22000)
    p.add_argument("--e1-hours", type=float, default=4320.0)
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument(
        "--quick", action="store_true", help="E1 with a tenth of the sessions, one run"
    )
    p.add_argument("--skip-e1", action="store_true")
    args = p.parse_args([] if argv is None else argv)  # `python -m bench sim` passes none
    if args.quick:
        args.e1_sessions //= 10
        args.runs = 1
    cmd = "python -m bench.sim_bench" + (
        ""
        if not (argv if argv is not None else sys.argv[1:])
        else " " + shlex.join(argv if argv is not None else sys.argv[1:])
    )
    lines = [
        "## Simulator (issue #4)\n",
        f"Command: `{cmd}` — Python {platform.python_version()}, {os.cpu_count()} CPU(s), {platform.machine()}.\n",
    ]
    if not args.skip_e1:
        lines += e1(args.e1_sessions, args.e1_hours, args.runs)
    lines += e2([int(s) for s in args.seeds.split(",")])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
