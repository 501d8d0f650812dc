"""Ends a GPU cell after its reply: reap the cell's process, then give its grant back (DESIGN D2).

A cell's GPU memory is free only once its process has exited, so the grant may end only after
``waitpid``. The reply and the commit need nothing from the exit (the child has sent its result
and namespace delta by then), so both wait on a background thread instead of the critical path.
The kernel's next grant request waits for that thread first: a kernel must not find the GPU of a
1-GPU node still held by its own previous cell.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from gpuhub.kernel.grants import Grant

log = logging.getLogger("gpuhub.kernel")


class CellReaper:
    def __init__(self, release: Callable[[Grant], None]) -> None:
        self._release = release
        self._pending: threading.Thread | None = None

    def end_later(self, cell: str, pid: int | None, grant: Grant | None) -> None:
        """Reap ``pid`` (None: already reaped), then release ``grant``, on a background thread."""
        self.wait()  # at most one cell's end in flight, so their order is the cells' order
        thread = threading.Thread(target=self._end, args=(cell, pid, grant, time.monotonic()),
                                  name="gpuhub-cell-reaper", daemon=True)
        self._pending = thread
        thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the last cell's process is gone and its grant released; False on timeout."""
        thread = self._pending
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        if self._pending is thread:
            self._pending = None
        return True

    def _end(self, cell: str, pid: int | None, grant: Grant | None, handed_over: float) -> None:
        if pid is not None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped elsewhere: it is gone all the same
                pass
        exited = time.monotonic()
        if grant is not None:
            try:
                self._release(grant)
            except Exception:  # the agent expires the lease once the replica dies
                log.exception("releasing lease %s of cell %s failed", grant.lease_id, cell)
        log.debug("cell %s: process exited %.1f ms after its delta, lease released in %.1f ms", cell,
                  (exited - handed_over) * 1000, (time.monotonic() - exited) * 1000)
