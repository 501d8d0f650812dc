"""How low could any pool go? An offline (clairvoyant) lower bound on provisioned / reserved for
issue #11's elastic GPU pool, beside the default pool and a few of its settings changed, on
`gpuhub sim generate --seed S` traces.

`python -m bench.elastic_bound [--seeds 1,2,3,4,5,6] [--no-ablations] [--where]` (about 6 s without
the ablations, a minute with them; ``--where`` adds where the default pool's servers go, by state).
Same definitions as gpuhub/sim/engine.py: provisioned = 8 GPUs x servers active or being acquired,
from the first session's start to the trace's end; reserved = the sessions' GPUs x their length.

The bound, per instant t (all GPU-seconds are servers x 8 GPUs x seconds):
  N(t) = servers that must be able to grant at t = max(F x [some kernel alive at t], ceil(B(t) / 8)),
         B(t) the GPUs of the cells running at t. Cell sizes are 1, 4 or 8 (divisors of 8), so
         ceil(B/8) packs the running cells exactly and a whole-server cell gets a server of its own.
         F = 3 (a kernel's three replicas need three distinct servers on while it lives) or F = 0
         (replicas may stay on lent or switched-off servers).
  P(t) >= max of N over [t, t + 30 s]: a server able to grant at s was switched on at s - 30 s
         (the acquire latency) and counts as provisioned from then, as the simulator counts it.
  zero-delay bound: every cell starts at its submit time.
  guaranteed bound: also uses the delay the goals allow (every cell may start 10 s late; the 1 % of
         cells that p99 <= 10 s lets wait longer are credited the most they could save, up to the
         300 s grant timeout): a lower bound for any policy.
  ideal spare rule (not a bound): the pool's spare rule with perfect packing, no drain delay and no
         acquire lead: max(F, ceil((B + largest request started in the last 1200 s) / 8)).
The cells are taken as gpuhub's kernels run them (``engine.as_kernels_run_it``): every cell of a
GPU session holds the session's GPUs, also one that uses none in the trace.
What the bound ignores (each can only raise a real policy's figure): a cell runs on one of its
kernel's replica servers unless it migrates, running cells do not move, the policy does not know the
future, the pool decides every 10 s.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import statistics
import sys
from dataclasses import replace

from gpuhub.scheduler.pool import PoolSettings
from gpuhub.sim import engine
from gpuhub.sim.engine import SimConfig, as_kernels_run_it, simulate
from gpuhub.sim.generate import GenConfig, generate

G, L, FLOOR, TIMEOUT = 8, 30.0, 3, 300.0


def need_segments(trace, floor: int, shrink: float = 0.0):
    """Piecewise-constant N(t) as [(a, b, servers)]."""
    pts = []
    for s in trace.sessions:
        if s.end_s > s.start_s:
            pts.append((s.start_s, 0, 1))
            pts.append((s.end_s, 0, -1))
        for t, d, g in s.cells:
            if g and d > shrink:
                pts.append((t + shrink, g, 0))
                pts.append((t + d, -g, 0))
    pts.sort()
    segs, busy, alive, last = [], 0, 0, None
    for t, dg, da in pts:
        if last is not None and t > last:
            n = max(floor if alive > 0 else 0, math.ceil(busy / G))
            if n:
                segs.append((last, t, n))
        busy += dg
        alive += da
        last = t
    return segs


def spare_rule_segments(trace, floor: int, window: float = 1200.0):
    """N(t) of an idealised pool with perfect packing, no drain delay and the pool's spare rule:
    max(floor, ceil((B + largest request started within `window` s) / 8))."""
    pts = []
    for s in trace.sessions:
        if s.end_s > s.start_s:
            pts += [(s.start_s, "a", 1), (s.end_s, "a", -1)]
        for t, d, g in s.cells:
            if g and d > 0:
                pts += [(t, "b", g), (t + d, "b", -g), (t, "r", g), (t + window, "r", -g)]
    pts.sort(key=lambda x: x[0])
    segs, busy, alive, last, recent = [], 0, 0, None, {}
    for t, kind, v in pts:
        if last is not None and t > last:
            big = max((g for g, c in recent.items() if c > 0), default=0)
            n = max(floor if alive > 0 else 0, math.ceil((busy + big) / G))
            if n:
                segs.append((last, t, n))
        if kind == "a":
            alive += v
        elif kind == "b":
            busy += v
        else:
            recent[abs(v)] = recent.get(abs(v), 0) + (1 if v > 0 else -1)
        last = t
    return segs


def lead_integral(segs, t0: float, t1: float, lead: float) -> float:
    """Integral over [t0, t1] of M(t) = max N over [t, t+lead]: each segment [a, b) of N is on at
    value n over [a - lead, b)."""
    ev = []
    for a, b, n in segs:
        ev.append((max(t0, a - lead), 1, n, b))
    ev.sort()
    heap: list = []  # (-n, end)
    total, i = 0.0, 0
    bounds = sorted({x for e in ev for x in (e[0], e[3])} | {t0, t1})
    for j in range(len(bounds) - 1):
        lo, hi = bounds[j], bounds[j + 1]
        while i < len(ev) and ev[i][0] <= lo:
            heapq.heappush(heap, (-ev[i][2], ev[i][3]))
            i += 1
        while heap and heap[0][1] <= lo:
            heapq.heappop(heap)
        if heap and hi > lo:
            total += -heap[0][0] * G * (min(hi, t1) - lo) if lo < t1 else 0.0
    return total


def bounds_for(trace):
    t0 = min(s.start_s for s in trace.sessions)
    t1 = max(max(s.end_s for s in trace.sessions),
             max((t + d for s in trace.sessions for t, d, _ in s.cells), default=t0))
    res = trace.reserved_gpu_seconds()
    out = {}
    n_cells = trace.cell_count
    k = n_cells - math.ceil(0.99 * n_cells)  # cells that may wait > 10 s with p99 <= 10 s
    gains = sorted((G * (min(d, TIMEOUT) - 10.0 + L) for s in trace.sessions for _, d, g in s.cells
                    if g and d > 10.0), reverse=True)
    slack = sum(gains[:k])
    for floor in (FLOOR, 0):
        segs = need_segments(trace, floor)
        out[f"phys{floor}"] = lead_integral(segs, t0, t1, 0.0) / res
        out[f"lead{floor}"] = lead_integral(segs, t0, t1, L) / res
        segs10 = need_segments(trace, floor, shrink=10.0)
        g = lead_integral(segs10, t0, t1, L) - slack
        floor_only = lead_integral(need_segments(trace, floor, shrink=float("inf")), t0, t1, L)
        out[f"guar{floor}"] = max(g, floor_only) / res
        out[f"spare{floor}"] = lead_integral(spare_rule_segments(trace, floor), t0, t1, 0.0) / res
    out["k"] = k
    out["cells"] = n_cells
    return out


def pool_ratio(trace, **pool_kw):
    cfg = SimConfig(policy="gpuhub", elastic=True, record_timeline=True)
    if "acquire_s" in pool_kw:
        cfg = replace(cfg, acquire_s=pool_kw.pop("acquire_s"))
    if "migration_s" in pool_kw:
        cfg = replace(cfg, migration_s=pool_kw.pop("migration_s"))
    if pool_kw:
        cfg = replace(cfg, pool=replace(PoolSettings(), **pool_kw))
    r = simulate(trace, cfg)
    return r


def excess_split(r, trace):
    """The pool's servers on beyond its own instantaneous need max(3 if alive, ceil(held/8)),
    from its timeline: GPU-hours / reserved where the excess is exactly 1 server and >= 2."""
    alive = []
    for s in trace.sessions:
        alive += [(s.start_s, 1), (s.end_s, -1)]
    alive.sort()
    tl = r.timeline
    one = more = 0.0
    ai, live = 0, 0
    for (ta, held, on), (tb, _, _) in itertools.pairwise(tl):
        while ai < len(alive) and alive[ai][0] <= ta:
            live += alive[ai][1]
            ai += 1
        need = max(FLOOR if live > 0 else 0, math.ceil(held / G))
        ex = on - need
        if ex == 1:
            one += G * (tb - ta)
        elif ex >= 2:
            more += ex * G * (tb - ta)
    res = r.gpu_hours_reserved * 3600
    return one / res, more / res


def where_servers_go(trace) -> dict[str, float]:
    """The default pool's servers kept on, split by what they held, sampled at each pool decision
    (every 10 s), as GPU-hours / reserved: ``empty`` (active, nothing granted: the spare and the
    replica floor), ``full``, ``part`` (some GPUs granted) and ``idle_on_part`` (the idle GPUs of
    those), ``draining`` and ``acquiring``; ``pack`` is max(3, ceil(held / 8)) servers."""
    acc: dict[str, float] = {}
    last: list = [None]
    tick = engine.Simulator._pool_tick

    def sampled(sim, t):
        if last[0] is not None:
            t0, seen = last[0]
            for k, v in seen.items():
                acc[k] = acc.get(k, 0.0) + v * (t - t0)
        seen = {}
        held = 0
        for n in sim.pooled.values():
            v = sim._view(n)
            held += v.committed
            if n.pool != "active":
                key = n.pool
            elif v.committed == 0:
                key = "empty"
            elif v.committed == v.gpu_count:
                key = "full"
            else:
                key = "part"
                seen["idle_on_part"] = seen.get("idle_on_part", 0.0) + (v.gpu_count - v.committed) / G
            seen[key] = seen.get(key, 0.0) + 1
        seen["pack"] = max(FLOOR if sim.live_sessions else 0, math.ceil(held / G))
        last[0] = (t, seen)
        tick(sim, t)

    engine.Simulator._pool_tick = sampled
    try:
        r = simulate(trace, SimConfig(policy="gpuhub", elastic=True))
    finally:
        engine.Simulator._pool_tick = tick
    servers_reserved = r.gpu_hours_reserved * 3600 / G
    return {k: v / servers_reserved for k, v in sorted(acc.items())}


ABLATIONS = (
    ("default", {}),
    ("spare_servers=0", {"spare_servers": 0}),
    ("release_after_s=0", {"release_after_s": 0.0}),
    ("release_after_s=0, drain_step=8", {"release_after_s": 0.0, "drain_step": 8}),
    ("spare_recent_s=300", {"spare_recent_s": 300.0}),
    ("spare_recent_s=0", {"spare_recent_s": 0.0}),
    ("acquire_s=0", {"acquire_s": 0.0}),
    ("spare=0, acquire_s=0", {"spare_servers": 0, "acquire_s": 0.0}),
    ("spare=0, release=0, acquire=0", {"spare_servers": 0, "release_after_s": 0.0, "acquire_s": 0.0}),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.elastic_bound", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3,4,5,6")
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--where", action="store_true", help="where the default pool's servers go, by state")
    a = p.parse_args([] if argv is None else argv)
    seeds = [int(x) for x in a.seeds.split(",")]
    print("| seed | cells | k>10s | phys (no lead) F=3 / F=0 | bound zero-delay F=3 | bound zero-delay F=0 "
          "| guaranteed F=3 | guaranteed F=0 | ideal spare-rule F=3 / F=0 | default pool | pool p99 s "
          "| pool excess 1 srv / >=2 srv |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---|")
    abl = {name: [] for name, _ in ABLATIONS}
    for seed in seeds:
        tr = generate(GenConfig(seed=seed))
        b = bounds_for(as_kernels_run_it(tr))  # the GPUs the product's kernels hold: every cell's
        r = pool_ratio(tr)
        one, more = excess_split(r, tr)
        print(f"| {seed} | {b['cells']} | {b['k']} | {b['phys3']:.3f} / {b['phys0']:.3f} | {b['lead3']:.3f} "
              f"| {b['lead0']:.3f} | {b['guar3']:.3f} | {b['guar0']:.3f} | {b['spare3']:.3f} / {b['spare0']:.3f} "
              f"| {r.gpu_hours_provisioned / r.gpu_hours_reserved:.3f} | {r.delay_p99_s:.2f} "
              f"| {one:.3f} / {more:.3f} |", flush=True)
        if not a.no_ablations:
            for name, kw in ABLATIONS:
                rr = pool_ratio(tr, **kw)
                abl[name].append((rr.gpu_hours_provisioned / rr.gpu_hours_reserved, rr.delay_p95_s,
                                  rr.delay_p99_s, rr.cells_over_grant_timeout))
    if a.where:
        parts = ("empty", "full", "part", "idle_on_part", "draining", "acquiring", "pack")
        print("\n| seed | " + " | ".join(parts) + " |")
        print("|---:|" + "---:|" * len(parts))
        for seed in seeds:
            w = where_servers_go(generate(GenConfig(seed=seed)))
            print(f"| {seed} | " + " | ".join(f"{w.get(k, 0.0):.3f}" for k in parts) + " |", flush=True)
    if not a.no_ablations:
        print("\n| pool ablation | " + " | ".join(f"seed {s}" for s in seeds) + " | median | worst p95 s / p99 s |")
        print("|---|" + "---:|" * (len(seeds) + 2))
        for name, rows in abl.items():
            med = statistics.median(x[0] for x in rows)
            print(f"| {name} | " + " | ".join(f"{x[0]:.3f}" for x in rows)
                  + f" | {med:.3f} | {max(x[1] for x in rows):.1f} / {max(x[2] for x in rows):.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
