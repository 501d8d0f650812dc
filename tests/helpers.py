"""Waiting for an event instead of sleeping for a guess: poll a condition until a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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


async def async_wait_for(predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0,
                         what: str = "the condition", interval: float = 0.05) -> T:
    """:func:`wait_for` inside an event loop: sleeps with asyncio, so the loop's own tasks run
    while it waits. ``predicate`` may be a plain function or return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def wait_for_log(path, text: str, timeout: float = 10.0, start: int = 0) -> None:
    """Wait until the file at ``path`` contains ``text`` after byte offset ``start``."""

    def seen() -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return text.encode() in f.read()
        except FileNotFoundError:
            return False

    wait_for(seen, timeout, f"{text!r} in {path}")
