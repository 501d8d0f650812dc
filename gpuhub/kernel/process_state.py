"""What a notebook's cells leave in the process besides variables: the working directory and the
environment variables they set (``%cd``, ``os.chdir``, ``%env``, ``os.environ[...] = ...``).

A plain kernel keeps both in its one process. A gpuhub kernel runs a cell in another process (a
GPU cell's own child, forked from its replica) or on another replica (an election, a failover),
so every namespace image carries them (:mod:`gpuhub.kernel.image`) and every replica that loads
an image takes them on: the next cell, wherever it runs, starts where the last one left off.

The environment travels as changes against the replica's own at its start (:func:`take_baseline`),
so what differs from server to server (and the variables gpuhub sets per replica or per GPU grant)
stays each replica's own.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# Set by gpuhub itself: per replica by its unit (GPUHUB_*), per grant in a GPU cell's process.
MANAGED = frozenset({"CUDA_VISIBLE_DEVICES"})
MANAGED_PREFIX = "GPUHUB_"

_baseline: dict[str, str] | None = None


def take_baseline() -> None:
    """The environment the cells start from: call once the kernel has started (ipykernel sets some
    variables of its own while it starts). A GPU cell's process inherits it with the module."""
    global _baseline
    _baseline = dict(os.environ)


def _managed(name: str) -> bool:
    return name in MANAGED or name.startswith(MANAGED_PREFIX)


def _start() -> dict[str, str]:
    if _baseline is None:
        take_baseline()
    return _baseline  # type: ignore[return-value]


def capture() -> dict:
    """This process's working directory and the environment variables its cells set or removed."""
    start, env = _start(), os.environ
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # the directory was removed under the kernel: nothing to carry
        cwd = None
    return {"cwd": cwd,
            "set": {k: v for k, v in env.items() if not _managed(k) and start.get(k) != v},
            "unset": sorted(k for k in start if k not in env and not _managed(k))}


def apply(state: dict) -> None:
    """Take on ``state`` (from :func:`capture`, maybe in another process): the environment becomes
    this replica's start plus the changes, and the working directory ``state``'s, where it exists."""
    wanted = {k: v for k, v in _start().items() if not _managed(k)}
    wanted.update(state.get("set") or {})
    for name in state.get("unset") or ():
        wanted.pop(name, None)
    for name in [k for k in os.environ if not _managed(k) and k not in wanted]:
        del os.environ[name]
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    cwd = state.get("cwd")
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
        log.warning("cannot change to the notebook's working directory %s on this server: %s", cwd, exc)
