"""Journals: each kernel replica's Raft log on local disk, under ``<state_dir>/journals/<unit>``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpuhub.agent.units import UNIT_NAME, UnitError


class Journals:
    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.state_dir = Path(state_dir)

    @property
    def root(self) -> Path:
        return self.state_dir / "journals"

    def dir(self, name: str) -> Path:
        if not UNIT_NAME.match(name):  # never a path like ".." from a request
            raise UnitError(f"not a unit name: {name!r}")
        return self.root / name

    @property
    def parents(self) -> tuple[Path, ...]:
        """Root-owned 0711 under systemd: a unit's user reaches its own journal directory but
        cannot list the others (like /run/gpuhub/units)."""
        return (self.state_dir, self.root)

    def open_parents(self) -> None:
        """Make :attr:`parents` 0711 again: systemd resets StateDirectoryMode= at each agent start."""
        if self.root.is_dir():
            for d in self.parents:
                os.chmod(d, 0o711)

    def remove(self, name: str) -> None:
        if UNIT_NAME.match(name):
            shutil.rmtree(self.dir(name), ignore_errors=True)  # does not follow symlinks
