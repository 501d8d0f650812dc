"""A GPU cell whose process cannot be forked (out of memory, a process limit) fails with a reply
that says so, and its grant goes back: it must not leave the kernel without a reply (the other
replicas would wait on an executor that never answers)."""

from __future__ import annotations

import errno
import types

from gpuhub.kernel import kernel as kernel_module
from gpuhub.kernel.kernel import GpuhubKernel
from gpuhub.kernel.lease_client import Lease


class Shell:
    execution_count = 4

    def __init__(self) -> None:
        self.shown: list[tuple] = []
        self.history: list[tuple] = []
        self.history_manager = types.SimpleNamespace(store_inputs=lambda n, code: self.history.append((n, code)))

    def _showtraceback(self, etype, evalue, stb) -> None:
        self.shown.append((etype.__name__, evalue))


class Reaper:
    def __init__(self) -> None:
        self.ended: list[tuple] = []

    def end_later(self, cell, pid, grant) -> None:
        self.ended.append((cell, pid, grant))


def test_a_cell_whose_process_cannot_be_forked_gets_an_error_reply_and_gives_its_gpus_back(monkeypatch):
    def no_fork(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(kernel_module.CellProcess, "fork", no_fork)
    shell, reaper, grant = Shell(), Reaper(), Lease("l1", "gpu1", ["GPU-0"])
    kernel = types.SimpleNamespace(
        replica=types.SimpleNamespace(store=types.SimpleNamespace(digests=lambda: [], alloc=bytearray), resident={},
                                      settings=types.SimpleNamespace(gpu_linger_s=30.0)),
        shell=shell, reaper=reaper, _phases={}, _parent_ident={"shell": [b"client"]}, _warm=None,
        _take_spare=lambda: None, get_parent=lambda channel: {"header": {"msg_id": "m1"}, "buffers": []},
        _remember_cell=lambda code, number: None)
    kernel._error_reply = types.MethodType(GpuhubKernel._error_reply, kernel)

    reply, sent = GpuhubKernel._run_child(kernel, shell, "x = 1", False, True, {}, grant, "c1")

    assert sent is None
    assert reply["status"] == "error" and reply["ename"] == "CellProcessNotStarted"
    assert "Cannot allocate memory" in reply["evalue"] and "nothing ran" in reply["evalue"]
    assert reply["execution_count"] == 4 and shell.execution_count == 5  # counted, as IPython counts a failed cell
    assert shell.shown == [("CellProcessNotStarted", reply["evalue"])]  # the notebook shows it
    assert reaper.ended == [("c1", None, grant)]  # the grant goes back, no process to wait for
    assert shell.history == [(4, "x = 1")]  # In[4], as the other replicas record it
