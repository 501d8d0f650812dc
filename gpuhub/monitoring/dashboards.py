"""gpuhub's Grafana dashboards, built with grafana-foundation-sdk (pinned ==0.0.21).

The rendered JSON is committed in ``roles/grafana/files/dashboards/`` and loaded by Grafana's file
provisioning (roles/grafana). After changing this module, run::

    python -m gpuhub.monitoring.dashboards            # write the JSON files
    python -m gpuhub.monitoring.dashboards --check    # fail if the committed JSON is stale

Metric names come from docs/interfaces.md (agent and scheduler), JupyterHub's own metrics, the
recording rules in roles/prometheus/templates/gpuhub.rules.yml.j2 and, in a collapsed row, the
NVIDIA DCGM exporter.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The classic dashboard schema (v1) is what Grafana's file provisioning loads on Grafana 10-12;
# the SDK nudges towards its v2 schema on import. This filter must run before the SDK is imported,
# hence the `noqa: E402` on the imports below.
warnings.filterwarnings("ignore", message="Prefer using dashboardv2", category=DeprecationWarning)

from grafana_foundation_sdk.builders import common as common_b  # noqa: E402
from grafana_foundation_sdk.builders import dashboard as dash  # noqa: E402
from grafana_foundation_sdk.builders import prometheus, stat, timeseries  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.models import common  # noqa: E402
from grafana_foundation_sdk.models import dashboard as dash_m  # noqa: E402

#: Default output: the grafana role's files (this file is gpuhub/monitoring/dashboards.py).
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[2] / "roles" / "grafana" / "files" / "dashboards"

DATASOURCE = common.DataSourceRef(type_val="prometheus", uid="${datasource}")
NODE = 'node=~"$node"'


# --------------------------------------------------------------------------- helpers


def query(expr: str, legend: str = "__auto", *, ref: str = "A", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    if instant:
        q = q.instant()
    else:
        q = q.range()
    return q


def _targets(panel: Any, queries: list[tuple[str, str]], instant: bool = False) -> Any:
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(query(expr, legend, ref=chr(ord("A") + i), instant=instant))
    return panel


def ts(
    title: str,
    queries: list[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    w: int = 12,
    h: int = 8,
    min_val: float | None = 0,
    max_val: float | None = None,
    stack: bool = False,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .fill_opacity(10)
        .line_width(1)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
    )
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if stack:
        p = p.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    return _targets(p, queries)


def st(
    title: str,
    expr: str,
    *,
    unit: str = "short",
    description: str = "",
    w: int = 4,
    h: int = 4,
    decimals: int | None = None,
    instant: bool = True,
) -> stat.Panel:
    p = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .graph_mode(common.BigValueGraphMode.NONE if instant else common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if decimals is not None:
        p = p.decimals(decimals)
    return _targets(p, [(expr, "__auto")], instant=instant)


#: Seconds between two samples of the gpuhub-gpus recording rules (prometheus_gpuhub_rules_interval),
#: as Prometheus itself reports it: the prometheus role always scrapes Prometheus (job "prometheus"),
#: and the rule_group label is "<rules file>;<group>". Read from Prometheus rather than written
#: here because the interval is a role variable the dashboard JSON cannot know; last_over_time over
#: the range (not the instant value) so a range ending in the past still finds it; max() over
#: rules-file paths (a moved file leaves a second series).
RULES_INTERVAL_S = (
    'scalar(max(last_over_time(prometheus_rule_group_interval_seconds{rule_group=~".*;gpuhub-gpus"}[$__range])))'
)


def gpu_hours(rule: str) -> str:
    """GPU-hours of a GPU-count recording rule (group gpuhub-gpus) over the dashboard's time range.

    Each sample of the rule stands for one evaluation interval, so the GPU-seconds are the sum of
    the samples that exist times that interval. Not avg_over_time(rule[$__range]) * $__range_s:
    that extrapolates the mean over the whole range, also over the part where Prometheus has no
    data (a young Prometheus, a range reaching before its retention, an outage), and inflates the
    figure by range / time covered."""
    return f"sum_over_time({rule}[$__range]) * {RULES_INTERVAL_S} / 3600"


def saved_share() -> str:
    """Saved / reserved-equivalent GPU-hours over the range (the interval cancels out), rounded
    down to the panel's 0.1 %: a share of 99.97 % (some committed GPU-hours) reads 99.9 %, never
    100 %, which only a range with nothing committed at all shows. (+1e-9: a float quotient like
    0.29999999999999993 still reads 30.0 %.)"""
    saved = "sum_over_time(cluster:gpuhub_gpus_saved:sum[$__range])"
    reserved = "sum_over_time(cluster:gpuhub_gpus_reserved_equivalent:sum[$__range])"
    return f"floor(1000 * {saved} / ({reserved} > 0) + 1e-9) / 1000"


# --------------------------------------------------------------------------- dashboards


def cluster_gpus() -> dash.Dashboard:
    """"gpuhub — cluster GPUs": what the GPUs are doing and what per-cell binding saves."""
    d = (
        dash.Dashboard("gpuhub — cluster GPUs")
        .uid("gpuhub-cluster-gpus")
        .description(
            "GPUs, oversubscription and per-cell leases of a gpuhub cluster, and the GPU-hours saved "
            "compared with reserving a GPU per session. Generated by gpuhub.monitoring.dashboards: "
            "edit the code, not this JSON."
        )
        .tags(["gpuhub", "gpu"])
        .editable()
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(
            dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dash.QueryVariable("node")
            .label("Node")
            .datasource(DATASOURCE)
            .query("label_values(gpuhub_agent_gpus, node)")
            .definition("label_values(gpuhub_agent_gpus, node)")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )

    # ---- cluster overview
    d = d.with_row(dash.Row("Cluster"))
    d = d.with_panel(st("GPUs", f"sum(gpuhub_agent_gpus{{{NODE}}})",
                        description="GPUs the agents report (gpuhub_agent_gpus)."))
    d = d.with_panel(st("Pending GPUs", f"sum(gpuhub_agent_gpus_pending{{{NODE}}})",
                        description="Sum of the GPU specs of the kernel replicas placed on the nodes "
                                    "(each kernel counts once per replica)."))
    d = d.with_panel(st("Committed GPUs", f"sum(gpuhub_agent_gpus_committed{{{NODE}}})",
                        description="GPUs granted to an executing cell right now."))
    d = d.with_panel(st("Subscription ratio", "max(gpuhub_cluster_subscription_ratio)", decimals=2,
                        description="The scheduler's cluster subscription ratio: pending / (GPUs x replicas). "
                                    "Admission stops at max_subscription_ratio."))
    d = d.with_panel(st("Kernels", "sum(gpuhub_scheduler_kernels)",
                        description="Replicated kernels the scheduler knows."))
    d = d.with_panel(st("Live nodes", 'sum(gpuhub_scheduler_nodes{state="live"})',
                        description="Nodes the scheduler can place replicas on (heartbeating)."))
    d = d.with_panel(ts(
        "Cluster GPUs: total, pending, committed",
        [
            (f"sum(gpuhub_agent_gpus{{{NODE}}})", "total"),
            (f"sum(gpuhub_agent_gpus_pending{{{NODE}}})", "pending"),
            (f"sum(gpuhub_agent_gpus_committed{{{NODE}}})", "committed"),
        ],
        description="From the agents (each agent is the authority over its own GPUs).",
    ))
    d = d.with_panel(ts(
        "Subscription ratio over time",
        [
            ("max(gpuhub_cluster_subscription_ratio)", "cluster (scheduler)"),
            (f"node:gpuhub_subscription_ratio:ratio{{{NODE}}}", "{{node}}"),
        ],
        description="pending / (GPUs x replicas), cluster-wide as the scheduler computes it "
                    "and per node (recording rule).",
    ))

    # ---- per node
    d = d.with_row(dash.Row("Per node"))
    d = d.with_panel(ts("Committed GPUs per node",
                        [(f"sum by (node) (gpuhub_agent_gpus_committed{{{NODE}}})", "{{node}}")], w=8))
    d = d.with_panel(ts("Pending GPUs per node",
                        [(f"sum by (node) (gpuhub_agent_gpus_pending{{{NODE}}})", "{{node}}")], w=8))
    d = d.with_panel(ts("Units per node",
                        [(f"sum by (node, kind) (gpuhub_agent_units{{{NODE}}})", "{{node}} {{kind}}")],
                        w=8, description="systemd units the agents run: kernel replicas and notebook servers."))

    # ---- leases
    d = d.with_row(dash.Row("Leases (per-cell GPU grants)"))
    d = d.with_panel(ts(
        "Leases per second",
        [
            (f"sum(rate(gpuhub_agent_leases_granted_total{{{NODE}}}[$__rate_interval]))", "granted"),
            (f"sum(rate(gpuhub_agent_leases_refused_total{{{NODE}}}[$__rate_interval]))", "refused"),
            (f"sum(rate(gpuhub_agent_leases_expired_total{{{NODE}}}[$__rate_interval]))", "expired"),
        ],
        unit="reqps", w=8,
        description="Grants asked by replicas for executing cells. A refusal makes the replica YIELD; "
                    "expired leases were not released by their holder.",
    ))
    d = d.with_panel(ts(
        "Refused share of lease requests",
        [(
            (
                f"sum(rate(gpuhub_agent_leases_refused_total{{{NODE}}}[$__rate_interval])) / "
                f"(sum(rate(gpuhub_agent_leases_granted_total{{{NODE}}}[$__rate_interval])) + "
                f"sum(rate(gpuhub_agent_leases_refused_total{{{NODE}}}[$__rate_interval])) > 0)"
            ),
            "refused",
        )],
        unit="percentunit", w=8, max_val=1,
    ))
    d = d.with_panel(ts(
        "Scheduler placements per second",
        [
            ("sum(rate(gpuhub_scheduler_placements_total[$__rate_interval]))", "placements"),
            ("sum(rate(gpuhub_scheduler_placement_failures_total[$__rate_interval]))", "failures"),
            # a replica on a lost node replaced by one on another node (Scheduler.heal)
            ("sum(rate(gpuhub_scheduler_replacements_total[$__rate_interval]))", "replica replacements"),
        ],
        unit="ops", w=8,
    ))

    # ---- per GPU (gpuhub agent metrics)
    d = d.with_row(dash.Row("GPUs (gpuhub agent)"))
    d = d.with_panel(ts("GPU utilisation", [(f"gpuhub_gpu_utilization_ratio{{{NODE}}}", "{{node}} GPU {{gpu}}")],
                        unit="percentunit", max_val=1))
    d = d.with_panel(ts("GPU memory used", [(f"gpuhub_gpu_memory_used_bytes{{{NODE}}}", "{{node}} GPU {{gpu}}")],
                        unit="bytes"))
    d = d.with_panel(ts(
        "GPU memory used (share of total)",
        [(f"gpuhub_gpu_memory_used_bytes{{{NODE}}} / (gpuhub_gpu_memory_total_bytes{{{NODE}}} > 0)",
          "{{node}} GPU {{gpu}}")],
        unit="percentunit", max_val=1,
    ))
    d = d.with_panel(ts("GPU bound to a cell", [(f"gpuhub_gpu_committed{{{NODE}}}", "{{node}} GPU {{gpu}}")],
                        max_val=1, description="1 while the GPU is granted to an executing cell."))

    # ---- GPU-hours
    d = d.with_row(dash.Row("GPU-hours: per-cell binding vs reserving a GPU per session"))
    # GPU-hours stats: no fixed decimals. Grafana's automatic decimals keep two significant digits
    # (0.0167, 0.2, 7.33, 1187), where a fixed 1 showed a few minutes of one GPU as 0.0.
    d = d.with_panel(st("Reserved-equivalent GPU-hours", gpu_hours("cluster:gpuhub_gpus_reserved_equivalent:sum"),
                        unit="short", w=6,
                        description="GPU-hours a reservation system would have held for the same kernels over the "
                                    "time range (pending / replicas, i.e. every kernel's GPUs once). Only the time "
                                    "Prometheus has data for counts."))
    d = d.with_panel(st("Committed GPU-hours", gpu_hours("cluster:gpuhub_gpus_committed:sum"),
                        unit="short", w=6,
                        description="GPU-hours GPUs were actually bound to executing cells over the time range."))
    d = d.with_panel(st("GPU-hours saved", gpu_hours("cluster:gpuhub_gpus_saved:sum"),
                        unit="short", w=6,
                        description="Reserved-equivalent minus committed GPU-hours: GPUs free for other kernels."))
    d = d.with_panel(st(
        "Saved share", saved_share(),
        unit="percentunit", decimals=1, w=6,
        description="GPU-hours saved / reserved-equivalent GPU-hours, rounded down: 100 % only when no GPU "
                    "was committed at all in the time range.",
    ))
    d = d.with_panel(ts(
        "GPUs: reserved-equivalent vs committed",
        [
            ("cluster:gpuhub_gpus_reserved_equivalent:sum", "reserved-equivalent"),
            ("cluster:gpuhub_gpus_committed:sum", "committed"),
            ("cluster:gpuhub_gpus_saved:sum", "saved"),
        ],
        w=24,
    ))

    # ---- quotas (docs/quotas.md)
    d = d.with_row(dash.Row("GPU quotas: GPU-hours per user this week"))
    d = d.with_panel(ts(
        "GPU-hours this week per user",
        [("max by (user) (gpuhub_user_gpu_hours_week)", "{{user}}"),
         ("max by (user) (gpuhub_user_gpu_hours_limit)", "{{user}} limit")],
        w=12, description="GPU-hours each user's cells held since Monday 00:00 UTC (the leases, not session "
                          "time), and their own weekly limit with any extra hours an admin granted.",
    ))
    d = d.with_panel(ts(
        "GPU lease requests refused by a quota",
        [(f"sum by (limit) (increase(gpuhub_agent_quota_refusals_total{{{NODE}}}[$__rate_interval]))",
          "{{limit}}")],
        w=12, description="GPU lease requests the agents refused because the user was at a limit: gpus (GPUs held "
                          "at once) or gpu_hours (the weekly GPU-hours). Not a count of cells: every replica of "
                          "a kernel asks for each GPU cell, and asks again while it waits, so one refused cell "
                          "counts several times here (gpuhub_agent_quota_refusals_total). The refused cell itself "
                          "ends with the reason.",
    ))

    # ---- JupyterHub
    d = d.with_row(dash.Row("JupyterHub"))
    d = d.with_panel(st("Active users (24 h)", 'max(jupyterhub_active_users{period="24h"})', w=4))
    d = d.with_panel(st("Active users (7 d)", 'max(jupyterhub_active_users{period="7d"})', w=4))
    d = d.with_panel(st("Running servers", "max(jupyterhub_running_servers)", w=4))
    d = d.with_panel(st("Users", "max(jupyterhub_total_users)", w=4))
    d = d.with_panel(ts(
        "Server spawn duration",
        [
            ("histogram_quantile(0.5, sum by (le) "
             '(rate(jupyterhub_server_spawn_duration_seconds_bucket{status="success"}[$__rate_interval])))', "p50"),
            ("histogram_quantile(0.9, sum by (le) "
             '(rate(jupyterhub_server_spawn_duration_seconds_bucket{status="success"}[$__rate_interval])))', "p90"),
        ],
        unit="s", w=8, h=4,
    ))
    d = d.with_panel(ts(
        "Running servers and active users",
        [
            ("max(jupyterhub_running_servers)", "running servers"),
            ('max(jupyterhub_active_users{period="24h"})', "active users (24 h)"),
        ],
        w=24,
    ))

    # ---- DCGM exporter (collapsed: only where a site runs it)
    dcgm = (
        dash.Row("NVIDIA DCGM exporter (where the site runs it)")
        .with_panel(ts("GPU utilisation (DCGM)", [(f"DCGM_FI_DEV_GPU_UTIL{{{NODE}}}", "{{node}} GPU {{gpu}}")],
                       unit="percent", max_val=100))
        .with_panel(ts(
            "GPU memory used (DCGM)",
            [(f"DCGM_FI_DEV_FB_USED{{{NODE}}} * 1048576", "{{node}} GPU {{gpu}}")],
            unit="bytes", description="DCGM reports framebuffer memory in MiB.",
        ))
        .with_panel(ts(
            "GPU memory used, share (DCGM)",
            [(f"DCGM_FI_DEV_FB_USED{{{NODE}}} / ((DCGM_FI_DEV_FB_USED{{{NODE}}} + DCGM_FI_DEV_FB_FREE{{{NODE}}}) > 0)",
              "{{node}} GPU {{gpu}}")],
            unit="percentunit", max_val=1,
        ))
        .with_panel(ts(
            "Graphics engine active (DCGM profiling)",
            [(f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{NODE}}}", "{{node}} GPU {{gpu}}")],
            unit="percentunit", max_val=1,
            description="Share of time any SM was busy: closer to real GPU use than DCGM_FI_DEV_GPU_UTIL.",
        ))
    )
    d = d.with_row(dcgm)
    return d


#: file name -> builder. Add a dashboard here (see docs/monitoring.md).
DASHBOARDS: dict[str, Callable[[], dash.Dashboard]] = {
    "gpuhub-cluster-gpus.json": cluster_gpus,
}


# --------------------------------------------------------------------------- rendering


def _number_panels(model: dict[str, Any]) -> None:
    """Give every panel a stable id (Grafana needs unique ids; the SDK leaves them unset)."""
    n = 0
    for panel in model.get("panels", []):
        n += 1
        panel["id"] = n
        for sub in panel.get("panels", []) or []:
            n += 1
            sub["id"] = n


def render(builder: Callable[[], dash.Dashboard]) -> str:
    model = json.loads(json.dumps(builder().build(), cls=JSONEncoder))
    _number_panels(model)
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    return {name: render(builder) for name, builder in DASHBOARDS.items()}


def iter_panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in model.get("panels", []):
        yield panel
        yield from panel.get("panels", []) or []


def iter_exprs(model: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of a dashboard model, variables' queries included."""
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            yield f"variable {var['name']}", q["query"] if isinstance(q, dict) else q
    for panel in iter_panels(model):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]


def check(output_dir: Path) -> list[str]:
    """Differences between the committed JSON and what the code renders (empty = clean)."""
    problems: list[str] = []
    rendered = render_all()
    for name, text in rendered.items():
        path = output_dir / name
        if not path.exists():
            problems.append(f"{path}: missing (run python -m gpuhub.monitoring.dashboards)")
            continue
        committed = path.read_text(encoding="utf-8")
        if committed != text:
            diff = difflib.unified_diff(
                committed.splitlines(), text.splitlines(), f"{path} (committed)", f"{path} (rendered)", lineterm="", n=1
            )
            problems.append("\n".join(list(diff)[:40]))
    for path in sorted(output_dir.glob("*.json")):
        if path.name not in rendered:
            problems.append(f"{path}: not rendered by gpuhub.monitoring.dashboards "
                            "(stale? remove it or add it to DASHBOARDS)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuhub.monitoring.dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, help="default: %(default)s")
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed JSON differs from the rendered JSON")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.output_dir)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("dashboards are stale: run python -m gpuhub.monitoring.dashboards", file=sys.stderr)
            return 1
        print(f"dashboards up to date ({len(DASHBOARDS)} in {args.output_dir})")
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        path = args.output_dir / name
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if old != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        else:
            print(f"unchanged {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
