"""Releases: one venv per installed bundle under /opt/gpuhub/venvs/, /opt/gpuhub/venv a symlink to the
current one (docs/upgrades.md).

An upgrade builds the new release beside the old and switches the symlink atomically. A process started
from the symlink would import lazily from whatever release the link names later, so everything that
outlives an upgrade (kernel replicas, users' notebook servers) is started from the release's real path
(:func:`pin`): it keeps its release until it ends. :func:`prune` removes old releases no process uses.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Written last when a release is built: a release directory without it is unfinished.
COMPLETE_MARKER = ".gpuhub-release-complete"


def release_of(venv: str | os.PathLike) -> Path:
    """The real directory of the release ``venv`` (a release's path or the symlink to one)."""
    return Path(venv).resolve()


def release_name(prefix: str | os.PathLike | None = None) -> str:
    """The release ``prefix`` is (its directory name), "" if it is not a gpuhub release. Without a
    prefix: the release this process runs from, looked up once (it cannot change under a process)."""
    if prefix is None:
        return _own_release()
    path = Path(prefix).resolve()
    return path.name if (path / COMPLETE_MARKER).is_file() else ""


@functools.cache
def _own_release() -> str:
    return release_name(sys.prefix)


def pin(argv: list[str], env: dict[str, str], venv: str) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` with every path under the ``venv`` symlink rewritten to the release it
    names now, so the process keeps that release's code across later upgrades."""
    link = venv.rstrip("/")
    real = str(release_of(link))
    if real == link:
        return list(argv), dict(env)

    def fix(path: str) -> str:
        return real + path[len(link):] if path == link or path.startswith(link + "/") else path

    env = dict(env)
    if "PATH" in env:
        env["PATH"] = os.pathsep.join(fix(p) for p in env["PATH"].split(os.pathsep))
    return [fix(a) for a in argv], env


@dataclass
class Release:
    name: str
    path: Path
    complete: bool
    current: bool
    pids: list[int] = field(default_factory=list)  # processes running from it

    def to_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "complete": self.complete, "current": self.current,
                "pids": self.pids}


def processes_using(roots: list[Path], proc: Path = Path("/proc")) -> dict[Path, list[int]]:
    """Which of ``roots`` each live process runs from: its command line names a path inside one (the
    venv's python or a script whose interpreter is the venv's python)."""
    found: dict[Path, list[int]] = {r: [] for r in roots}
    prefixes = [(r, str(r) + "/") for r in roots]
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        words = [a.decode(errors="replace") for a in args if a]
        for root, prefix in prefixes:
            if any(w.startswith(prefix) for w in words):
                found[root].append(int(entry.name))
    return found


def list_releases(root: Path, venv: Path, proc: Path = Path("/proc")) -> list[Release]:
    """Every release under ``root``, newest first, with the processes that still run from it."""
    current = release_of(venv) if venv.is_symlink() else None
    dirs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    dirs.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    users = processes_using(dirs, proc)
    return [Release(name=d.name, path=d, complete=(d / COMPLETE_MARKER).is_file(), current=d == current,
                    pids=sorted(users[d])) for d in dirs]


def prune(root: Path, venv: Path, keep: int, proc: Path = Path("/proc")) -> tuple[list[Release], list[Release]]:
    """Remove releases beyond the ``keep`` newest complete ones (the current one always counts among
    them) that no process runs from. Returns (removed, kept-only-because-in-use)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the current release), not {keep}")
    releases = list_releases(root, venv, proc)
    kept = [r for r in releases if r.current]
    for r in releases:
        if len(kept) >= keep:
            break
        if r.complete and not r.current:
            kept.append(r)
    removed, busy = [], []
    for r in releases:
        if r in kept:
            continue
        if r.pids:
            busy.append(r)
            continue
        shutil.rmtree(r.path)
        removed.append(r)
    return removed, busy
