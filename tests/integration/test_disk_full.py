"""A replica whose disk fills up (gpuhub/replication/journal_space.py). pysyncobj maps its Raft
journal and grows the file without reserving blocks, so on a full disk the replica died of SIGBUS,
without a word, at every restart. Now it says why and stops for good, and the kernel goes on with
its other replicas. A small tmpfs stands for the full disk: mounting one needs root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gpuhub.dev.cluster import DevCluster
from gpuhub.platform.exit_status import DISK_FULL_EXIT
from tests.helpers import wait_for
from tests.integration.test_gpu_cells import run
from tests.integration.test_replicated import ReplicatedKernel, assert_equal_namespaces, ok


def mount_small_disk(path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root is needed): {done.stderr.strip()}")


@pytest.fixture
def small_disks():
    mounted = []

    def mount(path, size: str = "1m"):
        mount_small_disk(path, size)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


GROW_A_JOURNAL = textwrap.dedent("""
    import sys
    from gpuhub.replication import journal_space
    if sys.argv[2] == "guarded":
        journal_space.install()
    from pysyncobj.journal import FileJournal
    journal = FileJournal(sys.argv[1] + "/raft.journal")
    for i in range(1000):
        journal.add(bytes(60_000), i + 1, 1)
    print("the journal never filled the disk")
""")


def test_a_journal_on_a_full_disk_ends_its_process_with_a_clear_message_not_a_sigbus(tmp_path, small_disks):
    disk = small_disks(tmp_path / "disk")
    bare = subprocess.run([sys.executable, "-c", GROW_A_JOURNAL, str(disk), "bare"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert bare.returncode == -signal.SIGBUS, (bare.returncode, bare.stderr)  # pysyncobj alone

    for name in os.listdir(disk):
        os.unlink(disk / name)
    guarded = subprocess.run([sys.executable, "-c", GROW_A_JOURNAL, str(disk), "guarded"], capture_output=True,
                             text=True, timeout=60, check=False)
    assert guarded.returncode == DISK_FULL_EXIT, (guarded.returncode, guarded.stderr)
    assert f"the disk of {disk} is full" in guarded.stderr and "No space left on device" in guarded.stderr


def test_a_replica_whose_disk_fills_stops_for_good_and_the_kernel_goes_on(tmp_path, small_disks):
    """gpu2's journals live on a 1 MiB disk; cells whose namespaces are about 10 KB apiece (a
    6 KB value and the kernel's own state: small enough to travel in the log itself, which takes
    images up to 16 KiB) fill it. Its replica says why in its log and stays down; the
    other two run the next cells and hold the same namespace."""
    small_disks(tmp_path / "gpu2" / "state" / "journals")
    cluster = DevCluster(tmp_path, nodes=3, gpus_per_node=1).start()
    kernel = None
    try:
        kernel = ReplicatedKernel(cluster, gpus=0)
        full = next(r for r in kernel.record["replicas"] if r["node"] == "gpu2")
        agent = cluster.agent("gpu2")

        def unit():
            return agent.call("GET", f"/api/v1/units/{full['unit']}")[1]

        ok(kernel, "import os\nfilled = 0")
        for _ in range(400):  # about 100 cells fill 1 MiB
            reply, out = run(kernel.kc, "blob = os.urandom(6_000); filled += 1")
            # The replica on the full disk may be the one running this cell: then it is lost with it.
            assert reply["status"] == "ok" or out["errors"] in (["ExecutorLost"], ["ReplicasUnavailable"]), out
            if unit()["state"] != "active":
                break
        def stopped_with_error():
            view = unit()
            return view if view["state"] != "active" and view.get("error") else None

        stopped = wait_for(stopped_with_error, 30, "the stopped replica's error")
        assert stopped["state"] == "failed", stopped
        assert "gpuhub replica: the disk of" in stopped["error"] and "is full" in stopped["error"], stopped["error"]

        ok(kernel, "filled += 100")  # two replicas are a majority
        others = tuple(r["id"] for r in kernel.record["replicas"] if r["node"] != "gpu2")
        view = assert_equal_namespaces(kernel, ["filled"], others)
        assert int(view["filled"]) > 100, view
    finally:
        if kernel is not None:
            kernel.close()
        cluster.stop()
