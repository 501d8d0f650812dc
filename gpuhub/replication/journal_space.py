"""A replica's Raft journal meets a full disk with a clear exit, not a SIGBUS (pysyncobj 0.3.x).

pysyncobj keeps the journal in a file it maps (``pysyncobj.journal.ResizableFile``) and grows it
with ``mmap.resize``: on Linux a truncate, which gives the new pages no disk blocks. When the disk
is full, the first write into them is a SIGBUS: the replica died without a word, systemd started
it again, and it died again at its next entry. A user on the same server who fills the disk (their
``/tmp`` and ``/var/tmp`` are on it) did that to every other user's replicas there.

:func:`install` makes the journal reserve the blocks (``posix_fallocate``) before it maps them.
When they cannot be had, nothing has been written into the new part yet, so the journal on disk
stays whole; the replica logs why and exits with :data:`DISK_FULL_EXIT`, which its unit does not
restart (``RestartPreventExitStatus=``, gpuhub/agent/units.py). The scheduler replaces the replica
on another server (as any dead replica), and the kernel goes on with its other replicas meanwhile.
A Raft member cannot go on without its journal: it must not acknowledge entries it did not keep.

pysyncobj offers no hook for this, so :func:`install` wraps ``ResizableFile.write`` once per
process; it refuses to start on a pysyncobj whose ``ResizableFile`` lacks what it relies on.
"""

from __future__ import annotations

import errno
import logging
import os

from pysyncobj.journal import ResizableFile

from gpuhub.platform.exit_status import DISK_FULL_EXIT

log = logging.getLogger("gpuhub.replication")

GROW_STEP = 64 << 10  # when the doubled journal does not fit, it grows by this much at a time
_FILE = "_ResizableFile__f"
_MAP = "_ResizableFile__mm"
_FACTOR = "_ResizableFile__resizeFactor"
_NAME = "_ResizableFile__fileName"
_REMAP = "_ResizableFile__extand"


def reserve(fd: int, offset: int, length: int) -> OSError | None:
    """Give ``[offset, offset + length)`` of the file disk blocks now, so that writing through a
    mapping of it cannot fault; the error when the disk (or the user's quota) has no room."""
    try:
        os.posix_fallocate(fd, offset, length)
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        raise


def stop_for_disk_full(path: str, needed: int, exc: OSError) -> None:
    """Say why and end the process with :data:`DISK_FULL_EXIT` (from pysyncobj's thread too: the
    replica must stop taking part at once)."""
    where = os.path.dirname(path) or "."
    try:
        st = os.statvfs(where)
        free = f"{st.f_bavail * st.f_frsize // 1024} KiB free"
    except OSError:
        free = "free space unknown"
    message = (f"the disk of {where} is full ({free}, the journal needed {needed} more bytes: {exc.strerror}); "
               "this replica stops, and gpuhub places a new one on another server. Free space on this "
               "server (users' /tmp and /var/tmp share it unless the admin gave /var/lib/gpuhub its own "
               "filesystem)")
    # To the unit's log, which the agent reports as the replica's error. Not to stderr: in a kernel
    # ipykernel owns descriptor 2 and forwards it from a thread that would never get to it.
    log.critical("gpuhub replica: %s", message)
    logging.shutdown()  # flushed before the process ends
    os._exit(DISK_FULL_EXIT)


def install() -> None:
    """Reserve the journal's blocks before it grows into them (idempotent)."""
    if getattr(ResizableFile, "_gpuhub_reserving", False):
        return
    write = ResizableFile.write

    def reserving_write(self: ResizableFile, offset: int, values) -> None:
        mapped = getattr(self, _MAP)
        end = offset + len(values)
        size = mapped.size()
        if end > size:
            # Grown as pysyncobj's write grows it, but reserved first. Then mapped here: its
            # ``size()`` is the file's, which the reservation has already grown.
            grown = max(int(size * getattr(self, _FACTOR)), end)
            fd = getattr(self, _FILE).fileno()
            if reserve(fd, size, grown - size) is not None:
                grown = end + GROW_STEP - end % GROW_STEP  # less than doubling may still fit
                full = reserve(fd, size, grown - size)
                if full is not None:
                    stop_for_disk_full(getattr(self, _NAME), grown - size, full)
            try:
                mapped.resize(grown)
            except (SystemError, OSError):
                getattr(self, _REMAP)(0)  # pysyncobj's fallback: map the whole file again
        write(self, offset, values)

    if not {_FILE, _MAP, _FACTOR, _NAME, _REMAP} <= set(ResizableFile.__init__.__code__.co_names):
        raise RuntimeError("this pysyncobj's journal lacks what gpuhub relies on "
                           "(gpuhub/replication/journal_space.py): install the version requirements/runtime.txt pins")
    ResizableFile.write = reserving_write
    ResizableFile._gpuhub_reserving = True
