"""The tokens of each server (gpuhub/scheduler/node_tokens.py). Its node token: its agent
heartbeats and asks for migrations with it, for itself only; it opens nothing of the scheduler's
admin API. Its agent token: the scheduler (and the hub) present it to that agent only, and no other
agent takes it. And the metrics token, Prometheus', which opens /metrics and nothing else."""

from __future__ import annotations

import os
import secrets

import pytest

from gpuhub.dev.cluster import AgentProcess, DevCluster, SchedulerProcess
from gpuhub.platform.http_client import default_client
from tests.helpers import wait_for


def write_token(path, value: str) -> None:
    path.write_text(value + "\n")
    path.chmod(0o600)


def test_a_servers_token_speaks_for_that_server_only_and_new_servers_need_no_restart(tmp_path):
    tokens = tmp_path / "nodes"
    tokens.mkdir()
    gpu1 = secrets.token_urlsafe(24)
    write_token(tokens / "gpu1.token", gpu1)
    sched = SchedulerProcess(tmp_path, "agent-token-" + secrets.token_urlsafe(8), {},
                             settings={"node_token_dir": str(tokens)}).start().wait_ready()
    agent = None
    try:
        def call(method: str, path: str, token: str, body=None):
            resp = default_client().request(method, sched.url + path, token=token, body=body, timeout=10)
            return resp.status, resp.json()

        # An agent with its own token registers.
        write_token(tmp_path / "gpu1-node.token", gpu1)
        agent = AgentProcess(tmp_path, "gpu1", 1, extra={
            "scheduler_url": sched.url, "scheduler_token_file": str(tmp_path / "gpu1-node.token"),
            "heartbeat_interval_s": 0.5}).start()
        wait_for(lambda: any(n["node"] == "gpu1" and n["live"]
                             for n in call("GET", "/api/v1/nodes", sched.token)[1]["nodes"]),
                 10, "gpu1 to register with its own token")

        beat = {"node": "gpu2", "url": "http://127.0.0.1:9", "gpu_count": 8}
        status, body = call("POST", "/api/v1/nodes/heartbeat", gpu1, beat)
        assert status == 403 and "cannot speak for 'gpu2'" in body["error"]
        status, body = call("POST", "/api/v1/kernels/k1/migrate", gpu1, {"node": "gpu2"})
        assert status == 403
        for method, path, payload in (("GET", "/api/v1/nodes", None), ("GET", "/metrics", None),
                                      ("PUT", "/api/v1/nodes/gpu1/drain", {"drained": True}),
                                      ("POST", "/api/v1/quota/alice/extra", {"gpu_hours": 5}),
                                      ("GET", "/api/v1/kernels", None)):
            assert call(method, path, gpu1, payload)[0] == 401, path  # no admin, no user
        assert "gpu2" not in {n["node"] for n in call("GET", "/api/v1/nodes", sched.token)[1]["nodes"]}

        # A server added later: its token file appears, the scheduler takes it without a restart.
        gpu2 = secrets.token_urlsafe(24)
        status, _ = call("POST", "/api/v1/nodes/heartbeat", gpu2, beat)
        assert status == 401
        write_token(tokens / "gpu2.token", gpu2)
        wait_for(lambda: call("POST", "/api/v1/nodes/heartbeat", gpu2, beat)[0] == 200, 15,
                 "the scheduler to read the new server's token")
    finally:
        if agent is not None:
            agent.close()
        sched.stop()


def test_a_node_token_dir_that_is_not_there_stops_the_scheduler(tmp_path):
    import subprocess
    import sys

    sched = SchedulerProcess(tmp_path, "agent-token-" + secrets.token_urlsafe(8), {},
                             settings={"node_token_dir": str(tmp_path / "missing")})
    done = subprocess.run([sys.executable, "-m", "gpuhub.scheduler.main", "--config", str(sched.config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "node_token_dir" in done.stderr and "not a directory" in done.stderr


@pytest.fixture
def three_servers(tmp_path):
    c = DevCluster(tmp_path, nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


def status_of(url: str, method: str, path: str, token: str, body=None) -> int:
    return default_client().request(method, url + path, token=token, body=body, timeout=10).status


def test_each_agent_takes_its_own_token_only_and_the_scheduler_presents_each_its_own(three_servers, tmp_path):
    """Root on one server sees its agent's token in the scheduler's requests: no other agent takes it.
    The scheduler reads each agent's token at each call, so a rotated one needs no restart."""
    c = three_servers
    for agent in c.agents:
        assert status_of(agent.url, "GET", "/api/v1/node", agent.token) == 200
        for other in c.agents:
            if other is not agent:
                assert status_of(agent.url, "GET", "/api/v1/node", other.token) == 401, (agent.name, other.name)
                assert status_of(agent.url, "POST", "/api/v1/units", other.token, {
                    "name": "gpuhub-kernel-x-r0", "kind": "kernel", "user": "nobody"}) == 401

    # gpu3's token is rotated: its agent restarts with the new one, the scheduler's copy is replaced.
    gpu3 = c.agent("gpu3")
    gpu3.stop()
    gpu3.token = secrets.token_urlsafe(24)
    (gpu3.dir / "secrets" / "agent.token").write_text(gpu3.token)
    c.scheduler.add_agent_token("gpu3", gpu3.token)
    gpu3.start()

    # A kernel whose three replicas need all three agents: placed, one unit on each, then stopped.
    status, record = c.scheduler_call("POST", "/api/v1/kernels", {
        "kernel_id": "own-tokens", "key": secrets.token_hex(16), "gpus": 0, "replicas": 3, "cwd": os.getcwd()})
    assert status == 201, record
    assert sorted(r["node"] for r in record["replicas"]) == ["gpu1", "gpu2", "gpu3"]
    for agent in c.agents:
        _, units = agent.call("GET", "/api/v1/units")
        assert [u["kernel_id"] for u in units["units"]] == ["own-tokens"], agent.name
    assert c.scheduler_call("DELETE", "/api/v1/kernels/own-tokens")[0] == 200
    for agent in c.agents:
        assert agent.call("GET", "/api/v1/units")[1]["units"] == [], agent.name


def test_the_metrics_token_opens_metrics_and_nothing_else(three_servers):
    c = three_servers
    token = c.metrics_token
    for agent in c.agents:
        assert status_of(agent.url, "GET", "/metrics", token) == 200
        for method, path, body in (("GET", "/api/v1/node", None), ("GET", "/api/v1/units", None),
                                   ("GET", "/api/v1/quota", None), ("POST", "/api/v1/leases", {"gpus": 1}),
                                   ("DELETE", "/api/v1/units/gpuhub-kernel-x-r0", None)):
            assert status_of(agent.url, method, path, token, body) == 401, (agent.name, path)
    sched = c.scheduler.url
    assert status_of(sched, "GET", "/metrics", token) == 200
    for method, path, body in (("GET", "/api/v1/nodes", None), ("GET", "/api/v1/kernels", None),
                               ("POST", "/api/v1/nodes/heartbeat", {"node": "gpu1", "url": "http://x", "gpu_count": 1}),
                               ("PUT", "/api/v1/nodes/gpu1/drain", {"drained": True}), ("GET", "/api/v1/quota", None)):
        assert status_of(sched, method, path, token, body) == 401, path
    # The admin tokens still read metrics (an admin with curl).
    assert status_of(sched, "GET", "/metrics", c.scheduler.token) == 200
    assert status_of(c.agents[0].url, "GET", "/metrics", c.agents[0].token) == 200
