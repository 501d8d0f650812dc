"""The two files by which an agent and a CPU kernel's replica agree that a replica about to move runs
no cell (gpuhub/platform/move_fence.py)."""

from __future__ import annotations

import os
import threading

import pytest

from gpuhub.platform import move_fence
from gpuhub.platform.move_fence import CellMark, executing, fence_text, fenced

pytestmark = pytest.mark.unit


def fence(unit_dir, hold_s: float = 60.0) -> None:
    (unit_dir / move_fence.FENCE_FILE).write_text(fence_text(hold_s))


def test_the_mark_says_when_a_cell_may_run_and_when_it_ended(tmp_path):
    mark = CellMark(tmp_path)
    assert not executing(tmp_path)
    assert mark.begin() and executing(tmp_path)
    mark.end()
    assert not executing(tmp_path)
    mark.end()  # twice is harmless (an election's loser and a finished cell both end it)
    assert not executing(tmp_path)


def test_a_fenced_replica_takes_its_mark_back_and_yields(tmp_path):
    mark = CellMark(tmp_path)
    fence(tmp_path)
    assert not mark.begin() and not executing(tmp_path)
    assert mark.begin(heed_fence=False) and executing(tmp_path)  # alone in its group: it runs the cell
    mark.end()
    (tmp_path / move_fence.FENCE_FILE).unlink()  # lifted
    assert mark.begin()


def test_a_lapsed_fence_holds_nothing_and_a_garbled_one_holds(tmp_path):
    fence(tmp_path, hold_s=-1.0)
    assert not fenced(tmp_path)
    (tmp_path / move_fence.FENCE_FILE).write_text("not a time")
    assert fenced(tmp_path)


def test_the_agent_reads_neither_a_link_nor_a_fifo_the_user_planted(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("1")  # a file the user may not read, but which starts with "1"
    (tmp_path / move_fence.EXECUTING_FILE).symlink_to(secret)
    assert not executing(tmp_path)
    (tmp_path / move_fence.EXECUTING_FILE).unlink()
    os.mkfifo(tmp_path / move_fence.EXECUTING_FILE)  # opening it for reading would block a daemon
    assert not executing(tmp_path)
    os.mkfifo(tmp_path / move_fence.FENCE_FILE)
    assert not fenced(tmp_path)


def test_a_mark_refuses_to_write_through_a_link(tmp_path):
    (tmp_path / move_fence.EXECUTING_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        CellMark(tmp_path)
    assert not (tmp_path / "elsewhere").exists()


def test_racing_a_fence_never_both_moves_and_runs_a_cell(tmp_path):
    """Each side writes its file before it reads the other's: whatever the interleaving, either the
    agent sees the cell (the move waits) or the replica sees the fence (another replica runs it)."""
    mark = CellMark(tmp_path)
    start = threading.Barrier(2)

    def agent(seen):
        start.wait()
        seen["agent saw a cell"] = move_fence.fence(tmp_path, 60.0, write_text)

    def replica(seen):
        start.wait()
        seen["replica ran it"] = mark.begin()

    for _ in range(500):
        seen = {}
        threads = [threading.Thread(target=agent, args=(seen,)), threading.Thread(target=replica, args=(seen,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen["agent saw a cell"] or not seen["replica ran it"], seen
        mark.end()
        (tmp_path / move_fence.FENCE_FILE).unlink()


def write_text(path, text: str) -> None:
    path.write_text(text)


def test_the_agent_reads_the_mark_only_after_its_fence_is_written(tmp_path):
    """The order that makes the race above safe, checked without a race: a mark the replica made
    while the agent wrote its fence (so before the replica could read that fence) is seen."""
    mark = CellMark(tmp_path)

    def write_while_the_replica_marks(path, text):
        mark.begin(heed_fence=False)
        path.write_text(text)

    assert move_fence.fence(tmp_path, 60.0, write_while_the_replica_marks)
    assert move_fence.fenced(tmp_path)
    mark.end()
    assert not move_fence.fence(tmp_path, 60.0, write_text)
