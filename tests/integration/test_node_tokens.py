"""Each server's own token (gpuhub/scheduler/node_tokens.py): its agent heartbeats and asks for
migrations with it, for itself only; it opens nothing of the scheduler's admin API."""

from __future__ import annotations

import secrets

from gpuhub.dev.cluster import AgentProcess, SchedulerProcess
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
