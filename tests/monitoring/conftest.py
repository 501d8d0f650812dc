"""Fixtures for the monitoring tests: a real Prometheus (Debian's package) on 127.0.0.1 that
scrapes small local exporters serving gpuhub, JupyterHub, DCGM and node metrics, with the
prometheus.yml and recording rules that roles/prometheus renders from a test inventory.

Only 127.0.0.1 is contacted. Prometheus is installed with apt-get when missing (the test is
skipped, with the reason, only where that is impossible).
"""

from __future__ import annotations

import getpass
import grp
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuhub.platform.http_client import ApiClientError, default_client

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- Prometheus binaries


def _install_prometheus() -> str | None:
    """apt-get install Debian's prometheus; returns why it failed, or None."""
    if os.geteuid() != 0:
        return "prometheus is not installed and the tests do not run as root (apt-get install -y prometheus)"
    if not shutil.which("apt-get"):
        return "prometheus is not installed and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    r = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], check=False, env=env, capture_output=True, timeout=600)
        r = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return f"apt-get install prometheus failed: {r.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="session")
def prometheus_bins() -> SimpleNamespace:
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        why = _install_prometheus()
        if why:
            pytest.skip(why)
    return SimpleNamespace(prometheus=shutil.which("prometheus"), promtool=shutil.which("promtool"))


# --------------------------------------------------------------------------- local exporters


@dataclass
class Exporter:
    """An HTTP server on 127.0.0.1 serving one exposition, optionally behind a bearer token."""

    name: str
    path: str
    body: Callable[[], bytes]
    token_file: Path | None = None
    port: int = 0
    scrapes: int = 0
    refused: int = 0
    server: ThreadingHTTPServer | None = field(default=None, repr=False)

    def start(self) -> None:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if urllib.parse.urlsplit(self.path).path != exporter.path:
                    self.send_error(404)
                    return
                if exporter.token_file is not None:
                    want = "Bearer " + exporter.token_file.read_text().strip()
                    if self.headers.get("Authorization") != want:
                        exporter.refused += 1
                        self.send_error(401)
                        return
                exporter.scrapes += 1
                data = exporter.body()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def _agent_body(node: str, gpus: int, pending: int, committed: int) -> Callable[[], bytes]:
    """The lead's real AgentCollector over a stub agent; counters grow at every scrape."""
    from prometheus_client import generate_latest

    from gpuhub.agent.metrics import agent_registry

    counters = {"granted": 0, "refused": 0, "expired": 0, "released": 0}
    agent = SimpleNamespace(
        config=SimpleNamespace(node_name=node),
        book=SimpleNamespace(gpu_count=gpus, pending=pending, committed=committed, busy=set(range(committed))),
        units={"k1": SimpleNamespace(kind="kernel"), "s1": SimpleNamespace(kind="server")},
        counters=counters,
        gpus=lambda: [
            SimpleNamespace(
                index=i,
                uuid=f"GPU-{node}-{i}",
                memory_used_bytes=(i + 1) * 2**30,
                memory_total_bytes=40 * 2**30,
                utilization_percent=25.0 * (i + 1),
            )
            for i in range(gpus)
        ],
    )
    registry = agent_registry(agent)

    def body() -> bytes:
        counters["granted"] += 3
        counters["refused"] += 1
        counters["expired"] += 1
        counters["released"] += 2
        return generate_latest(registry)

    return body


def _scheduler_body() -> Callable[[], bytes]:
    """The lead's real SchedulerCollector over a stub scheduler."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpuhub.scheduler.api import SchedulerCollector

    view = lambda g, p, c: SimpleNamespace(schedulable=True, gpu_count=g, pending=p, committed=c)
    sched = SimpleNamespace(
        node_views=lambda: [view(4, 6, 1), view(2, 3, 1)],
        nodes={"gpu1": 1, "gpu2": 2, "hub1": 3},
        kernels={"k1": 1, "k2": 2, "k3": 3},
        counters={"placements": 0, "placement_failures": 0, "replacements": 0},
    )
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SchedulerCollector(sched))

    def body() -> bytes:
        sched.counters["placements"] += 2
        sched.counters["placement_failures"] += 1
        return generate_latest(reg)

    return body


def _jupyterhub_body() -> Callable[[], bytes]:
    """JupyterHub's own metric objects (jupyterhub.metrics), so names match the real hub."""
    from jupyterhub import metrics as jm
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    # Same names, label names and buckets as the hub's metrics, in a registry of our own.
    active = Gauge("active_users", "", jm.ACTIVE_USERS._labelnames, namespace="jupyterhub", registry=reg)
    running = Gauge("running_servers", "", namespace="jupyterhub", registry=reg)
    total = Gauge("total_users", "", namespace="jupyterhub", registry=reg)
    spawn = Histogram(
        "server_spawn_duration_seconds", "", jm.SERVER_SPAWN_DURATION_SECONDS._labelnames,
        namespace="jupyterhub", registry=reg, buckets=jm.SERVER_SPAWN_DURATION_SECONDS._upper_bounds,
    )
    for period in jm.ActiveUserPeriods:
        active.labels(period=period.value).set(5)
    running.set(3)
    total.set(12)
    labels = {name: ("success" if name == "status" else "ok") for name in jm.SERVER_SPAWN_DURATION_SECONDS._labelnames}

    def body() -> bytes:
        spawn.labels(**labels).observe(2.0)
        spawn.labels(**labels).observe(8.0)
        return generate_latest(reg)

    return body


def _static_body(text: str) -> Callable[[], bytes]:
    return lambda: text.encode()


DCGM_SAMPLE = "".join(
    f'{name}{{gpu="{i}",UUID="GPU-dcgm-{i}",device="nvidia{i}",modelName="NVIDIA A100",Hostname="gpu1"}} {value}\n'
    for i in range(2)
    for name, value in (
        ("DCGM_FI_DEV_GPU_UTIL", 40),
        ("DCGM_FI_DEV_FB_USED", 1024),
        ("DCGM_FI_DEV_FB_FREE", 39936),
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.35),
    )
)
NODE_SAMPLE = "# TYPE node_load1 gauge\nnode_load1 0.5\n"


# --------------------------------------------------------------------------- rendering with Ansible


def run_role_config(tmp: Path, inventory: str, extra_vars: dict) -> Path:
    """Run roles/prometheus tasks_from config.yml on localhost-connected hosts; returns the out dir."""
    out = tmp / "etc-prometheus"
    out.mkdir(parents=True, exist_ok=True)
    user = getpass.getuser()
    extra = {
        "prometheus_user": user,
        "prometheus_config_dir": str(out),
        "prometheus_rules_dir": str(out / "rules"),
        "prometheus_secrets_dir": str(out / "secrets"),
        "gpuhub_credentials_dir": str(tmp / "credentials"),
        "prometheus_service_enabled": False,
        **extra_vars,
    }
    if user != "root":
        # the role uses prometheus_user as group too; a non-root user may lack a same-named group
        try:
            grp.getgrnam(user)
        except KeyError:
            pytest.skip(f"no group named {user} for the rendered token files")
    (tmp / "inventory.ini").write_text(inventory)
    (tmp / "vars.json").write_text(json.dumps(extra))
    (tmp / "render.yml").write_text(
        "- hosts: monitoring\n"
        "  gather_facts: false\n"
        "  tasks:\n"
        "    - ansible.builtin.include_role:\n"
        "        name: prometheus\n"
        "        tasks_from: config.yml\n"
    )
    (tmp / "ansible.cfg").write_text(f"[defaults]\nroles_path = {ROLES}\nretry_files_enabled = false\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(tmp / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-local"), ANSIBLE_REMOTE_TEMP=str(tmp / "ansible-remote"))
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    r = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", str(tmp / "inventory.ini"), "-e", f"@{tmp / 'vars.json'}",
         str(tmp / "render.yml")],
        cwd=tmp, env=env, check=False, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, f"rendering the prometheus role failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    return out


def local_inventory(hosts: dict[str, dict], groups: dict[str, list[str]]) -> str:
    lines = ["[all]"]
    for h, hv in hosts.items():
        lines.append(" ".join([h, *(f"{k}={v}" for k, v in hv.items())]))
    for g, members in groups.items():
        lines.append(f"[{g}]")
        lines.extend(members)
    lines += ["[all:vars]", "ansible_connection=local", f"ansible_python_interpreter={sys.executable}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the whole stack


@dataclass
class Stack:
    url: str
    config_dir: Path
    exporters: dict[str, Exporter]
    proc: subprocess.Popen

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params)
        resp = default_client().request("GET", f"{self.url}{path}?{q}", timeout=10)
        if resp.status >= 400:
            raise ApiClientError(resp.status, resp.data.decode(errors="replace"), path)
        return resp.json()

    def query(self, expr: str) -> dict:
        """POST /api/v1/query; returns the JSON body, errors (HTTP 400/422) included."""
        data = urllib.parse.urlencode({"query": expr}).encode()
        resp = default_client().request("POST", f"{self.url}/api/v1/query", data=data, timeout=10,
                                        headers={"Content-Type": "application/x-www-form-urlencoded"})
        return resp.json()  # bad_data / execution errors (400, 422) have a JSON body too


@pytest.fixture(scope="session")
def monitoring_stack(prometheus_bins, tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("monitoring")
    creds = tmp / "credentials"
    exporters = {
        "agent-gpu1": Exporter("agent-gpu1", "/metrics", _agent_body("gpu1", 4, 6, 1), creds / "agent.token"),
        "agent-gpu2": Exporter("agent-gpu2", "/metrics", _agent_body("gpu2", 2, 3, 1), creds / "agent.token"),
        "agent-hub1": Exporter("agent-hub1", "/metrics", _agent_body("hub1", 0, 0, 0), creds / "agent.token"),
        "scheduler": Exporter("scheduler", "/metrics", _scheduler_body(), creds / "scheduler.token"),
        "jupyterhub": Exporter("jupyterhub", "/hub/metrics", _jupyterhub_body(), creds / "jupyterhub-metrics.token"),
        "node": Exporter("node", "/metrics", _static_body(NODE_SAMPLE)),
        "dcgm": Exporter("dcgm", "/metrics", _static_body(DCGM_SAMPLE)),
    }
    for e in exporters.values():
        e.start()
    port = free_port()
    addr = {"gpuhub_address": "127.0.0.1", "node_exporter_port": exporters["node"].port}
    inventory = local_inventory(
        {
            "gpu1": {**addr, "gpuhub_agent_port": exporters["agent-gpu1"].port},
            "gpu2": {**addr, "gpuhub_agent_port": exporters["agent-gpu2"].port},
            "hub1": {
                **addr,
                "gpuhub_agent_port": exporters["agent-hub1"].port,
                "gpuhub_scheduler_port": exporters["scheduler"].port,
                "gpuhub_hub_api_port": exporters["jupyterhub"].port,
            },
        },
        {"gpu_nodes": ["gpu1", "gpu2"], "notebook_hosts": ["hub1"], "hub": ["hub1"], "monitoring": ["hub1"]},
    )
    config_dir = run_role_config(
        tmp,
        inventory,
        {
            "prometheus_port": port,
            "prometheus_scrape_interval": "1s",
            "prometheus_scrape_timeout": "1s",
            "prometheus_evaluation_interval": "1s",
            "prometheus_gpuhub_rules_interval": "1s",
            "prometheus_dcgm_targets": [{"target": f"127.0.0.1:{exporters['dcgm'].port}", "node": "gpu1"}],
        },
    )
    data = tmp / "data"
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 (lives as long as the process)
    proc = subprocess.Popen(
        [prometheus_bins.prometheus, f"--config.file={config_dir / 'prometheus.yml'}",
         f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={data}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    stack = Stack(f"http://127.0.0.1:{port}", config_dir, exporters, proc)
    try:
        deadline = time.monotonic() + 60
        ready = False
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}")
            try:
                # enough samples for rate(); every recording rule has produced a value
                r = stack.query("min(count_over_time(up[1m])) >= 4 and on() count(cluster:gpuhub_lease_refusals:ratio_rate5m)")
                if r.get("status") == "success" and r["data"]["result"]:
                    ready = True
                    break
            except ApiClientError:
                pass
            time.sleep(0.5)
        if not ready:
            pytest.fail(f"prometheus had no data after 60 s: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        yield stack
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        for e in exporters.values():
            e.stop()
