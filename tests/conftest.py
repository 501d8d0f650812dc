"""Shared fixtures: real gpuhub daemons on 127.0.0.1 (see gpuhub.dev.cluster)."""

from __future__ import annotations

import pytest

from gpuhub.dev.cluster import AgentProcess, DevCluster, SchedulerProcess, current_user  # noqa: F401


@pytest.fixture
def make_agent(tmp_path):
    agents = []

    def make(name: str = "node1", gpus: int = 2, extra: dict | None = None) -> AgentProcess:
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
    c = DevCluster(tmp_path).start()
    yield {"scheduler": c.scheduler, "agents": c.agents, "user_token": c.user_token, "dev": c}
    c.stop()
