"""A GPU cell's grant ends only after its process has exited, off the reply's path."""

from __future__ import annotations

import os
import time

from gpuhub.kernel.lease_client import Lease
from gpuhub.kernel.reaper import CellReaper


def lingering_child(seconds: float) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(seconds)
        os._exit(0)
    return pid


def test_release_waits_for_the_exit_but_the_caller_does_not():
    events = []
    reaper = CellReaper(lambda grant: events.append((grant, time.monotonic())))
    pid = lingering_child(0.5)
    started = time.monotonic()
    reaper.end_later("cell-1", pid, "grant-1")
    assert time.monotonic() - started < 0.25  # handed over, not waited for
    assert not reaper.wait(0.1) and events == []  # the process still runs: the grant is held
    assert reaper.wait(5)
    [(grant, released)] = events
    assert grant == "grant-1" and released - started >= 0.45
    try:
        os.waitpid(pid, os.WNOHANG)
        raise AssertionError("the cell's process was not reaped")
    except ChildProcessError:
        pass


def test_a_failing_release_does_not_stop_the_next_cells():
    calls = []

    def release(grant):
        calls.append(grant.lease_id)
        if grant.lease_id == "bad":
            raise RuntimeError("agent gone")

    reaper = CellReaper(release)
    reaper.end_later("cell-1", None, Lease("bad", "n", []))
    reaper.end_later("cell-2", lingering_child(0.1), Lease("good", "n", []))  # after cell-1's end
    assert reaper.wait(5)
    assert calls == ["bad", "good"]
