"""The idle cell processes that keep a kernel's GPUs warm between its cells (lingering leases).

After a GPU cell the kernel may keep the cell's process, with its CUDA context and GPU memory,
for its next cell (gpuhub/kernel/kernel.py, "lingering"); the lease stays, marked lingering
(gpuhub/agent/leases.py). When another grant needs those GPUs the agent ends that process itself
and waits for its exit, which is when the driver frees its GPU memory: the kernel loses nothing,
since its namespace was replicated after the cell.

The agent runs as root and kills a process a kernel named, so the name is checked: the process
must be a child of the kernel unit's main process (the replica), which the agent learns from
systemd, not from the kernel. It is held by a pidfd from then on, so a reused pid is never
signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal

log = logging.getLogger(__name__)

# A process whose GPU memory the driver has not freed by then: the lease goes back all the same
# (the next cell on that GPU may find less memory), and the log says so.
EXIT_WAIT_S = 10.0


class LingerRefused(ValueError):
    """The named process cannot linger (not the unit's replica's child, gone, or no pidfds here)."""


def parent_and_uid(pid: int) -> tuple[int, int] | None:
    """PPid and real uid of a live (not zombie) process, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if fields.get("State", "").strip().startswith("Z"):
        return None
    try:
        return int(fields["PPid"]), int(fields["Uid"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


class LingeringProcesses:
    """pidfds of the processes of lingering leases, by lease id."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def adopt(self, lease_id: str, pid: int, replica_pid: int | None, uid: int) -> None:
        """Hold ``pid`` for ``lease_id`` if it is a live child of ``replica_pid`` running as ``uid``
        (the unit's user: a pid of a replica since restarted may be another's); LingerRefused if not."""
        if not replica_pid:
            raise LingerRefused("the kernel's replica process is not known")
        if pid <= 1:
            raise LingerRefused(f"process {pid} is not a running cell process of this kernel")
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:
            raise LingerRefused(f"process {pid}: {getattr(exc, 'strerror', None) or exc}") from None
        # Checked after the pidfd is open: the fd names the process that was checked, or a dead one.
        if parent_and_uid(pid) != (replica_pid, uid) or _exited(pidfd):
            os.close(pidfd)
            raise LingerRefused(f"process {pid} is not a running cell process of this kernel")
        self.forget(lease_id)
        self._fds[lease_id] = pidfd

    def holds(self, lease_id: str) -> bool:
        return lease_id in self._fds

    def alive(self, lease_id: str) -> bool:
        pidfd = self._fds.get(lease_id)
        return pidfd is not None and not _exited(pidfd)

    def kill(self, lease_id: str) -> None:
        """Kill the lease's process and forget it, without waiting for its exit."""
        pidfd = self._fds.pop(lease_id, None)
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)

    async def end(self, lease_id: str) -> bool:
        """Kill the lease's process and wait (bounded) for its exit; False if it outlived the wait."""
        pidfd = self._fds.pop(lease_id, None)
        if pidfd is None:
            return True
        try:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if _exited(pidfd):
                return True
            loop = asyncio.get_running_loop()
            exited = loop.create_future()
            loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(True))
            try:
                await asyncio.wait_for(exited, EXIT_WAIT_S)
                return True
            except TimeoutError:
                log.warning("lingering process of lease %s did not exit within %.0f s of SIGKILL", lease_id,
                            EXIT_WAIT_S)
                return False
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)

    def forget(self, lease_id: str) -> None:
        pidfd = self._fds.pop(lease_id, None)
        if pidfd is not None:
            os.close(pidfd)
