"""The executor lease and a cell handed late (GpuhubKernel._run_under_lease). The router hands a
running cell to a replica that joined the group, or whose connection broke as the cell was sent,
after the others were told who got it. If that replica holds the lease, the others may already be
electing another one (they were told the holder would not get the cell): running it under the lease
too ran the cell twice (its output came twice in tests/integration/test_durable_blobs.py, once in a
few runs). A late holder goes through the election instead, which picks it when it can run the cell."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gpuhub.kernel.kernel import GpuhubKernel
from gpuhub.platform.move_fence import FENCE_FILE, CellMark, executing, fence_text


class Kernel(SimpleNamespace):
    """What _run_under_lease uses of a kernel, with the cell's run recorded instead of done."""

    _note = GpuhubKernel._note
    _run_under_lease = GpuhubKernel._run_under_lease
    _mark_cpu_cell = GpuhubKernel._mark_cpu_cell

    def __init__(self, note: dict, cell_mark=None) -> None:
        super().__init__(_notes={"cell": note}, gpus=0, reaper=SimpleNamespace(wait=lambda: None),
                         _try_grant=lambda: None, _resume_lingering=lambda: None, ran=[], cell_mark=cell_mark,
                         replica=SimpleNamespace(peers={0: None, 1: None, 2: None}))

    async def _execute_here(self, cell, attempt, grant, *args):
        self.ran.append(cell)
        return {"status": "ok"}


def under_lease(note: dict, cell_mark=None) -> tuple[object, list[str]]:
    kernel = Kernel(note, cell_mark)
    holder = SimpleNamespace(id=0, lease=lambda cell: (None, 0, False))  # it holds the lease, no election yet
    result = asyncio.run(kernel._run_under_lease(holder, "cell", "x = 1", False, True, {}, False, None, None))
    return result, kernel.ran


def test_the_holder_runs_a_cell_it_got_with_the_others_under_its_lease():
    assert under_lease({}) == ({"status": "ok"}, ["cell"])
    assert under_lease({"missed": True, "to": [0, 1, 2]}) == ({"status": "ok"}, ["cell"])


def test_a_holder_handed_the_cell_late_leaves_it_to_the_election():
    assert under_lease({"missed": True, "late": True, "to": [0, 1, 2]}) == (None, [])


def test_a_holder_fenced_for_a_move_leaves_its_cpu_cell_to_the_election(tmp_path):
    """Its agent is about to move it (a drain): another replica runs the cell (move_fence.py)."""
    mark = CellMark(tmp_path)
    assert under_lease({}, mark) == ({"status": "ok"}, ["cell"])
    (tmp_path / FENCE_FILE).write_text(fence_text(60.0))
    assert under_lease({}, mark) == (None, [])
    assert not executing(tmp_path)  # it took its mark back
