"""The agent's hold on lingering cell processes (gpuhub/agent/lingering.py): which pids it accepts,
and that a lease being ended counts as alive until its process has exited."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from gpuhub.agent.lingering import LingeringProcesses, LingerRefused, is_cell_process

ME = os.getpid()
UID = os.getuid()


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_only_a_live_child_of_the_replica_running_as_the_units_user_is_a_cell_process(child):
    assert is_cell_process(child.pid, ME, UID)
    assert not is_cell_process(child.pid, os.getppid(), UID)  # not the replica's child
    assert not is_cell_process(child.pid, ME, UID + 1)  # another user's
    assert not is_cell_process(ME, ME, UID)
    spawn = ("import subprocess as s; print(s.Popen(['sleep', '60'], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)")
    grandchild = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True)
    orphan = int(grandchild.stdout)  # re-parented to init (or a subreaper): not the replica's
    try:
        assert not is_cell_process(orphan, ME, UID)
    finally:
        os.kill(orphan, 9)
    child.kill()
    child.wait()  # reaped: gone
    assert not is_cell_process(child.pid, ME, UID)


def test_a_zombie_is_refused():
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    try:
        with pytest.raises(LingerRefused, match="not a running cell process"):
            LingeringProcesses().adopt("l1", proc.pid, ME, UID)
    finally:
        proc.wait()


@pytest.mark.parametrize("pid", [0, 1, -5, 2**70])
def test_odd_pids_are_refused_not_raised(pid):
    with pytest.raises(LingerRefused):
        LingeringProcesses().adopt("l1", pid, ME, UID)


def test_a_lease_being_ended_counts_as_alive_until_its_process_has_exited(child):
    held = LingeringProcesses()
    held.adopt("l1", child.pid, ME, UID)
    assert held.alive("l1") and not held.ending("l1")

    async def end_twice():
        first = held.end("l1")  # SIGKILL now
        assert held.ending("l1") and held.alive("l1")  # its exit is not seen yet: still alive
        with pytest.raises(LingerRefused, match="being taken back"):
            held.adopt("l1", child.pid, ME, UID)
        second = held.end("l1")
        assert second is first
        return await asyncio.wait_for(first, 10)

    assert asyncio.run(end_twice()) is True
    assert child.wait(timeout=10) == -9
    assert not held.ending("l1") and not held.alive("l1")
