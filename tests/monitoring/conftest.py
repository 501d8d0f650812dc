"""Fixtures for the monitoring tests: a real Prometheus (Debian's package) on 127.0.0.1 with the
prometheus.yml and recording rules that roles/prometheus renders from a test inventory, scraping

- real gpuhub agents and a real gpuhub scheduler (gpuhub.dev.cluster: fake GPUs), with their tokens
  as the rendered config has them, after real kernels were placed and real leases granted and
  refused through their APIs, so pending, committed and the lease counters are the daemons' own;
- a real prometheus-node-exporter where Debian's package is installed, else a stub;
- stubs for JupyterHub and DCGM (why: see ``Exporter``).

Only 127.0.0.1 is contacted. Prometheus (and the node exporter) are installed with apt-get when
missing (the tests are skipped, with the reason, only where that is impossible).
"""

from __future__ import annotations

import getpass
import grp
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import AgentProcess, DevCluster
from gpuhub.platform.http_client import ApiClientError, default_client
from tests.helpers import wait_for

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
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus", "prometheus-node-exporter"]
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
    """An HTTP server on 127.0.0.1 serving one exposition, optionally behind a bearer token: a stub,
    only for what cannot run here cheaply. JupyterHub: a real hub needs configurable-http-proxy
    (a Node.js program, not in the venv) and a database and spawner set up before /hub/metrics
    answers, so its exposition is made from the hub's own metric objects (jupyterhub.metrics)
    instead; the cluster test checks that Prometheus scrapes the real hub with its token.
    DCGM: dcgm-exporter needs NVIDIA's DCGM and a GPU. The node exporter: only where Debian's
    prometheus-node-exporter is not installed."""

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
        "gpuhub_tls": False,  # the daemons started here serve plain HTTP
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


# --------------------------------------------------------------------------- real gpuhub daemons


@dataclass
class Gpuhub:
    """Real agents (gpu1..gpu3 with 2 fake GPUs each, heartbeating to the scheduler; hub1 with none,
    as on a notebook host) and a real scheduler, with kernels placed and leases taken through their
    APIs. ``kernels``: the scheduler's records; ``books``: each agent's own GET /api/v1/node."""

    dev: DevCluster
    agents: dict[str, AgentProcess]
    kernels: dict[str, dict] = field(default_factory=dict)
    books: dict[str, dict] = field(default_factory=dict)

    def place(self, name: str, gpus: int, replicas: int) -> dict:
        status, record = self.dev.scheduler_call("POST", "/api/v1/kernels", {
            "kernel_id": f"mon-{name}-{secrets.token_hex(3)}", "key": secrets.token_hex(16), "gpus": gpus,
            "replicas": replicas, "cwd": str(self.dev.tmp)})
        assert status in (200, 201), f"the scheduler refused kernel {name}: {record}"
        self.kernels[name] = record
        return record

    def lease(self, kernel: str, node: str, gpus: int) -> int:
        """POST /api/v1/leases as kernel ``kernel``'s replica on ``node`` does for a GPU cell
        (with the lease token from the unit's environment); returns the HTTP status."""
        (rep,) = [r for r in self.kernels[kernel]["replicas"] if r["node"] == node]
        agent = self.agents[node]
        token = ProcessRunner(str(agent.dir / "run"), 0).read_env(rep["unit"])["GPUHUB_LEASE_TOKEN"]
        status, _ = agent.call("POST", "/api/v1/leases", {"gpus": gpus}, token=token)
        return status

    def read_books(self) -> dict[str, dict]:
        self.books = {name: a.call("GET", "/api/v1/node")[1] for name, a in self.agents.items()}
        return self.books

    def stop(self) -> None:
        self.dev.stop()
        hub = self.agents.get("hub1")
        if hub is not None:
            hub.close()


def start_gpuhub(tmp: Path) -> Gpuhub:
    tmp.mkdir(parents=True, exist_ok=True)
    # A default quota, so that the quota panels have a limit to show (docs/quotas.md).
    dev = DevCluster(tmp, nodes=3, gpus_per_node=2,
                     scheduler_settings={"quota_default": {"gpu_hours_per_week": 1000}}).start()
    hub_token = tmp / "hub1-scheduler.token"
    hub_token.write_text(dev.scheduler.token)
    hub_token.chmod(0o600)
    # a notebook host: no GPUs, never a place for replicas, heartbeating like every agent
    hub1 = AgentProcess(tmp, "hub1", 0, extra={"roles": ["notebook"], "scheduler_url": dev.scheduler.url,
                                               "scheduler_token_file": str(hub_token), "heartbeat_interval_s": 0.5,
                                               "metrics_token_file": str(tmp / "metrics.token")})
    dev.scheduler.add_agent_token(hub1.name, hub1.token)
    g = Gpuhub(dev, {a.name: a for a in dev.agents})
    try:
        g.agents["hub1"] = hub1.start()
        # Kernel a: 2 GPUs, 3 replicas (2 pending on each GPU node). Kernel b: 1 GPU, 1 replica (on
        # the node the scheduler picks: "busy" below). Pending 2+2+2+1 = 7.
        g.place("a", gpus=2, replicas=3)
        g.place("b", gpus=1, replicas=1)
        # the scheduler's view of pending comes with the agents' heartbeats
        wait_for(lambda: sum(n["pending"] or 0 for n in dev.scheduler_call(
            "GET", "/api/v1/nodes", token=dev.scheduler.token)[1]["nodes"]) == 7, 20, "pending 7 at the scheduler")
    except BaseException:
        g.stop()
        raise
    return g


def start_node_exporter(tmp: Path) -> tuple[int, subprocess.Popen | None, Exporter | None]:
    """The real prometheus-node-exporter on 127.0.0.1 (one cheap collector), or a stub where the
    Debian package is not installed. Returns (port, process, stub)."""
    exe = shutil.which("prometheus-node-exporter")
    if not exe:
        stub = Exporter("node", "/metrics", _static_body(NODE_SAMPLE))
        stub.start()
        return stub.port, None, stub
    port = free_port()
    proc = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                             "--collector.loadavg"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "node-exporter.log", "wb"))  # noqa: SIM115

    def answers() -> bool:
        assert proc.poll() is None, f"node exporter exited: {(tmp / 'node-exporter.log').read_text()[-2000:]}"
        return b"node_load1" in default_client().request("GET", f"http://127.0.0.1:{port}/metrics", timeout=2).data

    wait_for(answers, 20, "the node exporter to answer", ignore=(ApiClientError,))
    return port, proc, None


# --------------------------------------------------------------------------- the whole stack


@dataclass
class Stack:
    url: str
    config_dir: Path
    exporters: dict[str, Exporter]  # the stubs that remain (see Exporter)
    proc: subprocess.Popen
    gpuhub: Gpuhub | None = None
    busy_node: str = ""  # where kernel b runs, and kernel a holds a lease of 2 GPUs

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params)
        resp = default_client().request("GET", f"{self.url}{path}?{q}", timeout=10)
        if resp.status >= 400:
            raise ApiClientError(resp.status, resp.data.decode(errors="replace"), path)
        return resp.json()

    def query(self, expr: str, at: float | None = None) -> dict:
        """POST /api/v1/query (at ``at``, Unix time, else now); returns the JSON body, errors
        (HTTP 400/422) included."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = urllib.parse.urlencode(params).encode()
        resp = default_client().request("POST", f"{self.url}/api/v1/query", data=data, timeout=10,
                                        headers={"Content-Type": "application/x-www-form-urlencoded"})
        return resp.json()  # bad_data / execution errors (400, 422) have a JSON body too

    def has_data(self, expr: str) -> bool:
        r = self.query(expr)
        return r.get("status") == "success" and bool(r["data"]["result"])


@pytest.fixture(scope="session")
def monitoring_stack(prometheus_bins, tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("monitoring")
    creds = tmp / "credentials"
    creds.mkdir()
    procs: list[subprocess.Popen] = []
    exporters: dict[str, Exporter] = {}
    gpuhub = None
    log = None
    try:
        gpuhub = start_gpuhub(tmp / "gpuhub")
        # The controller's credentials, which the role copies into Prometheus' secrets dir: the
        # daemons' real tokens (an existing file is what Ansible's password lookup returns).
        (creds / "metrics.token").write_text(gpuhub.dev.metrics_token + "\n")
        exporters = {
            "jupyterhub": Exporter("jupyterhub", "/hub/metrics", _jupyterhub_body(),
                                   creds / "jupyterhub-metrics.token"),
            "dcgm": Exporter("dcgm", "/metrics", _static_body(DCGM_SAMPLE)),
        }
        for e in exporters.values():
            e.start()
        node_port, node_proc, node_stub = start_node_exporter(tmp)
        if node_proc:
            procs.append(node_proc)
        if node_stub:
            exporters["node"] = node_stub
        port = free_port()
        addr = {"gpuhub_address": "127.0.0.1", "node_exporter_port": node_port}
        agent_port = {name: {"gpuhub_agent_port": a.port} for name, a in gpuhub.agents.items()}
        inventory = local_inventory(
            {
                "gpu1": {**addr, **agent_port["gpu1"]},
                "gpu2": {**addr, **agent_port["gpu2"]},
                "gpu3": {**addr, **agent_port["gpu3"]},
                "hub1": {
                    **addr,
                    **agent_port["hub1"],
                    "gpuhub_scheduler_port": gpuhub.dev.scheduler.port,
                    "gpuhub_hub_api_port": exporters["jupyterhub"].port,
                },
            },
            {"gpu_nodes": ["gpu1", "gpu2", "gpu3"], "notebook_hosts": ["hub1"], "hub": ["hub1"],
             "monitoring": ["hub1"]},
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
        procs.append(proc)
        (busy,) = [r["node"] for r in gpuhub.kernels["b"]["replicas"]]
        stack = Stack(f"http://127.0.0.1:{port}", config_dir, exporters, proc, gpuhub, busy)

        def prometheus_has(expr: str):
            def check() -> bool:
                assert proc.poll() is None, f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}"
                return stack.has_data(expr)
            return check

        def prometheus_ready() -> bool:  # until then its API answers 503 with a plain-text body
            assert proc.poll() is None, f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}"
            try:
                return default_client().request("GET", f"{stack.url}/-/ready", timeout=5).status == 200
            except ApiClientError:  # not listening yet
                return False

        wait_for(prometheus_ready, 120, "Prometheus to be ready")

        # Every agent scraped once with its counters at 0 ...
        wait_for(prometheus_has('count(gpuhub_agent_leases_granted_total == 0) == 4'), 60,
                 "a first scrape of the four agents", ignore=(ApiClientError,))
        # ... then real lease traffic, so rate() over the counters is not 0: on the busy node kernel
        # a's replica takes both GPUs, and kernel b's replica there is refused one (409).
        assert stack.gpuhub.lease("a", busy, 2) == 200
        assert stack.gpuhub.lease("b", busy, 1) == 409
        gpuhub.read_books()
        # enough samples for rate(); every recording rule has produced a value (the refusal ratio,
        # the last of the rules, needs a granted or refused lease in the last 5 minutes)
        wait_for(prometheus_has("min(count_over_time(up[1m])) >= 4 and on() "
                                "count(cluster:gpuhub_lease_refusals:ratio_rate5m)"),
                 60, f"prometheus data ({tmp / 'prometheus.log'})", interval=0.5, ignore=(ApiClientError,))
        yield stack
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if log:
            log.close()
        for e in exporters.values():
            e.stop()
        if gpuhub:
            gpuhub.stop()
