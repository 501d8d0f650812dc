"""Shared fixtures: real gpuhub daemons on 127.0.0.1 (see gpuhub.devcluster)."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request

import pytest

from gpuhub.devcluster import AgentProcess, SchedulerProcess, current_user  # noqa: F401


@pytest.fixture
def make_agent(tmp_path):
    agents = []

    def make(name: str = "node1", gpus: int = 2, extra: str = "") -> AgentProcess:
        a = AgentProcess(tmp_path, name, gpus, extra).start()
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.stop_units()
        a.stop()


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
        a.stop_units()
        a.stop()
    sched.stop()
