"""``gpuhub sim``: run notebook traces through the scheduler's placement and the agent's grants.

``gpuhub sim run TRACE_DIR [...]`` and ``gpuhub sim generate OUT_DIR [...]``; also
``python -m gpuhub.sim ...``. :func:`main` takes the arguments after ``sim`` and returns the exit
status (0 ok, 2 bad input or configuration).
"""

from __future__ import annotations

import argparse
import sys
import time

from gpuhub.scheduler.pool import PoolSettings

from .engine import POLICIES, SimConfig, SimError, simulate
from .generate import GenConfig, generate, trace_stats
from .report import (
    PlotUnavailable,
    Progress,
    format_json,
    format_table,
    require_matplotlib,
    write_plot,
)
from .trace import TraceError, load_trace, write_trace


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuhub sim",
        description="Discrete-event simulation of notebook traces on a GPU cluster (docs/simulator.md).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,generate}")

    r = sub.add_parser(
        "run", help="simulate a trace directory (sessions.csv, cells.csv)"
    )
    r.add_argument("trace_dir", metavar="TRACE_DIR")
    r.add_argument(
        "--policy",
        choices=(*POLICIES, "all"),
        default="gpuhub",
        help="GPU allocation policy; 'all' runs the three side by side (default: gpuhub)",
    )
    r.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="GPU servers (the cap with --autoscale); default: ceil(peak reserved GPUs / G) + R",
    )
    r.add_argument(
        "--gpus-per-node", type=int, default=8, metavar="G", help="default: 8"
    )
    r.add_argument(
        "--replicas",
        type=int,
        default=3,
        metavar="R",
        help="replicas per kernel (default: 3)",
    )
    r.add_argument(
        "--max-subscription-ratio",
        type=float,
        default=7.0,
        metavar="X",
        help="admission cap on pending / (G * R) per node (default: 7.0, as NotebookOS)",
    )
    r.add_argument(
        "--elastic",
        action="store_true",
        help="gpuhub: the product's elastic pool (gpuhub/scheduler/pool.py): lend servers it does not "
        "need, acquire them back on demand",
    )
    r.add_argument(
        "--autoscale",
        action="store_true",
        help="the NotebookOS baseline: active nodes follow demand (every 30 s), replicas never move "
        "for it",
    )
    pool = PoolSettings()
    r.add_argument("--pool-min-active", type=int, default=pool.min_active, metavar="N",
                   help=f"--elastic: never fewer active servers (default: {pool.min_active})")
    r.add_argument("--pool-max-active", type=int, default=pool.max_active, metavar="N",
                   help="--elastic: never more active servers (default: 0, every one)")
    r.add_argument("--pool-headroom-gpus", type=int, default=pool.headroom_gpus, metavar="N",
                   help=f"--elastic: idle GPUs kept beyond the demand (default: {pool.headroom_gpus})")
    r.add_argument("--pool-spare-servers", type=int, default=pool.spare_servers, metavar="N",
                   help="--elastic: servers kept able to grant the largest request at once "
                   f"(default: {pool.spare_servers})")
    r.add_argument("--pool-spare-recent-s", type=float, default=pool.spare_recent_s, metavar="S",
                   help="--elastic: the spare server is kept for the largest request of a cell this "
                   f"recent (default: {pool.spare_recent_s:g})")
    r.add_argument("--pool-release-after-s", type=float, default=pool.release_after_s, metavar="S",
                   help="--elastic: a surplus lasts this long before a server drains "
                   f"(default: {pool.release_after_s:g})")
    r.add_argument("--acquire-s", type=float, default=30.0, metavar="S",
                   help="--elastic: seconds from the acquire hook to a server taking work (default: 30)")
    r.add_argument(
        "--no-migration",
        action="store_true",
        help="gpuhub: a cell whose replicas' servers are all busy waits instead of moving a replica",
    )
    r.add_argument(
        "--migration-s",
        type=float,
        default=3.0,
        metavar="S",
        help="gpuhub: seconds a move takes before the cell starts (default: 3, see `python -m bench migration`)",
    )
    r.add_argument(
        "--cell-gpus-from-trace",
        action="store_true",
        help="gpuhub: a GPU session's cell that uses no GPU in the trace takes none (the product's "
        "kernels give every cell the kernel's GPUs: this is what a kernel that knew would save)",
    )
    r.add_argument(
        "--closed-loop",
        action="store_true",
        help="submit a session's next cell a think time after the previous one actually ended",
    )
    r.add_argument(
        "--batch-start-cost-s",
        type=float,
        default=5.0,
        metavar="S",
        help="batch policy: seconds to start each cell's job, GPUs held meanwhile (default: 5)",
    )
    r.add_argument(
        "--json", action="store_true", help="print one JSON object per policy"
    )
    r.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write GPUs-held and delay-CDF plots (needs matplotlib)",
    )
    r.add_argument(
        "--progress",
        action="store_true",
        help="progress bar on stderr even when it is not a TTY",
    )

    g = sub.add_parser(
        "generate", help="write a synthetic trace following published notebook figures"
    )
    g.add_argument("out_dir", metavar="OUT_DIR")
    g.add_argument("--sessions", type=int, default=60, metavar="N", help="default: 60")
    g.add_argument(
        "--hours",
        type=float,
        default=48.0,
        metavar="H",
        help="trace window (default: 48)",
    )
    g.add_argument("--seed", type=int, default=1, metavar="S", help="default: 1")
    g.add_argument(
        "--busy-frac",
        type=float,
        default=0.25,
        help="GPU-busy share of reserved GPU time per session (default: 0.25, published)",
    )
    g.add_argument(
        "--stats",
        action="store_true",
        help="print the generated trace's summary figures",
    )
    return p


def _err(msg: str) -> int:
    print(f"gpuhub sim: error: {msg}", file=sys.stderr)
    return 2


def _run(args) -> int:
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            return _err(str(exc))
    try:
        trace = load_trace(args.trace_dir)
    except TraceError as exc:
        return _err(str(exc))
    policies = POLICIES if args.policy == "all" else (args.policy,)
    show_progress = args.progress or sys.stderr.isatty()
    results = []
    for policy in policies:
        cfg = SimConfig(
            policy=policy,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            replicas=args.replicas,
            max_subscription_ratio=args.max_subscription_ratio,
            autoscale=args.autoscale,
            closed_loop=args.closed_loop,
            batch_start_cost_s=args.batch_start_cost_s,
            record_timeline=bool(args.plot),
            migration=not args.no_migration,
            migration_s=args.migration_s,
            # the pool is the gpuhub policy's; the other policies run on the whole cluster
            elastic=args.elastic and policy == "gpuhub",
            pool=PoolSettings(min_active=args.pool_min_active, max_active=args.pool_max_active,
                              headroom_gpus=args.pool_headroom_gpus, spare_servers=args.pool_spare_servers,
                              release_after_s=args.pool_release_after_s,
                              spare_recent_s=args.pool_spare_recent_s),
            acquire_s=args.acquire_s,
            cells_take_kernel_gpus=not args.cell_gpus_from_trace,
        )
        if args.migration_s < 0:
            return _err("--migration-s must not be negative")
        if args.batch_start_cost_s < 0:
            return _err("--batch-start-cost-s must not be negative")
        try:
            results.append(
                simulate(trace, cfg, Progress(policy) if show_progress else None)
            )
        except SimError as exc:
            return _err(str(exc))
    print(format_json(results) if args.json else format_table(results))
    if args.plot:
        write_plot(results, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _generate(args) -> int:
    if args.sessions < 0 or args.hours <= 0:
        return _err("--sessions must be >= 0 and --hours > 0")
    if not 0 < args.busy_frac <= 1:
        return _err("--busy-frac must be in (0, 1]")
    t = time.perf_counter()
    trace = generate(
        GenConfig(
            sessions=args.sessions,
            hours=args.hours,
            seed=args.seed,
            busy_frac=args.busy_frac,
        )
    )
    try:
        write_trace(trace, args.out_dir)
    except OSError as exc:
        return _err(f"{args.out_dir}: {exc.strerror or exc}")
    print(
        f"wrote {len(trace.sessions):,} sessions and {trace.cell_count:,} cells to {args.out_dir} "
        f"({time.perf_counter() - t:.1f} s)"
    )
    if args.stats:
        for k, v in trace_stats(trace).items():
            print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    return _generate(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
