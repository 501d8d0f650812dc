"""Large values a GPU kernel's replica holds live in 2 MiB pages.

A GPU kernel forks for every cell; the fork copies one page-table entry per 4 KiB page of the
parent, so a large value in 4 KiB pages makes every cell slower. This module collapses such values
into huge pages once, on a background thread.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading

from gpuhub.replication import blobstore

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <sys/mman.h>; MADV_COLLAPSE since Linux 6.1
HUGE_PAGE = blobstore.HUGE_PAGE
HUGE_MIN_BYTES = 32 << 20  # below this, 4 KiB pages cost the fork little


def _buffer_range(value) -> tuple[int, int] | None:
    """(address, length) of a large contiguous buffer: ndarray, bytes, bytearray, memoryview."""
    if isinstance(value, memoryview):
        value = value.obj  # the whole exporter: the same allocation
    np = sys.modules.get("numpy")
    if np is not None and type(value) is np.ndarray:
        if not (value.flags.c_contiguous or value.flags.f_contiguous):
            return None
        return value.ctypes.data, value.nbytes
    if type(value) is bytes:
        return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value, len(value)
    if type(value) in (bytearray, blobstore.AnonBuffer) and len(value):
        c = (ctypes.c_char * 1).from_buffer(value)
        try:
            return ctypes.addressof(c), len(value)
        finally:
            del c
    return None


def prefer_huge_pages(value) -> bool:
    """Back a large buffer the replica holds with 2 MiB pages, so that each GPU cell's fork copies
    512 times fewer page-table entries for it (a value that arrived through ``pickle.loads`` sits
    in 4 KiB pages: fork + exit cost about 1 s per GiB of them on the dev VM, 36 ms once
    collapsed). Synchronous (``MADV_COLLAPSE`` copies the data once); True if Linux did it."""
    try:
        where = _buffer_range(value)
    except (TypeError, ValueError, AttributeError):
        return False
    if where is None or where[1] < HUGE_MIN_BYTES:
        return False
    addr, n = where
    lo, hi = -(-addr // HUGE_PAGE) * HUGE_PAGE, (addr + n) // HUGE_PAGE * HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)  # also for pages faulted in later
        return libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0
    except (OSError, AttributeError):
        return False


_collapse_queue: queue.SimpleQueue | None = None
_collapsing = 0  # values queued or being collapsed
_collapsing_lock = threading.Lock()


def busy() -> bool:
    """Values are queued or being collapsed (a process forked now would share pages about to move)."""
    return _collapsing > 0


def collapse_later(value) -> None:
    """:func:`prefer_huge_pages` on a background thread (madvise releases the GIL), so collapsing a
    new large value costs the GPU kernel's next cells a cheaper fork, not this cell's reply."""
    global _collapse_queue, _collapsing
    try:
        where = _buffer_range(value)
    except (TypeError, ValueError, AttributeError):
        return
    if where is None or where[1] < HUGE_MIN_BYTES:
        return
    if _collapse_queue is None:
        _collapse_queue = queue.SimpleQueue()
        threading.Thread(target=_collapse_worker, args=(_collapse_queue,), name="gpuhub-huge-pages",
                         daemon=True).start()
    with _collapsing_lock:
        _collapsing += 1
    _collapse_queue.put(value)


def _collapse_worker(work: queue.SimpleQueue) -> None:
    global _collapsing
    while True:
        value = work.get()
        try:
            prefer_huge_pages(value)
        finally:
            del value  # do not keep the last value alive while waiting
            with _collapsing_lock:
                _collapsing -= 1
