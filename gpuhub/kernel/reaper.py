"""Ends a GPU cell after its reply: reap the cell's process, then give its grant back (docs/architecture.md D2).

A cell's GPU memory is free only once its process has exited, so the grant may end only after
``waitpid``. The reply and the commit need nothing from the exit (the child has sent its result
and namespace delta by then), so both wait on a background thread instead of the critical path.
The kernel's next grant request waits for that thread first: a kernel must not find the GPU of a
1-GPU node still held by its own previous cell.

A cell whose process stays for the next cell (a lingering lease, gpuhub/kernel/kernel.py) is not
reaped: the worker tells the agent instead, which may then end that process when another kernel
needs the GPUs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time only GPU kernels import the lease client (gpuhub/kernel/kernel.py)
    from gpuhub.kernel.lease_client import Lease

log = logging.getLogger("gpuhub.kernel")


class CellReaper:
    """One worker thread, started on first use (starting a thread per cell costs the reply a
    scheduling round trip on a busy machine); at most one cell's end in flight."""

    def __init__(self, release: Callable[[Lease], None],
                 linger: Callable[[Lease, int], str | None] = lambda grant, pid: "no agent") -> None:
        self._release = release
        self._linger = linger
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None

    def end_later(self, cell: str, pid: int | None, grant: Lease | None) -> None:
        """Reap ``pid`` (None: already reaped), then release ``grant``, on the worker thread."""
        self._later(self._end, cell, pid, grant, time.monotonic())

    def linger_later(self, cell: str, pid: int, grant: Lease, refused: Callable[[str], None]) -> None:
        """Tell the agent, on the worker thread, that ``pid`` keeps ``grant``'s GPUs warm;
        ``refused(why)`` (on that thread) when the agent does not agree."""
        self._later(self._tell_linger, cell, pid, grant, refused)

    def _later(self, step: Callable, *job) -> None:
        self.wait()  # one at a time, so that cells end in their order
        self._idle.clear()
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="gpuhub-cell-reaper", daemon=True)
            self._worker.start()
        self._work.put((step, *job))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the last cell's process is gone and its grant released; False on timeout."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            step, *job = self._work.get()
            try:
                step(*job)
            except Exception:  # the thread must outlive any one cell; the agent expires a lost lease
                log.exception("ending GPU cell %s failed", job[0])
            finally:
                self._idle.set()

    def _end(self, cell: str, pid: int | None, grant: Lease | None, handed_over: float) -> None:
        if pid is not None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped elsewhere: it is gone all the same
                pass
        exited = time.monotonic()
        if grant is not None:
            self._release(grant)
        log.debug("cell %s: process exited %.1f ms after its delta, lease released in %.1f ms", cell,
                  (exited - handed_over) * 1000, (time.monotonic() - exited) * 1000)

    def _tell_linger(self, cell: str, pid: int, grant: Lease, refused: Callable[[str], None]) -> None:
        why = self._linger(grant, pid)
        if why is not None:
            log.info("cell %s: its process cannot keep the GPUs warm for the next cell: %s", cell, why)
            refused(why)
