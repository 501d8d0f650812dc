"""What a notebook's cells leave in the process besides variables: the working directory and the
environment variables they set (``%cd``, ``os.chdir``, ``%env``, ``os.environ[...] = ...``).

A plain kernel keeps both in its one process. A gpuhub kernel runs a cell in another process (a
GPU cell's own child, forked from its replica) or on another replica (an election, a failover),
so every namespace image carries them (:mod:`gpuhub.kernel.image`) and every replica that loads
an image takes them on: the next cell, wherever it runs, starts where the last one left off.

Both travel as changes against the replica's own start (:func:`take_baseline`), so what differs
from server to server stays each replica's own: the variables gpuhub sets per replica or per GPU
grant, a variable a cell extended (``PATH = "/x:" + PATH`` carries "/x:" around each replica's own
value), and a start directory (a replica whose server lacks the notebook's directory starts in the
user's home, and the others must not follow it there unless a cell changed directory).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# Set by gpuhub itself: per replica by its unit (GPUHUB_*), per grant in a GPU cell's process.
MANAGED = frozenset({"CUDA_VISIBLE_DEVICES"})
MANAGED_PREFIX = "GPUHUB_"

_baseline: dict[str, str] | None = None
_start_dir: str | None = None
_unreachable: set[str] = set()  # directories already logged as missing here
_memo: tuple[dict, dict] | None = None  # the environment last captured, and its changes


def take_baseline() -> None:
    """The environment and directory the cells start from: the kernel calls it as it is built,
    before any cell (what ipykernel's start sets later, such as MPLBACKEND, is carried like a
    cell's change, with the same value everywhere). A GPU cell's process inherits it with the module."""
    global _baseline, _start_dir, _memo
    _baseline, _memo = dict(os.environ), None
    try:
        _start_dir = os.getcwd()
    except OSError:
        _start_dir = None


def _managed(name: str) -> bool:
    return name in MANAGED or name.startswith(MANAGED_PREFIX)


def _start() -> dict[str, str]:
    if _baseline is None:
        take_baseline()
    return _baseline  # type: ignore[return-value]


def _change(old: str | None, new: str) -> str | tuple[str, str]:
    """A variable's new value, or (prefix, suffix) around its old one when a cell extended it as a
    list of paths (``/x:`` + PATH, PATH + ``:/x``)."""
    if old and old != new and old in new:
        at = new.index(old)
        prefix, suffix = new[:at], new[at + len(old):]
        before = prefix.endswith(os.pathsep) or not prefix
        after = suffix.startswith(os.pathsep) or not suffix
        if before and after and (prefix or suffix):
            return prefix, suffix
    return new


def capture() -> dict:
    """This process's working directory (None: where it started, or removed under the kernel) and
    the environment variables its cells set or removed, in a stable order (an unchanged namespace
    must give an unchanged image)."""
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    return {"cwd": None if cwd == _start_dir else cwd, **_environment_changes()}


def _environment_changes() -> dict:
    global _memo
    # CPython's own mapping of encoded variables: comparing it costs well under a microsecond,
    # decoding every variable for each image some tens (most cells change none).
    data = getattr(os.environ, "_data", None)
    if _memo is not None and data is not None and _memo[0] == data:
        return _memo[1]
    start, env = _start(), os.environ
    changes = {"set": {k: _change(start.get(k), env[k]) for k in sorted(env)
                       if not _managed(k) and start.get(k) != env[k]},
               "unset": sorted(k for k in start if k not in env and not _managed(k))}
    if isinstance(data, dict):
        _memo = (dict(data), changes)
    return changes


def apply(state: dict) -> None:
    """Take on ``state`` (from :func:`capture`, maybe in another process): the environment becomes
    this replica's start plus the changes, and the working directory ``state``'s, where it exists."""
    start = _start()
    wanted = {k: v for k, v in start.items() if not _managed(k)}
    for name, value in (state.get("set") or {}).items():
        wanted[name] = value if isinstance(value, str) else value[0] + start.get(name, "") + value[1]
    for name in state.get("unset") or ():
        wanted.pop(name, None)
    for name in [k for k in os.environ if not _managed(k) and k not in wanted]:
        del os.environ[name]
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    cwd = state.get("cwd") or _start_dir
    if not cwd:
        return
    try:
        if os.getcwd() == cwd:
            return
    except OSError:
        pass
    try:
        os.chdir(cwd)
    except OSError as exc:  # a directory of another server's own disk, not shared with this one
        if cwd not in _unreachable:
            _unreachable.add(cwd)
            log.warning("cannot change to the notebook's working directory %s on this server: %s", cwd, exc)
