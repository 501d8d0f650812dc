"""How a replica's agent and a CPU kernel's replica agree that a replica about to move runs no cell.

Before a drain or a migration takes a replica out of its group, the scheduler fences it at its
agent (``POST /api/v1/units/<unit>/fence``). A GPU cell holds a lease, so the agent sees it run and
grants a fenced replica nothing more. A CPU cell asks the agent for nothing, so two small files in
the unit's directory (``/run/gpuhub/units/<unit>``, 0700, the unit's user's) stand in for the lease:

``executing``  the replica writes ``1`` before it may run a cell and ``0`` after; the agent reads it;
``fence``      the agent writes the fence's deadline (``time.monotonic()``, one clock per host);
               the replica reads it, and yields the cell to the other replicas while it holds.

Each side writes its own file before it reads the other's (the replica: executing, then fence; the
agent: fence, then executing), so at least one of them sees the other: either the agent finds the
cell running and the move waits, or the replica finds the fence and lets another replica run the
cell. A cell is never started on a replica that is then stopped under it.

The files are in a directory the user owns, so the agent opens ``executing`` without following a
link and reads it only if it is a plain file, and writes ``fence`` with ``write_private`` (a fresh
name, then a rename). A user who deletes or rewrites them only loses the protection for their own
kernel.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FENCE_FILE = "fence"
EXECUTING_FILE = "executing"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _read_small(path: Path) -> bytes | None:
    """The first bytes of a plain file, None if it is missing, a link or anything else."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # a FIFO or a device planted there: never read (it could block or be huge)
        return os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)


def fence_text(hold_s: float) -> str:
    """What the agent writes into ``fence``: the monotonic deadline of a fence held ``hold_s``."""
    return f"{time.monotonic() + hold_s:.3f}\n"


def fenced(unit_dir: Path) -> bool:
    """Whether the agent's fence on this replica holds now."""
    text = _read_small(unit_dir / FENCE_FILE)
    if text is None:
        return False
    try:
        return float(text) > time.monotonic()
    except ValueError:
        return True  # written by hand, or half-understood: the safe reading is "fenced"


def executing(unit_dir: Path) -> bool:
    """Whether the replica said it may be running a CPU cell."""
    return (_read_small(unit_dir / EXECUTING_FILE) or b"0")[:1] == b"1"


def fence(unit_dir: Path, hold_s: float, write: Callable[[Path, str], None]) -> bool:
    """The agent's side, in its order: write the fence (with ``write(path, text)``, the agent's
    own safe writer), then read the mark. True: the replica may be running a CPU cell."""
    write(unit_dir / FENCE_FILE, fence_text(hold_s))
    return executing(unit_dir)


class CellMark:
    """The replica's side: :meth:`begin` before a CPU cell may run here, :meth:`end` after it."""

    def __init__(self, unit_dir: Path) -> None:
        self.unit_dir = unit_dir
        self._fd = os.open(unit_dir / EXECUTING_FILE,
                           os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.pwrite(self._fd, b"0", 0)
        self.marked = False

    @classmethod
    def from_env(cls) -> CellMark | None:
        """The mark in the directory of the unit's peers file (GPUHUB_PEERS_FILE, set by the agent);
        None outside a unit, or where the directory cannot be written."""
        peers = os.environ.get("GPUHUB_PEERS_FILE")
        if not peers:
            return None
        try:
            return cls(Path(peers).parent)
        except OSError as exc:
            log.warning("cannot mark this replica's CPU cells for its agent (%s): a drain may stop one "
                        "while it runs", exc)
            return None

    def begin(self, heed_fence: bool = True) -> bool:
        """Say a cell may run here; False (and the mark taken back) while the agent's fence holds,
        unless ``heed_fence`` is false (a replica with no other to leave the cell to)."""
        os.pwrite(self._fd, b"1", 0)
        self.marked = True
        if heed_fence and fenced(self.unit_dir):
            self.end()
            return False
        return True

    def end(self) -> None:
        if self.marked:
            os.pwrite(self._fd, b"0", 0)
            self.marked = False
