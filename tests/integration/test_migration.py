"""Migration: a cell whose kernel's servers are all busy runs on a server that can grant, once,
with the kernel's state (scheduler, agents with fake GPUs, replica processes, the router and a
real Jupyter client; docs/architecture.md, "Migration")."""

from __future__ import annotations

import os
import signal
from queue import Empty

from gpuhub.agent.units import ProcessRunner
from gpuhub.kernel.wait_notice import notice_text
from gpuhub.platform.http_client import default_client
from tests.helpers import wait_for
from tests.integration.test_replicated import (
    assert_equal_namespaces,
    eventually,
    executor_node,
    ok,
    one_gpu_kernel_on_four_nodes,
    spare_node,
    take_the_gpu,
)


def scheduler_metrics(cluster) -> str:
    resp = default_client().request("GET", cluster.scheduler.url + "/metrics", token=cluster.scheduler.token,
                                    timeout=30)
    assert resp.status == 200
    return resp.data.decode()


def run_collecting(kernel, code: str, timeout: float = 120) -> tuple[dict, dict]:
    streams = {"stdout": "", "stderr": "", "notices": []}

    def on_output(msg):
        if (text := notice_text(msg["msg_type"], msg["content"])) is not None:  # "waiting for a GPU"
            streams["notices"].append(text)
        elif msg["msg_type"] == "stream":
            streams[msg["content"]["name"]] += msg["content"]["text"]

    reply = kernel.kc.execute_interactive(code, timeout=timeout, output_hook=on_output)
    return reply["content"], streams


def test_a_cell_whose_servers_are_all_busy_moves_to_a_free_server_and_runs_once_with_its_state(tmp_path):
    with one_gpu_kernel_on_four_nodes(tmp_path) as (cluster, kernel):
        runs = tmp_path / "runs.txt"
        ok(kernel, "import numpy as np\nbig = np.arange(2_000_000, dtype=np.float64)\nx = 41\n"
                   "class Box:\n    pass\nbox = Box(); box.items = [big, big]")
        placed = {r["node"] for r in kernel.record["replicas"]}
        spare = spare_node(cluster, kernel)
        for node in placed:  # other users' cells hold every GPU of the kernel's three servers
            take_the_gpu(cluster.agent(node), f"hog{node[-1]}")

        reply, streams = run_collecting(kernel, (
            f"open({str(runs)!r}, 'a').write('ran\\n')\n"
            "x += 1\nimport os\nprint(os.environ['GPUHUB_NODE'], x, float(big.sum()), box.items[0] is box.items[1])"))

        assert reply["status"] == "ok", (reply, streams)
        assert streams["notices"][0] == f"[gpuhub] waiting for a GPU: moving this kernel to {spare}…", streams
        assert not any("all busy" in text for text in streams["notices"]), streams  # one status, not two
        assert not streams["stderr"], streams
        assert streams["stdout"].split() == [spare, "42", str(float(sum(range(2_000_000)))), "True"], streams
        assert runs.read_text() == "ran\n"  # exactly once, although three replicas had the cell

        record = kernel.refresh()
        nodes = {r["node"] for r in record["replicas"]}
        assert spare in nodes and len(nodes) == 3
        rids = tuple(r["id"] for r in record["replicas"])
        eventually(lambda: assert_equal_namespaces(kernel, ["x"], rids)["x"] == "42", 60, "every replica at x = 42")
        assert executor_node(kernel) == spare  # sticky: the next cell runs where the GPU is
        _, nodes_body = cluster.scheduler_call("GET", "/api/v1/nodes", token=cluster.scheduler.token)
        assert any(n["node"] == spare and n["kernel_replicas"] == 1 for n in nodes_body["nodes"])
        metrics = scheduler_metrics(cluster)
        assert "gpuhub_scheduler_migrations_total 1.0" in metrics, metrics


def test_a_migration_is_refused_unless_a_replicas_server_asks_for_a_kernel_none_of_whose_servers_can_grant(
        tmp_path):
    with one_gpu_kernel_on_four_nodes(tmp_path) as (cluster, kernel):
        spare = spare_node(cluster, kernel)
        # User code can read its replica's lease token and ask its agent: nothing moves while a
        # server of the kernel could grant (a move restarts a replica).
        rep = kernel.record["replicas"][0]
        agent = cluster.agent(rep["node"])
        token = ProcessRunner(str(agent.dir / "run"), 0).read_env(rep["unit"])["GPUHUB_LEASE_TOKEN"]
        status, body = agent.call("POST", "/api/v1/migrations", {}, token=token)
        assert status == 409 and "can grant 1 GPU(s) now" in body["error"], body
        status, body = agent.call("POST", "/api/v1/migrations", {}, token="not-a-token")
        assert status == 401, body
        status, body = cluster.scheduler_call("POST", f"/api/v1/kernels/{kernel.kernel_id}/migrate",
                                              {"node": spare}, token=cluster.scheduler.token)
        assert status == 403 and "holds no replica" in body["error"], body
        status, body = cluster.scheduler_call("POST", "/api/v1/kernels/no-such/migrate", {"node": spare},
                                              token=cluster.scheduler.token)
        assert status == 404, body
        status, body = cluster.scheduler_call("POST", f"/api/v1/kernels/{kernel.kernel_id}/migrate",
                                              {"node": spare})  # a user's token is not an agent's
        assert status == 401, body


def test_a_move_whose_new_replica_dies_while_it_catches_up_still_runs_the_cell_once(tmp_path):
    """The new replica on the target server is killed as soon as it starts (the server's power
    went, or the process crashed): the group still has its majority, healing replaces the dead
    newcomer, and the waiting cell runs once with its state; nothing is lost."""
    with one_gpu_kernel_on_four_nodes(tmp_path, replica_dead_grace_s=1) as (cluster, kernel):
        runs = tmp_path / "runs.txt"
        ok(kernel, "import numpy as np\nbig = np.arange(1_000_000)\nx = 1")
        placed = {r["node"] for r in kernel.record["replicas"]}
        spare = spare_node(cluster, kernel)
        for node in placed:
            take_the_gpu(cluster.agent(node), f"hog{node[-1]}")
        target = cluster.agent(spare)
        msg_id = kernel.kc.execute(f"open({str(runs)!r}, 'a').write('ran\\n')\nx += 1\n"
                                   "import os; print(os.environ['GPUHUB_NODE'], x, int(big.sum()))")

        def newcomer_killed() -> bool:
            pids = target.unit_pids()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return bool(pids)
        wait_for(newcomer_killed, 60, f"the new replica on {spare} to start", interval=0.02)

        def replied():
            kernel.refresh()  # the provisioner's poll: the router meets the newcomer's replacement
            reply = kernel.kc.get_shell_msg(timeout=0.5)
            return reply if reply["parent_header"].get("msg_id") == msg_id else None
        reply = wait_for(replied, 120, "the cell's reply", interval=0.1, ignore=(Empty,))
        assert reply["content"]["status"] == "ok", reply["content"]
        assert runs.read_text() == "ran\n"
        record = kernel.refresh()
        rids = tuple(r["id"] for r in record["replicas"])
        assert spare in {r["node"] for r in record["replicas"]}
        eventually(lambda: assert_equal_namespaces(kernel, ["x"], rids)["x"] == "2", 60, "every replica at x = 2")


def test_a_move_is_called_off_when_the_replica_to_move_got_a_gpu_meanwhile(tmp_path):
    """Found by the 20-user load benchmark: between the scheduler's "every server is busy" and the
    group change, the replica chosen to move got its server's GPU and was elected to run the
    waiting cell; the move then took it out of the group and the cell waited for good. The
    scheduler now fences the replica first (its agent grants it nothing more) and calls the move
    off when it already holds a GPU: that replica runs the cell where it is."""
    with one_gpu_kernel_on_four_nodes(tmp_path) as (cluster, kernel):
        spare = spare_node(cluster, kernel)
        tokens = {}
        for rep in kernel.record["replicas"]:  # each replica's own lease holds its server's GPU
            agent = cluster.agent(rep["node"])
            tokens[rep["id"]] = ProcessRunner(str(agent.dir / "run"), 0).read_env(rep["unit"])["GPUHUB_LEASE_TOKEN"]
            assert agent.call("POST", "/api/v1/leases", {"gpus": 1}, token=tokens[rep["id"]])[0] == 200
        asking = kernel.record["replicas"][0]["node"]
        status, body = cluster.scheduler_call("POST", f"/api/v1/kernels/{kernel.kernel_id}/migrate",
                                              {"node": asking}, token=cluster.scheduler.token)
        assert status == 202 and body["started"], body
        moved = next(r for r in kernel.record["replicas"] if r["id"] == body["replica"])

        def move_over():  # while it runs, the scheduler answers "moving"; then why it will not move now
            status, again = cluster.scheduler_call("POST", f"/api/v1/kernels/{kernel.kernel_id}/migrate",
                                                   {"node": asking}, token=cluster.scheduler.token)
            return status == 409 and "moved less than" in again["error"]
        wait_for(move_over, 30, "the scheduler to finish with the move")

        assert [r["id"] for r in kernel.refresh()["replicas"]] == [r["id"] for r in kernel.record["replicas"]]
        assert cluster.agent(spare).unit_pids() == []  # no replica was started there
        assert "gpuhub_scheduler_migrations_total 0.0" in scheduler_metrics(cluster)
        # The fence is lifted: the replica that was to move takes its GPU again once it gave it back.
        agent, token = cluster.agent(moved["node"]), tokens[moved["id"]]
        lease = agent.call("GET", "/api/v1/node")[1]["leases"][0]["lease_id"]
        assert agent.call("DELETE", f"/api/v1/leases/{lease}", token=token)[1]["released"] is True
        assert agent.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[0] == 200
        ok(kernel, "x = 'still a whole group'")
