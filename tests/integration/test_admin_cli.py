"""``gpuhub nodes|kernels|leases|version`` as an admin runs them on the hub host: against a real
scheduler and agents (the development harness), as tables and as JSON, and with the errors an admin
meets (the scheduler down, a wrong token, a token file that is not there)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

import gpuhub
from gpuhub.dev.cluster import DevCluster, DevKernel
from tests.helpers import wait_for
from tests.integration.test_replicated import take_the_gpu


def gpuhub_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuhub.admin.cli", *argv], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = DevCluster(tmp_path_factory.mktemp("admin"), nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


def config_of(cluster: DevCluster) -> str:
    return str(cluster.scheduler.config)


def test_nodes_kernels_leases_and_versions(cluster):
    kernel = DevKernel(cluster, gpus=1)
    try:
        node = kernel.record["replicas"][0]["node"]
        take_the_gpu(next(a for a in cluster.agents if a.name == node), "adminhog")
        config = config_of(cluster)

        def seen_busy() -> bool:  # the scheduler knows the hog's lease from the node's next heartbeat
            _, body = cluster.scheduler_call("GET", "/api/v1/nodes", token=cluster.scheduler.token)
            return any(n["node"] == node and n["committed"] == 1 for n in body["nodes"])
        wait_for(seen_busy, 30, f"the scheduler to see {node}'s GPU busy")

        nodes = gpuhub_cli("nodes", "--config", config)
        assert nodes.returncode == 0, nodes.stderr
        lines = nodes.stdout.splitlines()
        assert lines[0].split() == ["NODE", "STATE", "BUSY/GPUS", "PENDING", "REPLICAS", "RATIO", "UNITS", "BACKEND",
                                    "VERSION", "SEEN"]
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert sorted(rows) == ["gpu1", "gpu2", "gpu3"]
        assert all(r[1] == "active" and r[8] == gpuhub.__version__ for r in rows.values())
        # one 1-GPU kernel of three replicas on each single-GPU server: a third of a GPU each
        assert all(r[4] == "1" and r[5] == "0.33" for r in rows.values()), rows
        assert rows[node][2] == "1/1", rows  # the hog's lease
        listed = gpuhub_cli("node", "list", "--config", config)
        assert listed.returncode == 0 and listed.stdout.splitlines()[0] == lines[0], listed.stderr

        kernels = json.loads(gpuhub_cli("kernels", "--config", config, "--json").stdout)["kernels"]
        mine = next(k for k in kernels if k["kernel_id"] == kernel.kernel_id)
        assert len(mine["replicas"]) == 3 and "key" not in mine  # the kernel's key never shows
        table = gpuhub_cli("kernels", "--config", config).stdout
        assert kernel.kernel_id in table and table.splitlines()[0].split() == ["KERNEL", "USER", "GPUS", "REPLICAS",
                                                                                 "AGE"]
        assert gpuhub_cli("kernels", "--config", config, "--user", "nobody-here").stdout.split() == [
            "KERNEL", "USER", "GPUS", "REPLICAS", "AGE"]

        def the_hog_leases():  # the agents report leases with their heartbeats
            out = gpuhub_cli("leases", "--config", config, "--json")
            return [x for x in json.loads(out.stdout)["leases"] if x["holder"] == "gpuhub-kernel-adminhog-r0"]
        held = wait_for(the_hog_leases, 30, "the hog's lease in gpuhub leases")
        assert held[0]["node"] == node and len(held[0]["gpus"]) == 1
        [row] = [line.split() for line in gpuhub_cli("leases", "--config", config).stdout.splitlines()
                 if "gpuhub-kernel-adminhog-r0" in line]
        assert row[-1] == "cell"  # a cell runs under it (a lingering one says "lingering <age>")

        versions = json.loads(gpuhub_cli("version", "--config", config, "--json").stdout)
        assert versions["cli"] == versions["scheduler"] == gpuhub.__version__
        assert versions["nodes"] == {n: gpuhub.__version__ for n in ("gpu1", "gpu2", "gpu3")}
    finally:
        kernel.close()


def _config_with(cluster: DevCluster, tmp_path: Path, **changes) -> str:
    settings = tomllib.loads(Path(config_of(cluster)).read_text())
    settings.update(changes)
    path = tmp_path / "scheduler.toml"
    path.write_text(tomli_w.dumps(settings))
    return str(path)


def test_a_wrong_token_is_named_with_its_file(cluster, tmp_path):
    wrong = tmp_path / "scheduler.token"
    wrong.write_text("not-the-scheduler-token-at-all")
    wrong.chmod(0o600)
    out = gpuhub_cli("nodes", "--config", _config_with(cluster, tmp_path, token_file=str(wrong)))
    assert out.returncode == 1 and not out.stdout
    assert f"refused the token in {wrong}" in out.stderr and "401" in out.stderr, out.stderr
    assert "not-the-scheduler-token" not in out.stderr  # a secret never reaches the terminal or a log


def test_a_scheduler_that_does_not_answer_says_so(cluster, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        out = gpuhub_cli("kernels", "--config", _config_with(cluster, tmp_path, port=s.getsockname()[1]))
    assert out.returncode == 1
    assert "cannot reach the scheduler" in out.stderr and "systemctl status gpuhub-scheduler" in out.stderr, out.stderr


def test_a_missing_token_file_is_a_setup_error(cluster, tmp_path):
    out = gpuhub_cli("leases", "--config", _config_with(cluster, tmp_path, token_file=str(tmp_path / "nope")))
    assert out.returncode == 2 and "does not exist" in out.stderr, out.stderr


def test_a_drained_server_hands_its_replicas_over_and_takes_no_new_kernel(tmp_path):
    """``gpuhub node drain --wait`` before maintenance: the kernel's replica there (the one that ran
    the last cell) moves to the spare server and catches up; the kernel keeps its variables and runs
    on; a new kernel avoids the drained server; ``undrain`` puts it back."""
    from tests.integration.test_replicated import (
        ReplicatedKernel,
        assert_equal_namespaces,
        eventually,
        executor_node,
        ok,
        one_gpu_kernel_on_four_nodes,
    )

    with one_gpu_kernel_on_four_nodes(tmp_path, node_timeout_s=3) as (cluster, kernel):
        config = config_of(cluster)
        ok(kernel, "x = 1")
        victim = executor_node(kernel)
        others = {a.name for a in cluster.agents} - {victim}
        out = gpuhub_cli("node", "drain", victim, "--wait", "--timeout", "120", "--config", config)
        assert out.returncode == 0, out.stderr
        assert f"{victim}: drained; no kernel replica runs there" in out.stdout
        record = kernel.refresh()
        assert {r["node"] for r in record["replicas"]} == others
        rids = tuple(r["id"] for r in record["replicas"])
        eventually(lambda: assert_equal_namespaces(kernel, ["x"], rids), 60, "the moved replica holding x")
        ok(kernel, "x += 1")
        assert assert_equal_namespaces(kernel, ["x"], rids)["x"].endswith("2")
        units = cluster.agent(victim).call("GET", "/api/v1/units")[1]["units"]
        assert not [u for u in units if u["kind"] == "kernel"], units
        listing = {n["node"]: n for n in json.loads(gpuhub_cli("nodes", "--json", "--config", config).stdout)["nodes"]}
        assert listing[victim]["drained"] and listing[victim]["kernel_replicas"] == 0
        assert listing[victim]["state"] == "drained"
        assert f"{victim}" in (line := next(x for x in gpuhub_cli("nodes", "--config", config).stdout.splitlines()
                                            if x.startswith(victim))) and "drained" in line, line
        second = ReplicatedKernel(cluster, gpus=1)  # three servers are left for its three replicas
        try:
            assert {r["node"] for r in second.record["replicas"]} == others
        finally:
            second.close()

        out = gpuhub_cli("node", "undrain", victim, "--config", config)
        assert out.returncode == 0 and f"{victim}: back in service" in out.stdout, out.stderr
        listing = {n["node"]: n for n in json.loads(gpuhub_cli("nodes", "--json", "--config", config).stdout)["nodes"]}
        assert not listing[victim]["drained"]
        out = gpuhub_cli("node", "drain", "--config", config)
        assert out.returncode == 2 and "drain needs the server's name" in out.stderr, out.stderr
        out = gpuhub_cli("node", "drain", "no-such-server", "--config", config)
        assert out.returncode == 1 and "no server named 'no-such-server'" in out.stderr, out.stderr
