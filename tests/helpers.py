"""Waiting for an event instead of sleeping for a guess: poll a condition until a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
             interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``predicate`` until it returns something true and return that; fail the test naming
    ``what`` after ``timeout`` seconds. Exceptions of the types in ``ignore`` count as "not yet"
    (e.g. OSError while a daemon is still starting); the last one is shown on a timeout."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignore as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                                 + (f" (last error: {last!r})" if last else ""))
        time.sleep(interval)


def debugpy_adapters() -> set[int]:
    """Pids of debugpy's adapter processes: what ipykernel's debugger starts (detached), listening on
    127.0.0.1 for any client, without authentication."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"debugpy/adapter" in cmdline or b"debugpy.adapter" in cmdline:
            found.add(int(pid))
    return found
