"""A drain or a migration moves a CPU kernel's replica only between its cells.

A CPU cell holds no GPU lease, so the agent's fence learns of it from the replica's mark
(gpuhub/platform/move_fence.py). Real scheduler, agents and replica processes (the development
harness), a real Jupyter client."""

from __future__ import annotations

import pytest

from gpuhub.kernel.wait_notice import notice_text
from tests.helpers import wait_for
from tests.integration.test_admin_cli import gpuhub_cli
from tests.integration.test_gpu_cells import wait_for_output
from tests.integration.test_replicated import (
    assert_equal_namespaces,
    eventually,
    executor_node,
    ok,
    one_gpu_kernel_on_four_nodes,
)


@pytest.fixture
def cpu_kernel_on_four_nodes(tmp_path):
    with one_gpu_kernel_on_four_nodes(tmp_path, gpus=0, node_timeout_s=3) as (cluster, kernel):
        yield cluster, kernel


def unit_on(kernel, node: str) -> str:
    return next(r["unit"] for r in kernel.refresh()["replicas"] if r["node"] == node)


def test_a_fenced_replica_leaves_the_next_cpu_cell_to_another(cpu_kernel_on_four_nodes):
    cluster, kernel = cpu_kernel_on_four_nodes
    ok(kernel, "x = 1")
    holder = executor_node(kernel)  # it holds the executor lease: it would run the next cell too
    agent, unit = cluster.agent(holder), unit_on(kernel, holder)
    status, answer = agent.call("POST", f"/api/v1/units/{unit}/fence")  # as the scheduler does before a move
    assert status == 200 and answer["executing"] is False and answer["leases"] == [], answer
    out = ok(kernel, "x += 1\nimport os; print(os.environ['GPUHUB_NODE'])")
    assert out["stdout"].strip() != holder  # another replica ran it, under an election
    status, answer = agent.call("POST", f"/api/v1/units/{unit}/fence")
    assert answer["executing"] is False, answer  # the fenced replica never marked itself running
    assert agent.call("DELETE", f"/api/v1/units/{unit}/fence")[0] == 200
    assert ok(kernel, "print(x)")["stdout"] == "2\n"


def test_a_drain_waits_for_the_running_cpu_cell_then_moves_its_replica(cpu_kernel_on_four_nodes, tmp_path):
    cluster, kernel = cpu_kernel_on_four_nodes
    ok(kernel, "x = 1")
    victim = executor_node(kernel)
    gate = tmp_path / "go"
    msg_id = kernel.kc.execute(
        "import pathlib, time\nprint('started', flush=True)\n"
        f"while not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.02)\nx += 1\nprint('done', x)")
    wait_for_output(kernel.kc, msg_id, "started", timeout=60)
    status, _ = cluster.scheduler_call("PUT", f"/api/v1/nodes/{victim}/drain", {"drained": True},
                                       token=cluster.scheduler.token)
    assert status == 200
    scheduler_log = cluster.scheduler.dir / "scheduler.log"
    wait_for(lambda: "runs a CPU cell: it moves once the cell has ended" in scheduler_log.read_text(errors="replace"),
             60, "the scheduler to find the drained server's replica running the cell")
    assert victim in {r["node"] for r in kernel.refresh()["replicas"]}  # not moved under the cell
    # `gpuhub node drain --wait` says what it waits for, and gives up at its timeout
    out = gpuhub_cli("node", "drain", victim, "--wait", "--timeout", "1", "--config", str(cluster.scheduler.config))
    assert out.returncode == 1, out
    user = kernel.refresh()["user"]
    assert f"waiting for kernel {kernel.kernel_id} of {user}: its replica here runs a CPU cell" in out.stderr, out
    assert f"{victim} still runs 1 kernel replica(s) after 1 s" in out.stderr, out
    gate.touch()
    reply = kernel.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok", reply["content"]
    wait_for(lambda: victim not in {r["node"] for r in kernel.refresh()["replicas"]}, 60,
             f"the replica on {victim} to move once the cell ended")
    rids = tuple(r["id"] for r in kernel.refresh()["replicas"])
    eventually(lambda: assert_equal_namespaces(kernel, ["x"], rids)["x"] == "2", 60, "x == 2 on the three replicas")
    assert ok(kernel, "x += 1\nprint(x)")["stdout"] == "3\n"


def test_a_cpu_cell_whose_every_replica_is_fenced_waits_says_why_and_runs_once_unfenced(cpu_kernel_on_four_nodes):
    cluster, kernel = cpu_kernel_on_four_nodes
    ok(kernel, "x = 1\nruns = 0")
    fenced = [(cluster.agent(r["node"]), r["unit"]) for r in kernel.refresh()["replicas"]]
    for agent, unit in fenced:  # as three moves at once would (say, a drain of three servers)
        status, answer = agent.call("POST", f"/api/v1/units/{unit}/fence")
        assert status == 200 and answer["executing"] is False, answer
    msg_id = kernel.kc.execute("runs += 1\nx += 1\nprint('ran', x, runs)")
    notices, stdout = [], ""
    while not any("being moved" in n for n in notices):
        msg = kernel.kc.get_iopub_msg(timeout=60)  # queue.Empty: no status line within a minute
        if msg["parent_header"].get("msg_id") == msg_id:
            assert msg["msg_type"] != "stream", msg  # the cell must not run under the fences
            if (text := notice_text(msg["msg_type"], msg["content"])) is not None:
                notices.append(text)
    assert notices[0].startswith("[gpuhub] waiting: this kernel's replicas are being moved to other servers"), notices
    for agent, unit in fenced:
        assert agent.call("DELETE", f"/api/v1/units/{unit}/fence")[0] == 200
    reply = kernel.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok", reply["content"]
    while True:  # the rest of the cell's output, up to its idle
        msg = kernel.kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        if (text := notice_text(msg["msg_type"], msg["content"])) is not None:
            notices.append(text)
        elif msg["msg_type"] == "stream":
            stdout += msg["content"]["text"]
    assert stdout == "ran 2 1\n"  # once
    assert "waited" in notices[-1] and "replicas were being moved" in notices[-1] and "GPU" not in notices[-1], notices
    assert ok(kernel, "print(x, runs)")["stdout"] == "2 1\n"
