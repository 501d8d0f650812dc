"""Monitoring: dashboards and recording rules against a real Prometheus, rendered configs through
promtool, dashboards-as-code freshness, Grafana provisioning files. Fast; not marked cluster."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuhub.platform.http_client import default_client

from .conftest import REPO, local_inventory, run_role_config

DASHBOARD_DIR = REPO / "roles" / "grafana" / "files" / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))

# Values Grafana would put in for its built-in variables, and for the dashboards' own.
GRAFANA_VARS = {
    "$__rate_interval": "30s",
    "$__interval": "5s",
    "$__range_s": "60",
    "$__range": "1m",
    "$node": ".*",
    "${node}": ".*",
}


def substitute(expr: str, overrides: dict[str, str] | None = None) -> str:
    values = {**GRAFANA_VARS, **(overrides or {})}
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(var, values[var])
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unknown dashboard variable(s) {left} in {expr!r}: add them to GRAFANA_VARS"
    return expr


def _panels(model):
    for p in model["panels"]:
        yield p
        yield from p.get("panels", []) or []


def iter_exprs(model: dict):
    """(where, PromQL) of a Grafana dashboard model: query variables and panel targets."""
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            yield f"variable {var['name']}", q["query"] if isinstance(q, dict) else q
    for panel in _panels(model):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]


def sdk():
    """gpuhub.monitoring.dashboards, or a skip naming the missing pin."""
    pytest.importorskip(
        "grafana_foundation_sdk", reason="grafana-foundation-sdk==0.0.21 is not installed (requirements/dev.txt)"
    )
    from gpuhub.monitoring import dashboards

    return dashboards


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        for where, expr in iter_exprs(model):
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", expr.strip())
            if m:  # a variable's query: check the metric it reads
                expr = m.group(1)
            out.append((f"{path.name}: {where}", expr))
    return out


def panel_of(title: str, path: Path = DASHBOARD_DIR / "gpuhub-cluster-gpus.json") -> dict:
    (panel,) = [p for p in _panels(json.loads(path.read_text())) if p.get("title") == title]
    return panel


def panel_expr(title: str) -> str:
    (target,) = panel_of(title)["targets"]
    return target["expr"]


#: The GPU-hours stat panels and the recording rule each integrates.
GPU_HOURS_PANELS = {
    "Reserved-equivalent GPU-hours": "cluster:gpuhub_gpus_reserved_equivalent:sum",
    "Committed GPU-hours": "cluster:gpuhub_gpus_committed:sum",
    "GPU-hours saved": "cluster:gpuhub_gpus_saved:sum",
}


def rules_of(stack) -> list[dict]:
    doc = yaml.safe_load((stack.config_dir / "rules" / "gpuhub.rules.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


# --------------------------------------------------------------------------- (a) PromQL


def test_dashboards_exist():
    assert DASHBOARDS, f"no dashboards in {DASHBOARD_DIR}"
    assert dashboard_exprs()


@pytest.mark.parametrize("where,expr", dashboard_exprs(), ids=lambda v: v if len(v) < 90 else v[:87] + "...")
def test_dashboard_query_parses_and_returns_data(monitoring_stack, where, expr):
    body = monitoring_stack.query(substitute(expr))
    assert body.get("status") == "success", f"{where}: {expr!r} -> {body.get('errorType')}: {body.get('error')}"
    assert body["data"]["result"], f"{where}: {expr!r} returned no data"


def test_recording_rules_evaluate_and_return_data(monitoring_stack):
    problems = []
    for rule in rules_of(monitoring_stack):
        body = monitoring_stack.query(rule["expr"])
        if body.get("status") != "success":
            problems.append(f"{rule['record']}: {body.get('error')}")
        elif not monitoring_stack.query(rule["record"])["data"]["result"]:
            problems.append(f"{rule['record']}: no series recorded")
    rules = monitoring_stack.api("/api/v1/rules")["data"]["groups"]
    problems += [f"{r['name']}: {r.get('lastError')}" for g in rules for r in g["rules"] if r["health"] != "ok"]
    assert not problems, "\n".join(problems)


def test_saved_gpu_hours_arithmetic(monitoring_stack):
    """The daemons' own books: kernel a (2 GPUs x 3 replicas) and kernel b (1 GPU x 1 replica) are
    pending 2+2+2+1 = 7 -> 7/3 reserved-equivalent GPUs; kernel a's lease of 2 GPUs on the busy
    node is committed -> saved 7/3 - 2 = 1/3; one lease granted, one refused -> ratio 1/2."""
    def q(e):
        return float(monitoring_stack.query(e)["data"]["result"][0]["value"][1])
    books = monitoring_stack.gpuhub.books
    busy = monitoring_stack.busy_node
    # what the agents say (GET /api/v1/node), before looking at what Prometheus made of it
    assert sum(b["pending"] for b in books.values()) == 7
    assert {n: b["committed"] for n, b in books.items() if b["committed"]} == {busy: 2}
    assert books[busy]["pending"] == 3 and books["hub1"]["gpu_count"] == 0
    assert q("cluster:gpuhub_gpus:sum") == pytest.approx(6.0)
    assert q("cluster:gpuhub_gpus_pending:sum") == pytest.approx(7.0)
    assert q("cluster:gpuhub_gpus_reserved_equivalent:sum") == pytest.approx(7 / 3)
    assert q("cluster:gpuhub_gpus_committed:sum") == pytest.approx(2.0)
    assert q("cluster:gpuhub_gpus_saved:sum") == pytest.approx(1 / 3)
    assert q(f'node:gpuhub_subscription_ratio:ratio{{node="{busy}"}}') == pytest.approx(3 / 2 / 3)
    idle = next(n for n in ("gpu1", "gpu2", "gpu3") if n != busy)
    assert q(f'node:gpuhub_subscription_ratio:ratio{{node="{idle}"}}') == pytest.approx(2 / 2 / 3)
    assert not monitoring_stack.query('node:gpuhub_subscription_ratio:ratio{node="hub1"}')["data"]["result"]
    assert q("cluster:gpuhub_lease_refusals:ratio_rate5m") == pytest.approx(0.5)
    # the scheduler's view, from the agents' heartbeats
    assert q('gpuhub_cluster_gpus{state="pending"}') == pytest.approx(7.0)
    # from the scheduler's books, each kernel's GPUs once whatever its replicas: (2 + 1) / 6
    assert q('gpuhub_cluster_gpus{state="reserved"}') == pytest.approx(3.0)
    assert q("gpuhub_cluster_subscription_ratio") == pytest.approx(3 / 6)
    assert q("gpuhub_scheduler_kernels") == 2 and q("gpuhub_scheduler_placements_total") == 2
    # each placement's time in the kernel-start histogram; the agents export theirs from 0 on
    assert q("gpuhub_scheduler_kernel_start_seconds_count") == 2
    assert q('gpuhub_scheduler_kernel_start_seconds_bucket{le="+Inf"}') == 2
    assert q("sum(gpuhub_agent_cell_gpu_wait_seconds_count)") == 0  # no cell ran through a kernel here
    # every server that heartbeats is live, the notebook host without GPUs too: "lost" alerts
    assert q('gpuhub_scheduler_nodes{state="live"}') == 4 and q('gpuhub_scheduler_nodes{state="lost"}') == 0


def test_gpu_hours_count_only_the_time_prometheus_has_data_for(monitoring_stack):
    """This Prometheus has held data for seconds: the GPU-hours stats over a 6-h (or 1-h) range
    are the GPU-seconds of the samples that exist, not the mean stretched over the whole range
    (avg_over_time(rule[6h]) * 21600 / 3600 read about 6 x 7/3 = 14 reserved-equivalent GPU-hours here)."""
    stack = monitoring_stack

    def value(expr: str, at: float) -> float:
        body = stack.query(expr, at)
        assert body.get("status") == "success", f"{expr!r}: {body.get('error')}"
        (sample,) = body["data"]["result"]
        return float(sample["value"][1])

    # the dashboard finds the recording rules' interval (prometheus_gpuhub_rules_interval: 1s here)
    at = time.time()
    rules_interval = "scalar(max(prometheus_rule_group_interval_seconds{rule_group=~\".*;gpuhub-gpus\"}))"
    assert value(f"vector({rules_interval})", at) == 1.0
    started = value('process_start_time_seconds{job="prometheus"}', at)
    for title, rule in GPU_HOURS_PANELS.items():
        expr = panel_expr(title)
        six_h = value(substitute(expr, {"$__range": "6h", "$__range_s": "21600"}), at)
        one_h = value(substitute(expr, {"$__range": "1h", "$__range_s": "3600"}), at)
        assert math.isfinite(six_h) and six_h == pytest.approx(one_h), f"{title}: {six_h} (6 h), {one_h} (1 h)"
        # The same figure from the samples' own timestamps: each evaluation's value holds until
        # the next one (the last for one interval).
        (series,) = stack.query(f"{rule}[6h]", at)["data"]["result"]
        points = [(float(t), float(v)) for t, v in series["values"]]
        gpu_s = sum(v * (t_next - t) for (t, v), (t_next, _) in itertools.pairwise(points)) + points[-1][1] * 1.0
        assert six_h == pytest.approx(gpu_s / 3600, rel=0.05, abs=1e-4), title
        # never more than every GPU it ever counted, over the time since Prometheus started
        most = max(v for _, v in points)
        assert six_h <= most * (at - started + 1) / 3600, f"{title}: {six_h} GPU-hours in {at - started:.0f} s"
        assert six_h > 0, title


def test_gpu_hours_panels_with_little_data_in_a_long_range(prometheus_bins, tmp_path):
    """The dashboard's GPU-hours panels over made-up recording-rule series, through promtool:
    18 minutes of data in a 6-h range (a new cluster, as on the live cluster where 2 GPUs for
    17.6 minutes read 7.33 GPU-hours), at the role's default 30 s interval; then 10 hours of data
    with one committed sample (saved share 99.96 %, which must not read 100.0 %)."""
    def within(title: str, range_: str, expected: float) -> dict:
        seconds = str(int(range_.removesuffix("h")) * 3600)
        expr = substitute(panel_expr(title), {"$__range": range_, "$__range_s": seconds})
        return {"expr": f"abs(({expr}) - {expected!r}) < bool 1e-9", "eval_time": range_,
                "exp_samples": [{"labels": "{}", "value": 1}]}

    intervals = [  # the rule groups' intervals, as Prometheus exports them about itself
        {"series": 'prometheus_rule_group_interval_seconds{rule_group="/etc/prometheus/rules/gpuhub.rules.yml;'
                   'gpuhub-gpus", job="prometheus", node="hub1"}', "values": "30x1440"},
        {"series": 'prometheus_rule_group_interval_seconds{rule_group="/etc/prometheus/rules/gpuhub.rules.yml;'
                   'gpuhub-leases", job="prometheus", node="hub1"}', "values": "60x1440"},
    ]
    tests = [
        {   # 684 intervals without data, then 36 samples (18 min): 2 reserved-equivalent GPUs, 1
            # GPU committed during the last 6
            "interval": "30s",
            "input_series": [
                *intervals,
                {"series": "cluster:gpuhub_gpus_reserved_equivalent:sum", "values": "_x684 2x35"},
                {"series": "cluster:gpuhub_gpus_committed:sum", "values": "_x684 0x29 1x5"},
                {"series": "cluster:gpuhub_gpus_saved:sum", "values": "_x684 2x29 1x5"},
            ],
            "promql_expr_test": [
                within("Reserved-equivalent GPU-hours", "6h", 36 * 2 * 30 / 3600),  # 0.6, not 12
                within("Committed GPU-hours", "6h", 6 * 30 / 3600),
                within("GPU-hours saved", "6h", 66 * 30 / 3600),
                within("Saved share", "6h", 0.916),  # 66/72 = 91.67 %, rounded down to 0.1 %
            ],
        },
        {   # 10 h of 2 reserved-equivalent GPUs in a 12-h range, one GPU committed for one sample
            "interval": "30s",
            "input_series": [
                *intervals,
                {"series": "cluster:gpuhub_gpus_reserved_equivalent:sum", "values": "_x240 2x1199"},
                {"series": "cluster:gpuhub_gpus_committed:sum", "values": "_x240 0x1198 1"},
                {"series": "cluster:gpuhub_gpus_saved:sum", "values": "_x240 2x1198 1"},
            ],
            "promql_expr_test": [
                within("Reserved-equivalent GPU-hours", "12h", 20.0),  # 2 GPUs x 10 h
                within("Committed GPU-hours", "12h", 30 / 3600),
                within("Saved share", "12h", 0.999),  # 1 - 1/2400 = 99.96 %: 99.9 %, not 100.0 %
            ],
        },
        {   # nothing committed at all: 100 %
            "interval": "30s",
            "input_series": [
                *intervals,
                {"series": "cluster:gpuhub_gpus_reserved_equivalent:sum", "values": "_x100 3x20"},
                {"series": "cluster:gpuhub_gpus_saved:sum", "values": "_x100 3x20"},
            ],
            "promql_expr_test": [within("Saved share", "1h", 1.0)],
        },
    ]
    path = tmp_path / "gpu_hours_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "30s", "tests": tests}))
    r = subprocess.run([prometheus_bins.promtool, "test", "rules", str(path)],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_gpu_hours_stats_show_small_values():
    """No fixed decimals on the GPU-hours stats: Grafana's automatic ones keep the significant
    digits (a fixed 1 showed a few GPU-minutes as 0.0)."""
    for title in GPU_HOURS_PANELS:
        assert "decimals" not in panel_of(title)["fieldConfig"]["defaults"], title


def test_scrape_jobs_up_with_tokens(monitoring_stack):
    """Every target of the rendered config is up: tokens from the credentials dir reach the exporters."""
    targets = monitoring_stack.api("/api/v1/targets")["data"]["activeTargets"]
    jobs = {t["labels"]["job"] for t in targets}
    assert {"gpuhub-agent", "gpuhub-scheduler", "jupyterhub", "node", "dcgm", "prometheus"} <= jobs
    down = [(t["labels"]["job"], t["scrapeUrl"], t["lastError"]) for t in targets if t["health"] != "up"]
    assert not down
    for name, e in monitoring_stack.exporters.items():  # the stubs
        assert e.scrapes > 0 and e.refused == 0, f"{name}: {e.scrapes} scrapes, {e.refused} refused"
    # the real daemons answer /metrics only with their token: up means Prometheus sent it
    gpuhub = monitoring_stack.gpuhub
    for url in [a.url for a in gpuhub.agents.values()] + [gpuhub.dev.scheduler.url]:
        assert default_client().request("GET", url + "/metrics", timeout=10).status == 401, url
    # the agent's own node label is kept (honor_labels), no exported_node
    r = monitoring_stack.query("gpuhub_agent_gpus")["data"]["result"]
    assert sorted(s["metric"]["node"] for s in r) == ["gpu1", "gpu2", "gpu3", "hub1"]
    assert not any("exported_node" in s["metric"] for s in r)


def test_metric_names_are_in_the_contract():
    """gpuhub_* names the dashboards and rules use exist in docs/interfaces.md."""
    contract = (REPO / "docs" / "interfaces.md").read_text()
    known = set(re.findall(r"gpuhub_[a-z_]+", contract))
    templates = REPO / "roles" / "prometheus" / "templates"
    rules = [(templates / name).read_text() for name in ("gpuhub.rules.yml.j2", "gpuhub-alerts.rules.yml.j2")]
    texts = [expr for _, expr in dashboard_exprs()] + rules
    used = {n for t in texts for n in re.findall(r"(?<![:\w])gpuhub_[a-z_]+", t)}
    unknown = {n for n in used if n not in known and n.removesuffix("_total") not in known}
    assert not unknown, f"metric names not in docs/interfaces.md: {sorted(unknown)}"


# --------------------------------------------------------------------------- (b) promtool


def test_promtool_check_config_rendered(monitoring_stack, prometheus_bins):
    r = subprocess.run([prometheus_bins.promtool, "check", "config",
                        str(monitoring_stack.config_dir / "prometheus.yml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout + r.stderr


def test_promtool_check_config_defaults_and_empty_groups(prometheus_bins, tmp_path):
    """Default ports, a one-box inventory without GPU nodes: still a valid config."""
    inv = local_inventory({"box": {"ansible_host": "127.0.0.1"}}, {"hub": ["box"], "monitoring": ["box"]})
    out = run_role_config(tmp_path, inv, {})
    cfg = yaml.safe_load((out / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["gpuhub-agent"]["static_configs"] == []
    assert jobs["gpuhub-scheduler"]["static_configs"] == [{"targets": ["127.0.0.1:8600"], "labels": {"node": "box"}}]
    assert jobs["jupyterhub"]["static_configs"][0]["targets"] == ["127.0.0.1:8081"]
    assert jobs["jupyterhub"]["metrics_path"] == "/hub/metrics"
    assert jobs["node"]["static_configs"][0]["targets"] == ["127.0.0.1:9100"]
    # Prometheus holds the metrics token, which opens /metrics and nothing else, for both daemons.
    for job in ("gpuhub-agent", "gpuhub-scheduler"):
        assert jobs[job]["authorization"]["credentials_file"].endswith("/secrets/metrics.token")
    assert sorted(p.name for p in (out / "secrets").glob("*.token")) == ["jupyterhub-metrics.token", "metrics.token"]
    for token in ("metrics.token", "jupyterhub-metrics.token"):
        copy = (out / "secrets" / token).read_text()
        assert copy == (tmp_path / "credentials" / token).read_text().strip() and len(copy) == 48
        assert (out / "secrets" / token).stat().st_mode & 0o777 == 0o400
    r = subprocess.run([prometheus_bins.promtool, "check", "config", str(out / "prometheus.yml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_recording_rules_follow_the_inventorys_replica_count(tmp_path):
    inv = local_inventory({"box": {"ansible_host": "127.0.0.1"}}, {"hub": ["box"], "monitoring": ["box"]})
    rules = (run_role_config(tmp_path, inv, {"gpuhub_kernel_replicas": 5}) / "rules" / "gpuhub.rules.yml").read_text()
    assert "R = 5 replicas per kernel" in rules and "/ 5" in rules and "/ 3" not in rules


def test_alerting_rules_pass_their_promtool_unit_tests(prometheus_bins, tmp_path):
    """The alerting rules as the role renders them with its defaults, through promtool's own unit
    tests (tests/monitoring/alerts_test.yml): each alert fires when it must, with the words an
    admin reads, and not before its time."""
    inv = local_inventory({"box": {"ansible_host": "127.0.0.1"}}, {"hub": ["box"], "monitoring": ["box"]})
    rules = run_role_config(tmp_path, inv, {}) / "rules"
    assert sorted(p.name for p in rules.glob("*.rules.yml")) == ["gpuhub-alerts.rules.yml", "gpuhub.rules.yml"]
    shutil.copy(Path(__file__).with_name("alerts_test.yml"), rules / "alerts_test.yml")
    r = subprocess.run([prometheus_bins.promtool, "test", "rules", str(rules / "alerts_test.yml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


# --------------------------------------------------------------------------- (c) dashboards as code


def test_sdk_pinned_version():
    from importlib.metadata import version

    sdk()
    assert version("grafana-foundation-sdk").lstrip("v") == "0.0.21", "render with the pinned SDK only"


def test_dashboards_check_is_clean():
    sdk()
    r = subprocess.run([sys.executable, "-m", "gpuhub.monitoring.dashboards", "--check"],
                       cwd=REPO, check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboards_check_detects_drift(tmp_path):
    dashboards = sdk()

    assert dashboards.main(["--output-dir", str(tmp_path)]) == 0
    assert dashboards.check(tmp_path) == []
    path = next(tmp_path.glob("*.json"))
    path.write_text(path.read_text().replace("gpuhub_agent_gpus", "gpuhub_agent_gpuz", 1))
    assert dashboards.check(tmp_path)
    assert dashboards.main(["--output-dir", str(tmp_path), "--check"]) == 1


def test_dashboard_models_are_sane():
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        assert model["uid"] and model["title"]
        ids = [p["id"] for p in _panels(model)]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in _panels(model):
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", f"{path.name}: {p['title']}"
                assert p["gridPos"]["w"] <= 24



# --------------------------------------------------------------------------- (d) Grafana provisioning


def _render_grafana_template(name: str, **overrides) -> dict:
    import jinja2

    defaults = yaml.safe_load((REPO / "roles" / "grafana" / "defaults" / "main.yml").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters["to_json"] = json.dumps
    src = (REPO / "roles" / "grafana" / "templates" / name).read_text()
    return yaml.safe_load(env.from_string(src).render(ansible_managed="Ansible managed", **{**defaults, **overrides}))


def test_grafana_datasource_provisioning_parses():
    doc = _render_grafana_template("datasource.yml.j2")
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090" and ds["isDefault"] is True


def test_grafana_dashboard_provider_parses():
    doc = _render_grafana_template("dashboards.yml.j2")
    (prov,) = doc["providers"]
    assert prov["type"] == "file" and prov["options"]["path"] == "/etc/grafana/dashboards/gpuhub"


def test_grafana_ini_has_no_default_password():
    import configparser

    import jinja2

    defaults = yaml.safe_load((REPO / "roles" / "grafana" / "defaults" / "main.yml").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters["bool"] = bool
    text = env.from_string((REPO / "roles" / "grafana" / "templates" / "grafana.ini.j2").read_text()).render(
        ansible_managed="Ansible managed", **defaults)
    ini = configparser.ConfigParser(interpolation=None)
    ini.read_string(text)
    assert ini["security"]["admin_password"].startswith("$__file{")
    assert ini["security"]["secret_key"].startswith("$__file{")
    assert ini["auth.anonymous"]["enabled"] == "false"
    assert ini["analytics"]["check_for_updates"] == "false"


# --------------------------------------------------------------------------- command lines


def _render_args(role: str, template: str, **overrides) -> list[str]:
    import shlex

    import jinja2

    defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
    defaults = {k: v for k, v in defaults.items() if not (isinstance(v, str) and "{{" in v)}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    text = env.from_string((REPO / "roles" / role / "templates" / template).read_text()).render(
        ansible_managed="Ansible managed", **{**defaults, **overrides})
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ARGS=")]
    # systemd splits $ARGS at whitespace, without shell quoting
    return shlex.split(line)[0].removeprefix("ARGS=").split()


@pytest.mark.parametrize("size", ["0", "50GB"])
def test_prometheus_command_line_flags_exist(prometheus_bins, tmp_path, size):
    args = _render_args("prometheus", "prometheus.default.j2", prometheus_retention_size=size)
    assert "--storage.tsdb.retention.time=30d" in args
    assert any(a.startswith("--storage.tsdb.retention.size") for a in args) == (size != "0")
    # unknown flags make Prometheus exit 1 before it looks at anything else
    r = subprocess.run([prometheus_bins.prometheus, *args, "--version"], check=False, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr


def test_node_exporter_command_line_flags_exist():
    import shutil

    exe = shutil.which("prometheus-node-exporter")
    if not exe:
        pytest.skip("prometheus-node-exporter is not installed here (apt-get install prometheus-node-exporter)")
    args = _render_args("node_exporter", "prometheus-node-exporter.default.j2")
    r = subprocess.run([exe, *args, "--version"], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- Alertmanager


def render_alertmanager(tmp_path: Path, extra_vars: dict) -> dict:
    """roles/alertmanager's alertmanager.yml with its defaults and ``extra_vars``, rendered by Ansible."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "vars.json").write_text(json.dumps({"out": str(tmp_path / "alertmanager.yml"), **extra_vars}))
    (tmp_path / "render.yml").write_text(
        "- hosts: localhost\n"
        "  gather_facts: false\n"
        f"  vars_files: [{REPO / 'roles/alertmanager/defaults/main.yml'}]\n"
        "  tasks:\n"
        "    - ansible.builtin.template:\n"
        f"        src: {REPO / 'roles/alertmanager/templates/alertmanager.yml.j2'}\n"
        "        dest: '{{ out }}'\n"
        "        mode: '0600'\n"
    )
    r = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                        "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"@{tmp_path / 'vars.json'}",
                        str(tmp_path / "render.yml")],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return yaml.safe_load((tmp_path / "alertmanager.yml").read_text())


def test_alertmanager_sends_every_alert_to_the_inventorys_receivers(tmp_path):
    """Webhooks and mail get every gpuhub alert; the always-firing watchdog goes only to the dead
    man's switch. (The cluster test delivers through a real Alertmanager; amtool validates the file
    when the role installs it.)"""
    cfg = render_alertmanager(tmp_path / "full", {
        "alertmanager_webhook_urls": ["https://chat.example.org/hook"],
        "alertmanager_email_to": "ops@example.org", "alertmanager_email_from": "gpuhub@example.org",
        "alertmanager_email_smarthost": "smtp.example.org:587", "alertmanager_email_auth_username": "gpuhub",
        "alertmanager_email_auth_password": "s3cret: with a colon", "alertmanager_watchdog_url": "https://dms.example/x",
    })
    receivers = {r["name"]: r for r in cfg["receivers"]}
    assert cfg["route"]["receiver"] == "gpuhub"
    assert receivers["gpuhub"]["webhook_configs"] == [{"url": "https://chat.example.org/hook", "send_resolved": True}]
    assert receivers["gpuhub"]["email_configs"] == [{"to": "ops@example.org", "send_resolved": True}]
    assert cfg["global"]["smtp_auth_password"] == "s3cret: with a colon"
    assert cfg["global"]["smtp_smarthost"] == "smtp.example.org:587" and cfg["global"]["smtp_require_tls"] is True
    (watchdog,) = cfg["route"]["routes"]
    assert watchdog["receiver"] == "watchdog" and watchdog["matchers"] == ['alertname = "GpuhubWatchdog"']
    assert receivers["watchdog"]["webhook_configs"] == [{"url": "https://dms.example/x"}]

    bare = render_alertmanager(tmp_path / "bare", {})  # the defaults: no receiver, no mail settings
    assert "global" not in bare
    assert {r["name"]: r for r in bare["receivers"]} == {"gpuhub": {"name": "gpuhub"}, "watchdog": {"name": "watchdog"}}


def test_prometheus_sends_alerts_to_the_alertmanager_beside_it_unless_turned_off(tmp_path):
    inv = local_inventory({"box": {"ansible_host": "127.0.0.1"}}, {"hub": ["box"], "monitoring": ["box"]})
    on = yaml.safe_load((run_role_config(tmp_path / "on", inv, {}) / "prometheus.yml").read_text())
    assert on["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": ["127.0.0.1:9093"]}]}]
    off = yaml.safe_load((run_role_config(tmp_path / "off", inv, {"gpuhub_alertmanager": False})
                          / "prometheus.yml").read_text())
    assert "alerting" not in off
