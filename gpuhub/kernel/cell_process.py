"""A GPU cell's process, forked from its replica ahead of need (docs/architecture.md D2).

Every GPU cell runs in a process forked from the replica (gpuhub/kernel/child.py). Forking a
replica that holds a large namespace copies its page tables, and the child's write tracker then
arms over every large buffer (a word of every page): on the 2-core dev VM about 20 ms of a no-op
cell with 1 GiB in the namespace. So the executor forks the next cell's process as soon as a cell
is over; the process gets ready and waits for its cell.

Such a process is a copy of the replica at the moment of its fork, so it may run a cell only if
nothing it copied changed since: the kernel gives it a ``state`` (a fingerprint of what the cell
would see: the image loaded, the prompt number, the modules imported) and forks afresh when that
differs. It has not touched CUDA, holds no GPU and no lease; discarding it costs nothing but the
fork.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuhub.kernel import pipe
from gpuhub.kernel.pipe import FrameReader, FrameWriter
from gpuhub.replication.blobstore import new_buffer

if TYPE_CHECKING:
    from gpuhub.kernel.lease_client import Lease
    from gpuhub.kernel.reaper import CellReaper

# A GPU cell's child that failed in gpuhub's own code (not the user's: that is the cell's error)
CHILD_FAILED = 70  # EX_SOFTWARE


@dataclass
class CellProcess:
    pid: int
    reader: FrameReader  # frames from the child: outputs, the reply, the namespace image
    writer: FrameWriter  # frames to it: the cell ("go"), answers to input()
    state: Hashable  # what the kernel's state was when it forked (see the module docstring)
    forked: float = field(default_factory=time.monotonic)
    started: float | None = None  # when it was handed its cell
    status: int | None = None  # its wait status, once reaped here
    pipes_closed: bool = False

    @classmethod
    def fork(cls, shell, resident: dict[str, memoryview], state: Hashable,
             alloc: Callable[[int], object] = new_buffer) -> CellProcess:
        """Fork a process that gets ready for a cell of ``shell`` and waits for it. ``resident``:
        the replica's memory holding the last image's large buffers (digest -> memory), which the
        child's write tracker watches. ``alloc``: where the values it sends back are read into
        (:class:`~gpuhub.kernel.pipe.FrameReader`)."""
        from gpuhub.kernel import child  # imported at start by GPU kernels

        fds: list[int] = []
        try:
            fds += os.pipe()
            pipe.widen(fds[1])  # the image's buffers come this way
            fds += os.pipe()
            pipe.widen(fds[3])  # "go" names every stored value: not a write that waits on the child
            sys.stdout.flush()
            sys.stderr.flush()
            # Python reseeds `random` in every forked child; a cell's process continues the
            # notebook's sequence instead (the replica holds it: gpuhub/kernel/random_state.py).
            generator = random.getstate()
            pid = os.fork()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        out_r, out_w, in_r, in_w = fds
        if pid == 0:  # the child: never returns
            try:
                random.setstate(generator)
                os.close(out_r)
                os.close(in_w)
                child.serve(shell, dict(resident), out_fd=out_w, in_fd=in_r)
            except BaseException:
                traceback.print_exc(file=sys.__stderr__)  # the replica's log (journal)
                os._exit(CHILD_FAILED)
            finally:
                os._exit(0)
        os.close(out_w)
        os.close(in_r)
        return cls(pid, FrameReader(out_r, alloc), FrameWriter(in_w), state)

    def start(self, cell: dict) -> bool:
        """Hand the process its cell; False (and the process is discarded) when it is gone."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            reaped = pid != 0
            if reaped:
                self.status = status
        except ChildProcessError:
            reaped = True
        if reaped:  # it died while waiting (its pid may be another process's now: no signal)
            self.close_pipes()
            return False
        try:
            self.writer.send("go", cell)
        except OSError:  # BrokenPipeError: it is dying
            self.close_pipes()
            self.status = os.waitpid(self.pid, 0)[1]
            return False
        self.started = time.monotonic()
        return True

    def close_pipes(self) -> None:
        """Close this end of both pipes: a child still writing gets EPIPE and leaves. Once only:
        a descriptor number closed twice may by then be another thread's socket."""
        if self.pipes_closed:
            return
        self.pipes_closed = True
        for fd in (self.reader.fd, self.writer.fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def discard(self) -> None:
        """End a process that will run no cell (never one running a cell: the reaper ends those).
        Reaped on a thread: the exit of a process sharing a large namespace takes milliseconds."""
        self.close_pipes()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        threading.Thread(target=_reap, args=(self.pid,), name="gpuhub-reap-spare", daemon=True).start()


@dataclass
class LingeringProcess:
    """A GPU cell's process kept after its cell, with its lease, for the kernel's next cell. It may
    run that cell only if the kernel is still in ``state`` (nothing else changed the namespace) and
    the agent still holds the lease for it (``resume``): the agent ends the process when another
    kernel needs the GPUs."""

    proc: CellProcess
    grant: Lease
    cell: str  # the cell it ran last (log lines)
    state: Hashable = None  # the kernel's state once that cell's image was committed and loaded
    refused: str | None = None  # why the agent would not hold it (set by the reaper's thread)
    timer: object = None  # the asyncio handle that ends it after the kernel's linger time

    def end(self, reaper: CellReaper, *, release: bool = True) -> None:
        """Let it go (it leaves at the end of its pipe), reap it and give the lease back, on the
        reaper's thread. ``release`` False: the agent has taken the lease back already."""
        if self.timer is not None:
            self.timer.cancel()
        self.proc.close_pipes()
        reaper.end_later(self.cell, self.proc.pid, self.grant if release else None)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
