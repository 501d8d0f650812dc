"""Output of simulation results: a readable table, JSON, a PNG plot (matplotlib, optional)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from .engine import SimResult

# rows of the readable table: (key, label, format)
TABLE_ROWS = (
    ("gpu_hours_provisioned", "GPU-hours provisioned (servers on)", "{:,.1f}"),
    ("provisioned_frac_of_reserved", "provisioned / reserved", "{:.3f}"),
    ("gpu_hours_saved_provisioned", "GPU-hours saved (reserved - provisioned)", "{:,.1f}"),
    ("gpu_hours_reserved", "GPU-hours reserved (trace)", "{:,.1f}"),
    ("gpu_hours_physical_limit", "GPU-hours physical limit (busy, whole servers)", "{:,.1f}"),
    ("gpu_hours_busy", "GPU-hours busy (cells)", "{:,.1f}"),
    ("gpu_hours_committed", "GPU-hours committed (held)", "{:,.1f}"),
    ("gpu_hours_saved_vs_reservation", "GPU-hours saved vs reservation (held)", "{:,.1f}"),
    ("saved_frac_of_bound", "saved held / (reserved - busy)", "{:.1%}"),
    ("cells", "cells", "{:,d}"),
    ("sessions", "sessions", "{:,d}"),
    ("nodes", "nodes (max)", "{:,d}"),
    ("mean_active_nodes", "nodes provisioned (mean)", "{:,.1f}"),
    ("delay_p50_s", "delay p50 (s)", "{:,.3f}"),
    ("delay_p95_s", "delay p95 (s)", "{:,.3f}"),
    ("delay_p99_s", "delay p99 (s)", "{:,.3f}"),
    ("delay_max_s", "delay max (s)", "{:,.3f}"),
    ("frac_started_within_1s", "started within 1 s", "{:.1%}"),
    ("frac_started_within_10s", "started within 10 s", "{:.1%}"),
    ("cells_over_grant_timeout", "cells past the grant timeout", "{:,d}"),
    ("sessions_waited", "sessions that waited to start", "{:,d}"),
    ("peak_committed_gpus", "peak GPUs held", "{:,d}"),
    ("migrations", "migrations", "{:,d}"),
    ("replica_moves", "replica moves (drains)", "{:,d}"),
    ("servers_released", "servers released", "{:,d}"),
    ("servers_acquired", "servers acquired", "{:,d}"),
)


def configuration(r: SimResult) -> str:
    """The run's name in titles: policy and how the cluster was sized."""
    sizing = "elastic pool" if r.elastic else "autoscale (NotebookOS)" if r.autoscale else f"{r.nodes} servers"
    return f"{r.policy}, {sizing}"


def format_table(results: Sequence[SimResult]) -> str:
    dicts = [r.to_dict() for r in results]
    for d in dicts:
        d["provisioned_frac_of_reserved"] = (d["gpu_hours_provisioned"] / d["gpu_hours_reserved"]
                                             if d["gpu_hours_reserved"] else 0.0)
    header = ["metric"] + [configuration(r) for r in results]
    rows = [
        [label] + [fmt.format(d[key]) for d in dicts] for key, label, fmt in TABLE_ROWS
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    first = dicts[0]
    lines.append(
        f"G={first['gpus_per_node']} GPUs/node, R={first['replicas']}, max SR={first['max_subscription_ratio']:g}, "
        f"loop={'closed' if first['closed_loop'] else 'open'}, "
        f"horizon {first['horizon_s'] / 3600:.1f} h"
    )
    for j, row in enumerate([header, *rows]):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=False)
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_json(results: Sequence[SimResult]) -> str:
    """One JSON object per policy, one per line (a single run prints exactly one object)."""
    return "\n".join(json.dumps(r.to_dict(), sort_keys=True) for r in results)


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'gpuhub[sim]' (or pip install matplotlib)"
        ) from None
    return plt


def _thin(points: list, limit: int = 20000) -> list:
    if len(points) <= limit:
        return points
    step = len(points) // limit + 1
    return [*points[::step], points[-1]]


def write_plot(results: Sequence[SimResult], path: str) -> None:
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    t0 = min((r.timeline[0][0] for r in results if r.timeline), default=0.0)
    for r in results:
        pts = _thin(r.timeline)
        if not pts:
            continue
        xs = [(t - t0) / 3600 for t, _, _ in pts]
        (line,) = ax1.step(
            xs, [h for _, h, _ in pts], where="post", label=f"{configuration(r)}: GPUs held"
        )
        ax1.step(
            xs,
            [a * r.gpus_per_node for _, _, a in pts],
            where="post",
            linestyle="--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{configuration(r)}: GPUs provisioned",
        )
    ax1.set_xlabel("time (h)")
    ax1.set_ylabel("GPUs")
    ax1.set_title("GPUs held (solid) and provisioned (dashed)")
    fig.suptitle("; ".join(configuration(r) for r in results), fontsize="medium")
    ax1.legend(fontsize="small")
    floor = 1e-3
    for r in results:
        d = list(r.delays)
        if not d:
            continue
        step = max(1, len(d) // 20000)
        xs = [max(floor, x) for x in d[::step]]
        ys = [(i * step + 1) / len(d) for i in range(len(xs))]
        ax2.step(xs, ys, where="post", label=f"{configuration(r)} (p95 {r.delay_p95_s:.3g} s)")
    ax2.set_xscale("log")
    ax2.set_xlabel(
        f"delay from submit to start (s, values < {floor:g} s drawn at {floor:g})"
    )
    ax2.set_ylabel("fraction of cells")
    ax2.set_ylim(0, 1.01)
    ax2.set_title("cell start delay CDF")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, stream=None, width: int = 30):
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        pct = 100 if total == 0 else min(100, int(done * 100 / total))
        if pct == self.last:
            return
        self.last = pct
        filled = self.width * pct // 100
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {done:,}/{total:,} cells")
        if pct >= 100:
            self.stream.write("\n")
        self.stream.flush()
