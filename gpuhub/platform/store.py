"""One JSON document on local disk, replaced atomically: the daemons' state files.

A save never leaves a half-written file where a reader (or the daemon after a crash or power loss)
would find it: the new content goes to a temporary file in the same directory (same file system,
so the rename is atomic) and is renamed over the old one. A crash of the daemon at any point leaves
either the old document or the new one. A *durable* store also flushes the file and the directory
entry to disk (two fsyncs), so that a power loss does too; that costs about a millisecond a save.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


class CorruptStore(ValueError):
    """The file exists but does not hold JSON (the caller decides whether to rebuild)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} is corrupt: {reason}")
        self.path = path


class JsonStore:
    """``path`` holds one JSON document with file mode ``mode`` (0600 by default: state files
    carry secrets such as kernel keys). Its directory is created ``dir_mode`` if missing.
    ``durable``: each save survives a power loss, not only a crash of the daemon."""

    def __init__(self, path: str | os.PathLike, mode: int = 0o600, dir_mode: int = 0o700, *,
                 durable: bool = True) -> None:
        self.path = Path(path)
        self.mode = mode
        self.dir_mode = dir_mode
        self.durable = durable

    def save(self, data: Any) -> None:
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True, mode=self.dir_mode)
        # mkstemp: a fresh name (O_EXCL, never a file or symlink someone left there) created 0600,
        # so the content is never readable by others, even for a moment, before the chmod below.
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), self.mode)  # mkstemp's 0600, or the mode asked for; no umask
                json.dump(data, f)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if self.durable:
            _fsync_dir(parent)  # or a power loss may forget the rename

    def load(self) -> Any:
        """The document, or None if there is no file; :class:`CorruptStore` if it is not JSON."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:  # includes UnicodeDecodeError
            raise CorruptStore(self.path, str(exc)) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
