"""Which large buffers did a cell write? Linux page bits instead of re-pickling (docs/architecture.md D4).

After every cell the executor sends the group what the cell changed. For a mutable value that was
not rebound, the only general test is to pickle it and compare digests, which for a 1 GiB numpy
array costs about a second per cell. This module answers the same question for large
buffer-backed values (``numpy.ndarray``, ``bytearray``, and CPU ``torch.Tensor`` when the user
has imported torch: it is never imported here) from the kernel's page tables, in milliseconds.

Signals, both read from ``/proc/self/pagemap`` (one 64-bit entry per page, flags readable
without privileges):

- **soft-dirty** (bit 55): writing ``4`` to ``/proc/self/clear_refs`` clears it on every page of
  the process; the kernel sets it again on the first write to a page. Needs a kernel built with
  ``CONFIG_MEM_SOFT_DIRTY``; :data:`SOFT_DIRTY` says whether it works here, probed once at import
  (``clear_refs`` writable *and* the bit seen to clear and to flip back on a write).
- **copy-on-write** (bit 56, "exclusively mapped"): in the GPU cell's child, forked just before
  the cell, every page is shared with the replica process; the child's first write to a page
  copies it, and only then is the page mapped by the child alone. Checked in each child before
  use (:func:`_cow_works`), on a page the parent wrote before forking.

:meth:`Tracker.arm` is called before the cell and snapshots each large value; after the cell
:meth:`Tracker.unchanged` says True only when **all** of these hold, anything else means "pickle
it as before" (a false "changed" costs time, a false "unchanged" silently loses data):

1. the same object (``id``) with the same layout: data pointer, shape, strides, dtype (numpy);
   length (bytearray); storage pointer and size, offset, sizes, strides, dtype, ``_version``,
   ``requires_grad`` and no Python attributes (torch, whose pickle holds the whole storage);
2. every page of the buffer's bytes lies in a private anonymous mapping (a shared mapping can be
   written by another process, or through another mapping, without touching our bits), and is
   present or swapped out (a page dropped by ``madvise`` or never touched reads as zeros: not
   trusted);
3. no page has a set bit among the armed signals (soft-dirty if it works here; exclusive if the
   tracker was armed in a freshly forked child) — except that the first and last page, which the
   buffer may share with other data (malloc's headers, heap neighbours), may have one if the
   buffer's own bytes on them equal a copy taken when armed;
4. copy-on-write only: the cell did not fork. A page written *before* a fork is shared again
   with the new process while it lives, so the bit would hide the write. Python-level forks are
   counted (``os.register_at_fork``); a live child process running this interpreter also voids
   the copy-on-write answer. A process forked from C code that is no longer our child (a daemon's
   double fork) would still escape this check; soft-dirty, when the kernel has it, is OR-ed in
   and is immune to it.

Writes by devices (DMA into pinned pages) set neither bit: pinning for write breaks copy-on-write
(so the page is exclusive, i.e. "written"), and CUDA's own pinned allocations are shared device
mappings, which rule 2 excludes.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import sys
from dataclasses import dataclass

log = logging.getLogger("gpuhub.dirty")

THRESHOLD = 1 << 20
"""Values smaller than this (bytes) are not tracked: pickling them is cheaper than asking."""
PAGE = mmap.PAGESIZE
PAGEMAP = "/proc/self/pagemap"
CLEAR_REFS = "/proc/self/clear_refs"
_READ_PAGES = 1 << 16  # pagemap entries per read (512 KiB)

# Byte 6 of a little-endian pagemap entry holds bit 55, byte 7 bits 56..63.
_SOFT_DIRTY = 0x80  # bit 55, in byte 6
_EXCLUSIVE = 0x01  # bit 56, in byte 7
_SWAPPED = 0x40  # bit 62, in byte 7
_PRESENT = 0x80  # bit 63, in byte 7

# For bytes.translate(None, delete): the byte values that are fine; whatever is left is not.
_CLEAN_SD = bytes(b for b in range(256) if not b & _SOFT_DIRTY)
_RESIDENT = bytes(b for b in range(256) if b & (_PRESENT | _SWAPPED))
_RESIDENT_SHARED = bytes(b for b in range(256) if b & (_PRESENT | _SWAPPED) and not b & _EXCLUSIVE)


def _entries(first_page: int, npages: int, fd: int | None = None) -> bytes:
    """Raw pagemap entries (8 bytes each) for ``npages`` pages from page number ``first_page``."""
    own = fd is None
    if own:
        fd = os.open(PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
    try:
        want, out, pos = npages * 8, [], first_page * 8
        while want:
            got = os.pread(fd, want, pos)
            if not got:
                raise OSError("short read from pagemap")
            out.append(got)
            want -= len(got)
            pos += len(got)
        return b"".join(out)
    finally:
        if own:
            os.close(fd)


def _page_of(addr: int) -> int:
    return addr // PAGE


def clear_soft_dirty() -> None:
    with open(CLEAR_REFS, "w") as f:
        f.write("4")


def _address(buf) -> int:
    """Address of a writable buffer's first byte (bytearray, mmap)."""
    c = (ctypes.c_char * 1).from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def _probe_page() -> mmap.mmap | None:
    try:
        page = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return None
    page[0] = 1  # present, written by this process
    return page


def _probe_soft_dirty() -> bool:
    """Whether soft-dirty bits work in this process: they clear, and a write sets them again."""
    page = _probe_page()
    if page is None:
        return False
    try:
        n = _page_of(_address(page))
        clear_soft_dirty()
        cleared = _entries(n, 1)[6] & _SOFT_DIRTY == 0
        page[0] = 2
        flipped = _entries(n, 1)[6] & _SOFT_DIRTY != 0
        return cleared and flipped
    except OSError:
        return False
    finally:
        page.close()


SOFT_DIRTY = _probe_soft_dirty()
"""Soft-dirty bits work in this process (checked at import)."""

# A page the importing (replica) process wrote: a freshly forked child finds it shared, and
# exclusive once the child writes it (see _cow_works). Never written by the parent again.
_COW_PAGE = _probe_page()
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_parent=_count_fork)


def _cow_works() -> bool:
    """In a child forked after import: does a first write turn a shared page exclusive here?"""
    if _COW_PAGE is None:
        return False
    try:
        n = _page_of(_address(_COW_PAGE))
        before = _entries(n, 1)[7]
        if not before & _PRESENT or before & _EXCLUSIVE:
            return False  # not shared with a parent: this process was not just forked
        _COW_PAGE[0] = (_COW_PAGE[0] + 1) % 256
        return bool(_entries(n, 1)[7] & _EXCLUSIVE)
    except OSError:
        return False


def _same_exe_children() -> bool:
    """Whether a live child process still runs this interpreter (it may share our pages)."""
    try:
        exe = os.readlink("/proc/self/exe")
        pids = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += f.read().split()
    except OSError:
        return True  # cannot tell: assume the worst
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                return True
        except OSError:
            continue  # gone, or a zombie: holds no memory
    return False


# --- what is tracked -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    key: tuple  # changes whenever the pickle could change other than through the bytes
    lo: int  # first byte of the memory the pickle reads
    hi: int  # one past the last


def _layout(value, threshold: int) -> _Layout | None:
    """The tracked layout of ``value``, or None if it is not a trackable large buffer."""
    kind = type(value)
    if kind is bytearray:
        n = len(value)
        if n < threshold:
            return None
        addr = _address(value)
        return _Layout(("bytearray", id(value), addr, n), addr, addr + n)
    np = sys.modules.get("numpy")
    if np is not None and kind is np.ndarray:
        if value.nbytes < threshold or value.dtype.hasobject:
            return None
        addr, lo, hi = value.ctypes.data, 0, value.itemsize
        for n, stride in zip(value.shape, value.strides, strict=False):
            if stride < 0:
                lo += stride * (n - 1)
            else:
                hi += stride * (n - 1)
        return _Layout(("ndarray", id(value), addr, value.shape, value.strides, value.dtype),
                       addr + lo, addr + hi)
    torch = sys.modules.get("torch")  # never imported here: only values of a loaded torch
    if torch is not None and kind is torch.Tensor:
        return _tensor_layout(value, threshold)
    return None


def _tensor_layout(t, threshold: int) -> _Layout | None:
    try:
        if (t.device.type != "cpu" or t.layout is not _torch_strided() or t.is_quantized
                or t.is_sparse or t.is_nested or t.__dict__ or t.grad_fn is not None):
            return None
        storage = t.untyped_storage()
        addr, n = storage.data_ptr(), storage.nbytes()
        if n < threshold or not addr:
            return None
        key = ("tensor", id(t), addr, n, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
               t._version, t.requires_grad, t.is_conj(), t.is_neg())
        return _Layout(key, addr, addr + n)
    except Exception:
        return None


def _torch_strided():
    return sys.modules["torch"].strided


# --- mappings -------------------------------------------------------------------------------------
class _Maps:
    """/proc/self/maps as sorted ranges, each marked private-anonymous or not."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ranges: list[tuple[int, int, bool]] = []
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode("utf-8", "replace")  # at once: reading /proc by lines is slow
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) >= 5:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5].strip() if len(parts) > 5 else ""
                private_anon = (parts[1][3] == "p" and parts[4] == "0"
                                and (path == "" or path == "[heap]" or path.startswith("[anon:")))
                self.starts.append(start)
                self.ranges.append((start, end, private_anon))

    def private_anonymous(self, lo: int, hi: int) -> bool:
        """Whether [lo, hi) is covered by contiguous private anonymous mappings."""
        i = bisect.bisect_right(self.starts, lo) - 1
        pos = lo
        while pos < hi:
            if i < 0 or i >= len(self.ranges):
                return False
            start, end, ok = self.ranges[i]
            if not ok or not start <= pos < end:
                return False
            pos = end
            i += 1
        return True


# --- the tracker ------------------------------------------------------------------------------------
class Tracker:
    """Armed before a cell over some names; afterwards says which of their values are unchanged."""

    def __init__(self, soft_dirty: bool, cow: bool,
                 snapshots: dict[str, tuple[_Layout, tuple[bytes, bytes]]]) -> None:
        self.soft_dirty = soft_dirty
        self.cow = cow
        self.snapshots = snapshots  # name -> (layout, bytes on its first and last page) when armed
        self.forks = _forks  # Python-level forks so far in this process
        self._maps: _Maps | None = None
        self._cow_void: bool | None = None

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m, on in (("soft-dirty", self.soft_dirty), ("cow", self.cow)) if on)

    @classmethod
    def arm(cls, ns: dict, names, *, forked: bool, threshold: int = THRESHOLD,
            soft_dirty: bool | None = None) -> Tracker | None:
        """Start tracking ``names`` of ``ns`` (their current contents must be what the group has).

        ``forked``: this process was forked from the replica just now, before the cell; the
        copy-on-write signal is then used when it works. Returns None when no signal works here
        (the caller pickles as before)."""
        sd = SOFT_DIRTY if soft_dirty is None else soft_dirty
        cow = forked and _cow_works()
        if not (sd or cow):
            return None
        if sd:
            try:
                clear_soft_dirty()  # first: a write after this is seen, the snapshot below only reads
            except OSError:
                sd = False
                if not cow:
                    return None
        snaps = {}
        for name in names:
            value = ns.get(name)
            layout = _layout(value, threshold) if value is not None else None
            if layout is not None:
                snaps[name] = (layout, _edges(layout.lo, layout.hi))
        return cls(sd, cow, snaps)

    def __len__(self) -> int:
        return len(self.snapshots)

    def unchanged(self, name: str, value) -> bool:
        """True only if ``value`` is the tracked object of ``name`` and no byte of it was written."""
        if name not in self.snapshots:
            return False
        snap, edges = self.snapshots[name]
        try:
            now = _layout(value, 0)
            if now is None or now.key != snap.key:
                return False
            if self.cow and self._cow_voided():
                return False
            if self._maps is None:
                self._maps = _Maps()
            if not self._maps.private_anonymous(snap.lo, snap.hi):
                return False
            first, last = self._clean(snap.lo, snap.hi)
            if first is None:
                return False
            # A page the buffer shares with other data (malloc's headers, neighbours on the heap)
            # may be written for them: there, compare the buffer's own bytes instead.
            return (first or _edges(snap.lo, snap.hi)[0] == edges[0]) and (
                last or _edges(snap.lo, snap.hi)[1] == edges[1])
        except OSError as exc:
            log.debug("dirty tracking of %r failed: %s", name, exc)
            return False

    def _cow_voided(self) -> bool:
        if self._cow_void is None:
            self._cow_void = _forks != self.forks or _same_exe_children()
        return self._cow_void

    def _clean(self, lo: int, hi: int) -> tuple[bool | None, bool]:
        """(first page clean, last page clean); (None, False) when a page between them is not."""
        first, last = _page_of(lo), _page_of(hi - 1)
        keep = _RESIDENT_SHARED if self.cow else _RESIDENT
        first_clean = last_clean = True
        fd = os.open(PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for page in range(first, last + 1, _READ_PAGES):
                n = min(_READ_PAGES, last + 1 - page)
                data = _entries(page, n, fd)
                start = 1 if page == first else 0  # the two end pages are judged apart
                stop = n - 1 if page + n - 1 == last else n
                if start < stop and _any_bad(data[start * 8:stop * 8], keep, self.soft_dirty):
                    return None, False
                if page == first:
                    first_clean = not _any_bad(data[:8], keep, self.soft_dirty)
                if page + n - 1 == last:
                    last_clean = not _any_bad(data[-8:], keep, self.soft_dirty)
        finally:
            os.close(fd)
        return first_clean, last_clean


def _any_bad(entries: bytes, keep: bytes, soft_dirty: bool) -> bool:
    """Whether any of these pagemap entries is a page not resident, or written (armed signals)."""
    if entries[7::8].translate(None, keep):
        return True
    return soft_dirty and bool(entries[6::8].translate(None, _CLEAN_SD))


def _edges(lo: int, hi: int) -> tuple[bytes, bytes]:
    """The bytes of [lo, hi) on its first page and on its last page."""
    first_end = min(hi, (_page_of(lo) + 1) * PAGE)
    last_start = max(lo, _page_of(hi - 1) * PAGE)
    return ctypes.string_at(lo, first_end - lo), ctypes.string_at(last_start, hi - last_start)
