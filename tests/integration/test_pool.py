"""The elastic pool end to end on the development cluster (scheduler, agents with fake GPUs, replica
processes, the router, a real Jupyter client): an idle server is lent through the release hook, and
acquired back through the other hook when a cell needs it; the cell runs there once, with its state."""

from __future__ import annotations

import sys

from tests.helpers import wait_for
from tests.integration.test_migration import run_collecting, scheduler_metrics
from tests.integration.test_replicated import ok, one_gpu_kernel_on_four_nodes, take_the_gpu

HOOK = """\
import sys
action, log, node = sys.argv[1:4]
with open(log, "a") as fh:
    fh.write(f"{action} {node}\\n")
"""


def node_states(cluster) -> dict[str, str]:
    _, body = cluster.scheduler_call("GET", "/api/v1/nodes", token=cluster.scheduler.token)
    return {n["node"]: n["state"] for n in body["nodes"]}


def test_an_idle_server_is_lent_and_acquired_back_when_a_cell_needs_it(tmp_path):
    script, log = tmp_path / "hook.py", tmp_path / "hooks.log"
    script.write_text(HOOK)
    log.touch()
    settings = {"pool_enabled": True, "pool_release_command": f"{sys.executable} {script} release {log}",
                "pool_acquire_command": f"{sys.executable} {script} acquire {log}", "pool_min_active": 3,
                "pool_spare_servers": 1, "pool_release_after_s": 0.0, "pool_interval_s": 0.5}
    with one_gpu_kernel_on_four_nodes(tmp_path, scheduler_settings=settings) as (cluster, kernel):
        ok(kernel, "x = 41\nbig = list(range(100_000))")
        # Four idle single-GPU servers and a minimum of three: one is lent (the kernel's replicas
        # move off it first if it held one).
        lent = wait_for(lambda: [line.split()[1] for line in log.read_text().splitlines()], 60,
                        "the release hook to run")[0]
        # the hook logs before it returns; the scheduler marks the server lent once it has
        wait_for(lambda: node_states(cluster)[lent] == "lent", 60, f"{lent} counted lent")
        placed = {r["node"] for r in kernel.refresh()["replicas"]}
        assert lent not in placed and len(placed) == 3

        for node in sorted(placed):  # other users' cells hold every GPU the kernel's servers have
            take_the_gpu(cluster.agent(node), f"hog{node[-1]}")
        reply, streams = run_collecting(kernel, "x += 1\nimport os\nprint(os.environ['GPUHUB_NODE'], x, sum(big))",
                                        timeout=120)

        assert reply["status"] == "ok", (reply, streams)
        assert streams["stdout"].split() == [lent, "42", str(sum(range(100_000)))], streams
        assert log.read_text().splitlines() == [f"release {lent}", f"acquire {lent}"]
        assert node_states(cluster)[lent] == "active"
        metrics = scheduler_metrics(cluster)
        assert 'gpuhub_pool_actions_total{action="released"} 1.0' in metrics, metrics
        assert 'gpuhub_pool_actions_total{action="acquired"} 1.0' in metrics, metrics
        assert 'gpuhub_pool_hook_failures_total{hook="acquire"} 0.0' in metrics, metrics
