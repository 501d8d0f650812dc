"""Shared fixtures: a real gpuhub-agent process on 127.0.0.1 with fake GPUs (process unit backend)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProcess:
    def __init__(self, tmp: Path, name: str, gpus: int, extra: str = "") -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.dir = tmp / name
        (self.dir / "secrets").mkdir(parents=True)
        token_file = self.dir / "secrets" / "agent.token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        fake = ", ".join('{ name = "Fake GPU", memory_mib = 16384 }' for _ in range(gpus))
        self.config = self.dir / "agent.toml"
        self.config.write_text(
            f'node_name = "{name}"\nlisten_address = "127.0.0.1"\nport = {self.port}\n'
            f'kernel_ip = "127.0.0.1"\ntoken_file = "{token_file}"\nstate_dir = "{self.dir}/state"\n'
            f'runtime_dir = "{self.dir}/run"\nunit_backend = "process"\nmin_uid = 0\n'
            f'lease_check_interval_s = 0.5\n{extra}\n'
            f'[gpus]\nbackend = "{"fake" if gpus else "none"}"\nfake = [{fake}]\n'
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> "AgentProcess":
        self.log = open(self.dir / "agent.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuhub.agent.main", "--config", str(self.config), "--log-level", "DEBUG"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                self.call("GET", "/api/v1/node")
                return self
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"agent died: {(self.dir / 'agent.log').read_text()}")
                time.sleep(0.1)
        raise RuntimeError("agent did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)

    def call(self, method: str, path: str, body=None, token: str | None = "admin", raw: bytes | None = None):
        headers = {"Content-Type": "application/json"}
        if token == "admin":
            token = self.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, method=method, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null") if "json" in resp.headers.get("Content-Type", "") else resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture
def make_agent(tmp_path):
    agents = []

    def make(name: str = "node1", gpus: int = 2, extra: str = "") -> AgentProcess:
        a = AgentProcess(tmp_path, name, gpus, extra).start()
        agents.append(a)
        return a

    yield make
    for a in agents:
        # stop kernels the agent started, then the agent
        try:
            _, units = a.call("GET", "/api/v1/units")
            for u in units["units"]:
                a.call("DELETE", f"/api/v1/units/{u['name']}")
        except Exception:
            pass
        a.stop()


def current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


class SchedulerProcess:
    def __init__(self, tmp: Path, agent_token: str, user_tokens: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        self.dir = tmp / "scheduler"
        (self.dir / "secrets").mkdir(parents=True)
        for name, value in (("scheduler.token", self.token), ("agent.token", agent_token)):
            p = self.dir / "secrets" / name
            p.write_text(value)
            p.chmod(0o600)
        static = ", ".join(f'"{t}" = "{u}"' for t, u in user_tokens.items())
        self.config = self.dir / "scheduler.toml"
        self.config.write_text(
            f'listen_address = "127.0.0.1"\nport = {self.port}\n'
            f'token_file = "{self.dir}/secrets/scheduler.token"\nagent_token_file = "{self.dir}/secrets/agent.token"\n'
            f'state_dir = "{self.dir}/state"\nnode_timeout_s = 10\nhub_api_url = ""\n'
            f'static_user_tokens = {{ {static} }}\n'
        )

    def start(self) -> "SchedulerProcess":
        self.log = open(self.dir / "scheduler.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuhub.scheduler.main", "--config", str(self.config), "--log-level", "DEBUG"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def cluster(tmp_path):
    """A scheduler and three agents (2 fake GPUs each) heartbeating to it, all on 127.0.0.1."""
    agent_token = secrets.token_urlsafe(24)
    user_token = secrets.token_urlsafe(24)
    sched = SchedulerProcess(tmp_path, agent_token, {user_token: current_user()}).start()
    agents = []
    for i in range(3):
        sched_token_file = tmp_path / f"sched-{i}.token"
        sched_token_file.write_text(sched.token)
        sched_token_file.chmod(0o600)
        a = AgentProcess(tmp_path, f"gpu{i + 1}", 2, extra=(
            f'scheduler_url = "{sched.url}"\nscheduler_token_file = "{sched_token_file}"\nheartbeat_interval_s = 0.5'))
        a.token = agent_token
        (a.dir / "secrets" / "agent.token").write_text(agent_token)
        agents.append(a.start())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(sched.url + "/api/v1/nodes", headers={"Authorization": f"Bearer {sched.token}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if sum(n["live"] for n in json.loads(resp.read())["nodes"]) == 3:
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    else:
        raise RuntimeError("agents did not register")
    yield {"scheduler": sched, "agents": agents, "user_token": user_token}
    for a in agents:
        try:
            _, units = a.call("GET", "/api/v1/units")
            for u in units["units"]:
                a.call("DELETE", f"/api/v1/units/{u['name']}")
        except Exception:
            pass
        a.stop()
    sched.stop()
