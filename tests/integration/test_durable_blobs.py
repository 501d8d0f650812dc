"""Large values outlive their replicas' processes (gpuhub/replication/blobdisk.py). Large values
(an image's stream over 16 KiB, buffers of 1 MiB or more) travel beside the Raft log; when they
lived only in the replicas' memory, a kernel whose three replica processes restarted at once (each
killed for memory, say, and started again by systemd's Restart=) came back with a journal naming
values no one held."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
from pathlib import Path

import pytest

from gpuhub.replication.blobdisk import DIGEST_HEX, VERSION_FILE, keep_free
from tests.helpers import wait_for
from tests.integration.test_replicated import (
    _restartable,
    assert_equal_namespaces,
    cpu_kernel,  # noqa: F401 - fixture
    dev_cluster,  # noqa: F401 - fixture
    eventually,
    ok,
    serving_replicas,
)


def journal_dir(kernel, rid: int):
    replica = kernel.replica(rid)
    return kernel.cluster.agent(replica["node"]).dir / "state" / "journals" / replica["unit"]


def blob_files(kernel, rid: int) -> set[str]:
    """The large values replica ``rid`` keeps on disk, by digest."""
    try:
        return {name for name in os.listdir(journal_dir(kernel, rid) / "blobs") if DIGEST_HEX.fullmatch(name)}
    except FileNotFoundError:
        return set()


def files_as_they_are(kernel, rid: int) -> dict[str, tuple[int, int]]:
    """Replica ``rid``'s files of large values, each with its inode and time of writing: the same
    only if it was never removed and written again."""
    blobs = journal_dir(kernel, rid) / "blobs"
    files = {}
    for d in blob_files(kernel, rid):
        try:
            st = os.stat(blobs / d)
        except FileNotFoundError:  # removed since it was listed
            continue
        files[d] = (st.st_ino, st.st_mtime_ns)
    return files


def recorded_version(kernel, rid: int) -> str | None:
    try:
        return (journal_dir(kernel, rid) / "blobs" / VERSION_FILE).read_text()
    except FileNotFoundError:
        return None


def dead(pid: int) -> bool:
    """Gone, or a zombie: it writes nothing more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def saved_commit_index(kernel, rid: int) -> int:
    """The commit index replica ``rid``'s Raft journal has on disk (pysyncobj saves it once a second;
    until it first does, a journal starts from 1)."""
    try:
        meta = pickle.loads((journal_dir(kernel, rid) / "raft.journal.meta").read_bytes())
    except FileNotFoundError:
        return 1
    return meta.get("raftCommitIndex", 1)  # (the term and vote are saved at once, the index later)


def set_saved_commit_index(kernel, rid: int, index: int) -> None:
    """What a kill within a second of a commit leaves: the journal holds the entries, but the
    commit index saved beside them is the one before (the term and vote are saved at once)."""
    path = journal_dir(kernel, rid) / "raft.journal.meta"
    meta = pickle.loads(path.read_bytes())
    meta["raftCommitIndex"] = index
    path.write_bytes(pickle.dumps(meta))


def require_room_for_blobs(directory, nbytes: int) -> None:
    """Fail at once, saying why, when the disk under ``directory`` is too full for a replica to keep
    ``nbytes`` of values (the rule in gpuhub/replication/blobdisk.py): CI shares its machine's disk,
    and a full one otherwise showed only as a 60 s wait for files that were never to be written."""
    st = os.statvfs(directory)
    free, needed = st.f_bavail * st.f_frsize, keep_free(st.f_blocks * st.f_frsize) + 3 * nbytes
    if free < needed:
        pytest.fail(f"{directory} has {free / 2**30:.1f} GiB free; this test needs {needed / 2**30:.1f} GiB "
                    f"(replicas keep large values on disk only while that much stays free): free some disk")


@pytest.mark.parametrize("killed", ["later", "within-a-second-of-the-commit"])
def test_a_kernel_whose_replicas_all_restart_at_once_keeps_its_large_values(cpu_kernel, killed):  # noqa: F811
    kernel = cpu_kernel
    require_room_for_blobs(kernel.cluster.tmp, 2_000_000 * 8)
    rids = [r["id"] for r in kernel.record["replicas"]]
    before = {rid: saved_commit_index(kernel, rid) for rid in rids}
    ok(kernel, "import numpy as np\nbig = np.arange(2_000_000) * 3\nsmall = list(range(10))\nx = 1")
    # After the cell, each replica writes the image's large values to disk (not on the cell's path).
    wait_for(lambda: all(blob_files(kernel, rid) and recorded_version(kernel, rid) == "1" for rid in rids)
             and len({frozenset(blob_files(kernel, rid)) for rid in rids}) == 1, 60,
             "every replica's large values on disk")
    kept = {rid: files_as_they_are(kernel, rid) for rid in rids}

    # Each replica's process is killed and started again at once, as systemd's Restart= does (same
    # command, ports and journal; its pid file tells the agent): none has the values in memory.
    procs = []
    try:
        for rid in rids:
            pid = kernel.pid(rid)
            cmd, env, cwd = _restartable(pid)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda pid=pid: dead(pid), 30, f"replica {rid}'s process to end")  # (it could still save its meta)
            if killed != "later":  # each comes back at first with the state before the cell
                set_saved_commit_index(kernel, rid, before[rid])
            replica = kernel.replica(rid)
            with open(kernel.cluster.tmp / f"restarted-r{rid}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True, stdout=log,
                                              stderr=subprocess.STDOUT))
            unit_dir = kernel.cluster.agent(replica["node"]).dir / "run" / "units" / replica["unit"]
            (unit_dir / "pid").write_text(str(procs[-1].pid))

        wait_for(lambda: sorted(serving_replicas(kernel)) == sorted(rids), 180, "the router to count them live again")
        # The cell waits until its replica has caught up: the journal, then the large values.
        out = ok(kernel, "print(int(big.sum()), x, small[-1])", timeout=120)
        assert out["stdout"].split() == [str(3 * sum(range(2_000_000))), "1", "9"], out
        # A replica that was still catching up when the cell ran loads the image after it.
        view = eventually(lambda: assert_equal_namespaces(kernel, ["x", "big", "small"], tuple(rids)), 60,
                          "every replica's namespace to hold the values again")
        assert " ".join(view["big"].split()).startswith("[ 0 3 6"), view
        # No replica took the image it came back with for a reason to remove the newer one's files.
        assert {rid: files_as_they_are(kernel, rid) for rid in rids} == kept
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
