"""What the scheduler presents to each agent (gpuhub/scheduler/node_tokens.py, ``AgentTokens``)."""

from __future__ import annotations

import asyncio

import pytest

from gpuhub.platform.config import ConfigError
from gpuhub.platform.http_client import ApiClientError
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.node_tokens import AgentTokens
from gpuhub.scheduler.service import NodeRecord, Scheduler


def write_token(path, value: str) -> None:
    path.write_text(value + "\n")
    path.chmod(0o600)


def test_each_server_gets_the_token_in_its_file_read_at_each_call(tmp_path):
    write_token(tmp_path / "gpu1.token", "a" * 32)
    tokens = AgentTokens(directory=str(tmp_path))
    assert tokens.for_node("gpu1") == "a" * 32
    write_token(tmp_path / "gpu1.token", "b" * 32)  # rotated: no restart
    assert tokens.for_node("gpu1") == "b" * 32
    with pytest.raises(ConfigError, match="gpu2"):
        tokens.for_node("gpu2")  # no file: no token, never another server's
    for name in ("../gpu1", "gpu1/x", "", ".hidden", "gpu1\n"):
        with pytest.raises(ConfigError, match="not a server name"):
            tokens.for_node(name)


def test_without_a_directory_every_agent_gets_the_one_token(tmp_path):
    assert AgentTokens("t" * 32).for_node("anything") == "t" * 32
    with pytest.raises(ConfigError, match="neither"):
        AgentTokens()
    with pytest.raises(ConfigError, match="not a directory"):
        AgentTokens(directory=str(tmp_path / "missing"))


def test_a_server_without_a_token_is_an_agent_call_that_failed(tmp_path):
    """Callers handle it as an agent that did not answer (logged, retried), not as a crash."""
    (tmp_path / "agents").mkdir()
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path / "state")), AgentTokens(directory=str(tmp_path / "agents")))
    node = NodeRecord("gpu7", "http://127.0.0.1:9", {}, 0.0)
    with pytest.raises(ApiClientError, match="gpu7") as caught:
        asyncio.run(s.call_agent(node, "GET", "/api/v1/units"))
    assert caught.value.status == 0
