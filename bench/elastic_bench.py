"""The elastic GPU pool against its goal (issue #11). Prints a markdown section; from the repository root:

    .venv/bin/python -m bench elastic            (or: python -m bench.elastic_bench [--seeds 1,2,3])

For each trace from `gpuhub sim generate` (default settings, one seed each), side by side on the
same trace: `gpuhub sim run --policy gpuhub --elastic` with default settings (the product's pool,
gpuhub/scheduler/pool.py), the NotebookOS baseline (`--autoscale`: its scaling rule, with migration)
and a fixed cluster sized for the reservation peak, beside the physical limit (the busy GPUs at each
moment packed into whole servers). Goal: provisioned ≤ 0.41 × reserved, p95 ≤ 1 s, p99 ≤ 10 s,
no cell past the grant timeout.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from gpuhub.sim.engine import SimConfig, simulate
from gpuhub.sim.generate import GenConfig, generate

CONFIGS = (("elastic pool (gpuhub)", {"elastic": True}), ("NotebookOS baseline (--autoscale)", {"autoscale": True}),
           ("fixed, reservation peak", {}))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m bench.elastic_bench", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    args = p.parse_args([] if argv is None else argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = ["### Elastic GPU pool (issue #11)\n",
             f"Command: `python -m bench elastic` — Python {platform.python_version()}, {os.cpu_count()} CPU(s). "
             "Traces: `gpuhub sim generate --seed S` (60 sessions, 48 h); 8 GPUs per server, R = 3; acquire "
             "latency 30 s, migration 3 s, grant timeout 300 s. *provisioned*: GPU-hours of servers kept on "
             "(active, draining or being acquired).\n",
             "| seed | configuration | provisioned / reserved | physical limit / reserved | p95 s | p99 s | max s "
             "| past grant timeout | migrations | replica moves | released | acquired | sim s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for seed in seeds:
        trace = generate(GenConfig(seed=seed))
        for label, kw in CONFIGS:
            t = time.perf_counter()
            r = simulate(trace, SimConfig(policy="gpuhub", **kw))
            took = time.perf_counter() - t
            ratio = r.gpu_hours_provisioned / r.gpu_hours_reserved
            if kw.get("elastic"):
                ratios.append((ratio, r.delay_p95_s, r.delay_p99_s, r.cells_over_grant_timeout))
            lines.append(f"| {seed} | {label} | {ratio:.3f} | {r.gpu_hours_physical_limit / r.gpu_hours_reserved:.3f} "
                         f"| {r.delay_p95_s:.2f} | {r.delay_p99_s:.2f} | {r.delay_max_s:,.0f} "
                         f"| {r.cells_over_grant_timeout} | {r.migrations} | {r.replica_moves} "
                         f"| {r.servers_released} | {r.servers_acquired} | {took:.1f} |")
        print(f"# seed {seed} done", file=sys.stderr, flush=True)
    med = statistics.median(x[0] for x in ratios)
    met = all(x[0] <= 0.41 and x[1] <= 1 and x[2] <= 10 and x[3] == 0 for x in ratios)
    lines.append(f"\nElastic pool: provisioned / reserved median {med:.3f} over {len(seeds)} seeds; p95 ≤ "
                 f"{max(x[1] for x in ratios):.2f} s, p99 ≤ {max(x[2] for x in ratios):.2f} s, "
                 f"{sum(x[3] for x in ratios)} cell(s) past the grant timeout. Goal "
                 f"{'met' if met else 'not met'}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
