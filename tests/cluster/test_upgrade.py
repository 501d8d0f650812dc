"""An upgrade of a live cluster, the way an admin runs it: the next commit of gpuhub, `ansible-playbook
site.yml`, with a user's kernel running; then the rollback, the earlier commit's site.yml again.

Runs last among the cluster tests (it restarts every daemon); it leaves the cluster on the release it
found, so a second run of the suite on the same cluster starts where the first did.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.cluster.conftest import ROOT, ansible_playbook
from tests.cluster.test_e2e import HubUser, replica_units, unit_props

pytestmark = pytest.mark.cluster

def gpuhub_hosts(cluster) -> list[str]:
    return sorted({h for g in ("hub", "notebook_hosts", "gpu_nodes") for h in cluster.groups[g]})


def current_releases(cluster) -> dict[str, str]:
    """Which release /opt/gpuhub/venv names on each host."""
    return {h: Path(cluster.exec(h, "readlink", "/opt/gpuhub/venv").strip()).name for h in gpuhub_hosts(cluster)}


def next_commit(tmp_path: Path) -> tuple[Path, str]:
    """A copy of this checkout with one change to gpuhub's code, as the next commit would bring; it
    shares the controller's wheel cache (the pins did not change)."""
    tree = tmp_path / "next"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, dst = ROOT / rel, tree / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet in the index
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    (tree / ".cache").mkdir()
    (tree / ".cache" / "wheelhouse").symlink_to(ROOT / ".cache" / "wheelhouse")
    probe = uuid.uuid4().hex
    with (tree / "gpuhub" / "__init__.py").open("a") as f:
        f.write(f'\nUPGRADE_PROBE = "{probe}"  # written by tests/cluster/test_upgrade.py\n')
    return tree, probe


def test_an_upgrade_keeps_a_running_kernel_and_a_rollback_is_a_switch(cluster, tmp_path):
    hub = cluster.groups["hub"][0]
    cli = "/opt/gpuhub/venv/bin/gpuhub"
    before = current_releases(cluster)
    (old,) = set(before.values())
    deps_key = old.split("-")[0]
    deps_marker = f"/opt/gpuhub/wheelhouse/deps-{deps_key}/.complete"
    deps_stamps = {h: cluster.exec(h, "stat", "-c", "%Y", deps_marker) for h in before}

    alice = HubUser(cluster, "alice")
    alice.login()
    alice.start_server("gpu1")
    kid = alice.start_kernel("gpuhub-gpu1")
    channel = alice.kernel(kid)
    try:
        channel.run("x = 41")
        units = replica_units(cluster, kid)
        assert len(units) == 3, units
        pids = {n: unit_props(cluster, n, u["name"], "MainPID")["MainPID"] for n, u in units.items()}

        # --- the upgrade ---------------------------------------------------------------------------
        # The websocket is closed meanwhile: this client answers the server's pings only while it
        # reads, and JupyterLab, which answers them, reconnects after a hub restart anyway.
        channel.close()
        tree, probe = next_commit(tmp_path)
        # Two GPU servers at a time: batches, as the default quarter of a site's servers would go.
        out = ansible_playbook(cluster, "site.yml", "-e", "gpuhub_gpu_nodes_serial=2", tree=tree)
        channel = alice.kernel(kid)
        after = current_releases(cluster)
        (new,) = set(after.values())
        assert new != old and new.startswith(deps_key + "-"), (old, new)
        # Same pins: the dependency wheels were not copied again, only the gpuhub wheel.
        assert {h: cluster.exec(h, "stat", "-c", "%Y", deps_marker) for h in after} == deps_stamps
        assert "Copy and unpack the dependency wheels" not in out
        # The GPU servers went in batches of two, each waiting for its agents.
        batches = -(-len(cluster.groups["gpu_nodes"]) // 2)
        assert batches > 1 and out.count("PLAY [GPU nodes]") == batches, out.count("PLAY [GPU nodes]")
        versions = json.loads(cluster.exec(hub, cli, "version", "--json"))["releases"]
        assert versions["cli"] == versions["scheduler"] == new
        assert set(versions["nodes"].values()) == {new}, versions

        # The kernel lived through it: the same processes, still on the old release, and its next cell
        # sees what the earlier one left.
        for node, unit in units.items():
            assert unit_props(cluster, node, unit["name"], "MainPID")["MainPID"] == pids[node]
            cmdline = cluster.exec(node, "cat", f"/proc/{pids[node]}/cmdline").replace("\0", " ")
            assert f"/opt/gpuhub/venvs/{old}/bin/python" in cmdline, cmdline
        assert channel.run("print(x + 1)")["stdout"].strip() == "42"
        # A kernel started now runs the new code.
        kid2 = alice.start_kernel("gpuhub-gpu1")
        second = alice.kernel(kid2)
        try:
            assert second.run("import gpuhub; print(gpuhub.UPGRADE_PROBE)")["stdout"].strip() == probe
        finally:
            second.close()
            alice.api("DELETE", f"/user/alice/api/kernels/{kid2}")
        # The old release stays while the kernel runs from it (and as the one to roll back to).
        gpu = next(iter(units))
        listing = {r["name"]: r for r in json.loads(cluster.exec(gpu, cli, "releases", "--json"))["releases"]}
        assert listing[new]["current"] and not listing[old]["current"] and listing[old]["pids"], listing

        # --- the rollback: the earlier commit's site.yml switches back, builds nothing -------------
        channel.close()
        out = ansible_playbook(cluster, "site.yml")
        channel = alice.kernel(kid)
        assert current_releases(cluster) == before
        assert "Create the release's venv" not in out and "Copy the gpuhub wheel" not in out
        assert channel.run("print(x + 2)")["stdout"].strip() == "43"
    finally:
        channel.close()
        alice.api("DELETE", f"/user/alice/api/kernels/{kid}")
        alice.stop_server()
