"""Real gpuhub daemons on 127.0.0.1, for tests, benchmarks and trying gpuhub on one machine.

Each daemon is a real process started from a generated config (fake GPUs, the process unit
backend); nothing is mocked. Traffic stays on the loopback interface.

Daemons start in sessions of their own, as systemd would start them: a Ctrl-C in the terminal
reaches only the program that started them (a test run, ``gpuhub local-kernel``), which then stops
them in order: the units through their agents first (an agent stops on a signal but, by design,
leaves its units running), then the agents and the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import tomli_w

from gpuhub.dev.portblocks import reserve_block
from gpuhub.platform.http_client import ApiClientError, call_json, call_json_sync, default_client
from gpuhub.platform.tls import api_scheme


def write_secret(path: Path, value: str) -> None:
    """A token file as the daemons want it: the owner's alone."""
    path.write_text(value)
    path.chmod(0o600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProcess:
    def __init__(self, tmp: Path, name: str, gpus: int, extra: dict | None = None) -> None:
        """``extra``: more agent.toml settings (gpuhub.agent.config.AgentConfig), overriding these.
        The agent hands out kernel ports from a block it owns until ``close`` (gpuhub.dev.portblocks)."""
        self.name = name
        self.port = free_port()
        self.url = f"{api_scheme((extra or {}).get('tls_cert_file', ''))}://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.dir = tmp / name
        (self.dir / "secrets").mkdir(parents=True)
        token_file = self.dir / "secrets" / "agent.token"
        write_secret(token_file, self.token)
        self.ports = reserve_block()
        settings = {
            "node_name": name, "listen_address": "127.0.0.1", "port": self.port, "kernel_ip": "127.0.0.1",
            "token_file": str(token_file), "state_dir": str(self.dir / "state"),
            "runtime_dir": str(self.dir / "run"), "unit_backend": "process", "min_uid": 0,
            "lease_check_interval_s": 0.5, "kernel_ports": [self.ports.first, self.ports.last],
            "gpus": {"backend": "fake" if gpus else "none",
                     "fake": [{"name": "Fake GPU", "memory_mib": 16384} for _ in range(gpus)]},
            **(extra or {}),
        }
        self.config = self.dir / "agent.toml"
        self.config.write_text(tomli_w.dumps(settings))
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        # The child keeps its own copy of the descriptor; this process need not hold the file open.
        with open(self.dir / "agent.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuhub.agent.main", "--config", str(self.config), "--log-level", "DEBUG"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        _wait_answering(self.proc, self.dir / "agent.log", "agent", lambda: self.call("GET", "/api/v1/node"), 20)
        return self

    def stop_units(self) -> None:
        """Stop every unit this agent started: through its API, and then, should the agent be gone,
        every replica process its pid files (process backend) still name."""
        try:
            _, units = self.call("GET", "/api/v1/units")
            for u in units["units"]:
                self.call("DELETE", f"/api/v1/units/{u['name']}")
        except (ApiClientError, KeyError, TypeError):
            pass
        for pid_file in (self.dir / "run" / "units").glob("*/pid"):
            try:
                kill_unit_process(int(pid_file.read_text()))
            except (OSError, ValueError):
                pass

    def unit_pids(self) -> list[int]:
        """The pids of the unit processes this agent started that still run (process backend)."""
        pids = []
        for pid_file in (self.dir / "run" / "units").glob("*/pid"):
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            if is_unit_process(pid):
                pids.append(pid)
        return pids

    def hold_gpu(self, holder: str, timeout_s: float = 10.0) -> tuple[str, str]:
        """Another user's cell holds one of this node's GPUs: a kernel unit ``holder`` (never run
        as a kernel by anyone) takes a lease. Waits for a GPU to free (the last cell of a kernel
        gives its own back just after its reply). Returns (lease token, lease id) for the DELETE."""
        from gpuhub.agent.units import ProcessRunner

        name = f"gpuhub-kernel-{holder}-r0"
        status, unit = self.call("POST", "/api/v1/units", {
            "name": name, "kind": "kernel", "user": current_user(), "gpus": 1, "cwd": os.getcwd(),
            "kernel": {"key": "k", "kernel_id": holder}})
        if status != 201:
            raise RuntimeError(f"agent {self.name} refused the holder unit: {unit}")
        token = ProcessRunner(str(self.dir / "run"), 0).read_env(name)["GPUHUB_LEASE_TOKEN"]
        deadline = time.monotonic() + timeout_s
        while True:
            status, lease = self.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
            if status == 200:
                return token, lease["lease_id"]
            if status != 409 or time.monotonic() > deadline:
                raise RuntimeError(f"agent {self.name} granted no GPU to {holder}: {lease}")
            time.sleep(0.05)

    def unit_log_tail(self, name: str, lines: int = 20) -> str:
        """The end of a unit's output, where the process backend keeps it (``<runtime_dir>/logs``)."""
        try:
            text = (self.dir / "run" / "logs" / f"{name}.log").read_bytes()[-64 * 1024:].decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)

    def close(self) -> None:
        """The end of this agent: its units, its process, then its port block. (``stop`` alone
        keeps the block: an agent restarted on the same config hands out the same ports.)"""
        self.stop_units()
        self.stop()
        self.ports.close()
        default_client().discard(self.url)  # its kept connections would linger in CLOSE_WAIT

    def call(self, method: str, path: str, body=None, token: str | None = "admin", raw: bytes | None = None):
        if token == "admin":
            token = self.token
        resp = default_client().request(method, self.url + path, token=token, body=body, data=raw, timeout=10)
        if resp.status < 400 and "json" not in resp.headers.get("Content-Type", ""):
            return resp.status, resp.data.decode()
        return resp.status, json.loads(resp.data or b"null")


def is_unit_process(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie) and is a unit the process backend started (a replica
    or a server leads its own session), not an unrelated process that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] != "Z" and int(fields[3]) == pid  # state, session id
    except (OSError, IndexError, ValueError):
        return False


def kill_unit_process(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the session a unit process leads, SIGKILL it after ``grace_s``; wait until it is gone."""
    if not is_unit_process(pid):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while is_unit_process(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if is_unit_process(pid):
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _wait_answering(proc: subprocess.Popen, log: Path, what: str, probe, timeout_s: float) -> None:
    """Return once ``probe()`` (a request to the daemon's API) succeeds; RuntimeError with the
    daemon's log if it died, or if it did not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            probe()
            return
        except ApiClientError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} died: {log.read_text()}") from None
        time.sleep(0.1)
    raise RuntimeError(f"the {what} did not answer within {timeout_s:g} s")


class SchedulerProcess:
    def __init__(self, tmp: Path, agent_token: str | dict[str, str], user_tokens: dict[str, str],
                 node_timeout_s: float = 10, replica_dead_grace_s: float = 10, settings: dict | None = None) -> None:
        """``agent_token``: one token for every agent, or each agent's own ({node: token}, as the
        roles deploy them; more with ``add_agent_token``)."""
        self.port = free_port()
        self.url = f"{api_scheme((settings or {}).get('tls_cert_file', ''))}://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.dir = tmp / "scheduler"
        (self.dir / "secrets").mkdir(parents=True)
        write_secret(self.dir / "secrets" / "scheduler.token", self.token)
        if isinstance(agent_token, str):
            write_secret(self.dir / "secrets" / "agent.token", agent_token)
            agents = {"agent_token_file": str(self.dir / "secrets" / "agent.token")}
        else:
            (self.dir / "secrets" / "agents").mkdir()
            agents = {"agent_token_dir": str(self.dir / "secrets" / "agents")}
            for node, token in agent_token.items():
                self.add_agent_token(node, token)
        self.config = self.dir / "scheduler.toml"
        self.config.write_text(tomli_w.dumps({
            "listen_address": "127.0.0.1", "port": self.port,
            "token_file": str(self.dir / "secrets" / "scheduler.token"), **agents,
            "state_dir": str(self.dir / "state"), "node_timeout_s": float(node_timeout_s), "hub_api_url": "",
            "replica_dead_grace_s": float(replica_dead_grace_s), "static_user_tokens": dict(user_tokens),
            **(settings or {}),
        }))

    def add_agent_token(self, node: str, token: str) -> None:
        """The scheduler's copy of ``node``'s agent token (read at each call: no restart)."""
        write_secret(self.dir / "secrets" / "agents" / f"{node}.token", token)

    def start(self) -> SchedulerProcess:
        with open(self.dir / "scheduler.log", "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuhub.scheduler.main", "--config", str(self.config), "--log-level", "DEBUG"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 30) -> SchedulerProcess:
        """Return once its API answers (a scheduler that died or never answers raises RuntimeError)."""
        _wait_answering(self.proc, self.dir / "scheduler.log", "scheduler",
                        lambda: call_json_sync("GET", self.url + "/api/v1/nodes", self.token, timeout=5), timeout_s)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        default_client().discard(self.url)


class DevCluster:
    """A scheduler and ``nodes`` agents with fake GPUs heartbeating to it, all on 127.0.0.1.

    Tokens as the roles deploy them: each agent has its own (the scheduler a copy of each), and
    ``metrics_token`` opens every daemon's /metrics (Prometheus' token)."""

    def __init__(self, tmp: Path, nodes: int = 3, gpus_per_node: int = 2, user_token: str | None = None,
                 node_timeout_s: float = 10, replica_dead_grace_s: float = 10,
                 scheduler_settings: dict | None = None, agent_settings: dict | None = None,
                 other_users: dict[str, str] | None = None) -> None:
        self.tmp = Path(tmp)
        self.other_users = other_users or {}  # more static user tokens: token -> user name
        self.scheduler_settings = scheduler_settings  # more keys of scheduler.toml (quotas, …)
        # more keys of every agent.toml: {"gpus": {"backend": "nvml"}} serves the machine's real GPUs
        self.agent_settings = agent_settings or {}
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.node_timeout_s = node_timeout_s  # no heartbeat this long: the scheduler counts the node lost
        self.replica_dead_grace_s = replica_dead_grace_s  # a replica's unit dead this long is replaced
        self.metrics_token = secrets.token_urlsafe(24)
        self.user_token = user_token or secrets.token_urlsafe(24)
        self.scheduler: SchedulerProcess | None = None
        self.agents: list[AgentProcess] = []

    def start(self, timeout_s: float = 30) -> DevCluster:
        self.tmp.mkdir(parents=True, exist_ok=True)
        metrics_token_file = self.tmp / "metrics.token"
        write_secret(metrics_token_file, self.metrics_token)
        self.scheduler = SchedulerProcess(self.tmp, {}, {self.user_token: current_user(), **self.other_users},
                                          self.node_timeout_s, self.replica_dead_grace_s,
                                          {"metrics_token_file": str(metrics_token_file),
                                           **(self.scheduler_settings or {})}).start()
        for i in range(self.nodes):
            token_file = self.tmp / f"sched-{i}.token"
            write_secret(token_file, self.scheduler.token)
            a = AgentProcess(self.tmp, f"gpu{i + 1}", self.gpus_per_node, extra={
                "scheduler_url": self.scheduler.url, "scheduler_token_file": str(token_file),
                "metrics_token_file": str(metrics_token_file), "heartbeat_interval_s": 0.5, **self.agent_settings})
            self.scheduler.add_agent_token(a.name, a.token)
            self.agents.append(a.start())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                _, body = self.scheduler_call("GET", "/api/v1/nodes", token=self.scheduler.token)
                if sum(n["live"] for n in body["nodes"]) == self.nodes:
                    return self
            except (ApiClientError, KeyError, TypeError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the agents did not register with the scheduler")

    def scheduler_call(self, method: str, path: str, body=None, token: str | None = None, timeout: float = 60):
        resp = default_client().request(method, self.scheduler.url + path, token=token or self.user_token,
                                        body=body, timeout=timeout)
        return resp.status, json.loads(resp.data or b"null")

    def agent(self, node: str) -> AgentProcess:
        return next(a for a in self.agents if a.name == node)

    def stop(self) -> None:
        """Stop everything, in order: the scheduler (so it places nothing more), every unit, the agents."""
        if self.scheduler is not None:
            self.scheduler.stop()
        for a in self.agents:
            a.close()


class LoopThread:
    """An asyncio loop in a thread, for a router while the caller blocks on its client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class DevKernel:
    """A replicated kernel placed by a DevCluster's scheduler, shown as one kernel by a
    :class:`~gpuhub.server.router.KernelRouter` (what the provisioner does inside a Jupyter server),
    with a connected ``BlockingKernelClient`` as ``kc``. For tests and benchmarks."""

    def __init__(self, cluster: DevCluster, gpus: int, replicas: int = 3, ready_timeout_s: float = 120) -> None:
        from jupyter_client import BlockingKernelClient

        from gpuhub.server.regroup import GroupFollower
        from gpuhub.server.router import KernelRouter

        self.cluster = cluster
        self.key = secrets.token_hex(16)
        self.kernel_id = "dev-" + secrets.token_hex(5)
        status, self.record = cluster.scheduler_call("POST", "/api/v1/kernels", {
            "kernel_id": self.kernel_id, "key": self.key, "gpus": gpus, "replicas": replicas,
            "cwd": os.getcwd()})
        if status not in (200, 201):
            raise RuntimeError(f"the scheduler refused the kernel: {self.record}")
        self.loop = LoopThread()
        self.router = KernelRouter([{"id": r["id"], **r["connection"]} for r in self.record["replicas"]],
                                   self.key.encode())
        conn = self.loop.run(self.router.start())
        self.follower = GroupFollower(self.router, self._record_now)  # as the provisioner does
        self.kc = BlockingKernelClient()
        self.kc.load_connection_info({**conn, "key": self.key.encode()})
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=ready_timeout_s)

    def replica(self, rid: int) -> dict:
        return next(r for r in self.record["replicas"] if r["id"] == rid)

    def pid(self, rid: int) -> int:
        r = self.replica(rid)
        _, unit = self.cluster.agent(r["node"]).call("GET", f"/api/v1/units/{r['unit']}")
        return unit["main_pid"]

    async def _record_now(self) -> dict:
        _, record = await call_json("GET", f"{self.cluster.scheduler.url}/api/v1/kernels/{self.kernel_id}",
                                    self.cluster.user_token, timeout=10)
        self.record = record
        return record

    def refresh(self) -> dict:
        """Re-read the kernel from the scheduler and let the router follow it (the provisioner's poll)."""
        status, record = self.cluster.scheduler_call("GET", f"/api/v1/kernels/{self.kernel_id}")
        if status != 200:
            raise RuntimeError(f"the scheduler has no kernel {self.kernel_id}: {record}")
        self.record = record
        replicas = [{"id": r["id"], **r["connection"]} for r in record["replicas"]]

        async def follow() -> None:
            self.router.set_replicas(replicas)

        self.loop.run(follow())
        return record

    def close(self) -> None:
        self.kc.stop_channels()
        try:
            self.loop.run(self.follower.close())
            self.loop.run(self.router.stop())
        finally:
            self.loop.close()
            try:
                self.cluster.scheduler_call("DELETE", f"/api/v1/kernels/{self.kernel_id}")
            except ApiClientError:
                pass
