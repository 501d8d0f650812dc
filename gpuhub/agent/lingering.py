"""The idle cell processes that keep a kernel's GPUs warm between its cells (lingering leases).

After a GPU cell the kernel may keep the cell's process, with its CUDA context and GPU memory,
for its next cell (gpuhub/kernel/kernel.py, "lingering"); the lease stays, marked lingering
(gpuhub/agent/leases.py). When another grant needs those GPUs the agent ends that process itself
and waits for its exit, which is when the driver frees its GPU memory: the kernel loses nothing,
since its namespace was replicated after the cell.

The agent runs as root and kills a process a kernel named, so the name is checked: the process
must run as the unit's user, in the unit's cgroup, as a child of the unit's main process (the
replica), which the agent learns from systemd, not from the kernel. It is held by a pidfd from
then on, so a reused pid is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal

log = logging.getLogger(__name__)

# A process whose exit the driver has not let happen by then (stuck in the driver after SIGKILL):
# its lease goes back all the same, and the log says so. Well under a kernel's 10 s for a grant.
EXIT_WAIT_S = 4.0


class LingerRefused(ValueError):
    """The named process cannot linger (not the unit's replica's child, gone, or no pidfds here)."""


def _status(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _cgroup(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def is_cell_process(pid: int, replica_pid: int, uid: int) -> bool:
    """Whether ``pid`` is a live process of ``uid`` forked by ``replica_pid`` and in its cgroup."""
    fields = _status(pid)
    if fields is None or fields.get("State", "").strip().startswith("Z"):
        return False
    try:
        ppid, real_uid = int(fields["PPid"]), int(fields["Uid"].split()[0])
    except (KeyError, ValueError, IndexError):
        return False
    cgroup = _cgroup(pid)
    return ppid == replica_pid and real_uid == uid and cgroup is not None and cgroup == _cgroup(replica_pid)


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


class LingeringProcesses:
    """pidfds of the processes of lingering leases, by lease id, and the ends under way."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._ending: dict[str, asyncio.Future] = {}

    def adopt(self, lease_id: str, pid: int, replica_pid: int | None, uid: int) -> None:
        """Hold ``pid`` for ``lease_id`` if it is a cell process of the unit (see
        :func:`is_cell_process`); LingerRefused if not."""
        if not replica_pid:
            raise LingerRefused("the kernel's replica process is not known")
        if self.ending(lease_id):
            raise LingerRefused(f"lease {lease_id} is being taken back")
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, OverflowError, ValueError, AttributeError) as exc:
            raise LingerRefused(f"process {pid}: {getattr(exc, 'strerror', None) or exc}") from None
        # Checked after the pidfd is open: the fd names the process that was checked, or a dead one.
        if pid <= 1 or not is_cell_process(pid, replica_pid, uid) or _exited(pidfd):
            os.close(pidfd)
            raise LingerRefused(f"process {pid} is not a running cell process of this kernel")
        self.forget(lease_id)
        self._fds[lease_id] = pidfd

    def ending(self, lease_id: str) -> bool:
        return lease_id in self._ending

    def ending_ids(self) -> frozenset[str]:
        return frozenset(self._ending)

    def alive(self, lease_id: str) -> bool:
        """Its process lives (or is being ended and has not exited yet)."""
        if lease_id in self._ending:
            return True
        pidfd = self._fds.get(lease_id)
        return pidfd is not None and not _exited(pidfd)

    def end(self, lease_id: str) -> asyncio.Future:
        """Kill the lease's process now and return a future that is done once it has exited (True)
        or EXIT_WAIT_S passed (False). Called again meanwhile, the same future. Await it through
        ``asyncio.shield``: a waiter's cancellation must not cancel the end itself."""
        loop = asyncio.get_running_loop()
        if lease_id in self._ending:
            return self._ending[lease_id]
        done = loop.create_future()
        pidfd = self._fds.pop(lease_id, None)
        if pidfd is None:
            done.set_result(True)
            return done
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        self._ending[lease_id] = done

        finished = False

        def finish(exited: bool) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            loop.remove_reader(pidfd)
            timer.cancel()
            os.close(pidfd)
            self._ending.pop(lease_id, None)
            if not exited:
                log.warning("lingering process of lease %s did not exit within %.0f s of SIGKILL; its lease "
                            "goes back all the same", lease_id, EXIT_WAIT_S)
            if not done.done():
                done.set_result(exited)

        timer = loop.call_later(EXIT_WAIT_S, finish, False)
        loop.add_reader(pidfd, finish, True)
        return done

    def forget(self, lease_id: str) -> None:
        """Stop holding the lease's process (it runs a cell again, or is gone); never one being ended."""
        pidfd = self._fds.pop(lease_id, None)
        if pidfd is not None:
            os.close(pidfd)
