"""A replica's blob store: the large values named in its kernel's Raft log, by content digest
(:mod:`gpuhub.replication.digest`), in memory.

**Copies.** The store keeps the caller's buffer, never a copy; values received from peers land in
buffers the store owns, allocated once per value (:meth:`BlobStore.alloc`). Fresh memory is a big
cost: faulting in a new 1 GiB buffer took ~0.8 s on the dev VM (its host takes freed pages back),
so ``BlobStore(spare_bytes=…)`` can keep the buffers of dropped values for the next value of about
that size (4.2 → 2.3 CPU-seconds for a 1 GiB push to two peers, bench/blob_bench.py).

**Files.** ``BlobStore(file_backed=True)`` (CPU kernels' replicas) receives values of
:data:`FILE_MIN` or more into a memfd, so that a value can be built on the received pages with
private, copy-on-write mappings (:meth:`BlobStore.map_private`, gpuhub/kernel/replica.py): the
stored bytes stay as received even when the value is written. Such files are never reused.

**Huge pages.** A new buffer of 2 MiB or more asks for 2 MiB pages (``MADV_HUGEPAGE``) before a
byte lands in it: filling a new GiB took 0.5–1.3 s in 4 KiB pages on the dev VM and 0.12–0.2 s in
2 MiB ones, and a copy-on-write mapping of a memfd maps 512 times fewer entries. Anonymous buffers
(:func:`new_buffer`: a mapping of their own, not a ``bytearray``, which malloc fills with zeros
page by page before anyone could ask) get them where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``; memfds where
``.../shmem_enabled`` is ``advise`` (or ``always``/``within_size``), which the agent's role sets on
GPU nodes. Under ``never`` the advice changes nothing.

**Forks.** ``BlobStore(keep_from_forks=True)`` (CPU kernels' replicas, whose cells run in the
replica process) marks its large buffers ``MADV_DONTFORK``: a process forked from the replica
neither shares nor copies them. The page tracker's sentinel child (gpuhub/kernel/dirty.py) would
otherwise hold every page of the store, so that each copy into a reused buffer paid a
copy-on-write fault per page (~0.6 s per GiB on the dev VM) and each fork copied the store's page
tables. Nothing outside the replica process reads the store's buffers. GPU kernels' stores are
not marked yet: their cell's child (forked per cell) reads only which digests the store has, so it
could skip them too, for a cheaper fork; not measured.

**Filling a buffer.** :func:`copy_into` copies bytes into a store's buffer (the executor's copy of
a live value, a follower's private copy of a blob it cannot map) without holding the GIL for the
whole copy, so that the replica's Raft thread keeps running meanwhile.

Caller contract: values handed to :meth:`BlobStore.put` (and to the blob client's ``push``) must
not be mutated afterwards (the store keeps a reference, not a copy).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref

__all__ = ["FILE_MIN", "BlobStore", "adoptable", "copy_into", "new_buffer", "reusable"]

FILE_MIN = 1 << 20
"""``BlobStore(file_backed=True)`` receives values of at least this size into a memfd."""
HUGE_PAGE = 2 << 20
"""A new buffer of at least this size asks for 2 MiB pages (see "Huge pages")."""
COPY_STEP = 64 << 20  # copy_into copies in steps, so another thread may take the GIL between them
KEEP_FROM_FORKS_MIN = 32 << 20
# glibc's malloc gives an allocation this large a mapping of its own, unmapped when it is freed
# (its mmap threshold cannot be set higher), so marking its pages ends with it
log = logging.getLogger("gpuhub.blobstore")


def _keep_from_forks(buf: bytearray | AnonBuffer | _FileBuffer) -> None:
    """MADV_DONTFORK on the whole pages of a large buffer of the store (see "Forks" above)."""
    if isinstance(buf, mmap.mmap):
        buf.madvise(mmap.MADV_DONTFORK)  # a mapping of its own
        return
    if len(buf) < KEEP_FROM_FORKS_MIN:
        return
    addr = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
    lo, hi = -(-addr // mmap.PAGESIZE) * mmap.PAGESIZE, (addr + len(buf)) // mmap.PAGESIZE * mmap.PAGESIZE
    if _in_heap(lo):
        return  # malloc fell back to the brk heap: its pages may serve other objects once freed
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(lo, hi - lo, mmap.MADV_DONTFORK) != 0:
        log.debug("MADV_DONTFORK on %d bytes failed: errno %d", hi - lo, ctypes.get_errno())


def _in_heap(addr: int) -> bool:
    """Whether ``addr`` lies in the process's brk heap (``[heap]`` in /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as f:
        for line in f.read().splitlines():
            if line.endswith(b"[heap]"):
                start, end = (int(x, 16) for x in line.split(maxsplit=1)[0].split(b"-"))
                if start <= addr < end:
                    return True
    return False


def copy_into(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` for byte views, in GIL-free steps where numpy is importable (numpy's
    copy releases the GIL; a memoryview slice assignment would hold it for the whole copy)."""
    try:
        import numpy as np
    except ImportError:
        dest[:] = src
        return
    d = np.frombuffer(dest, dtype=np.uint8)
    s = np.frombuffer(src, dtype=np.uint8)
    if len(d) != len(s):
        raise ValueError(f"copy of {len(s)} bytes into {len(d)}")
    for i in range(0, len(s), COPY_STEP):
        np.copyto(d[i:i + COPY_STEP], s[i:i + COPY_STEP])


class AnonBuffer(mmap.mmap):
    """Private anonymous memory in a mapping of its own, asking for 2 MiB pages (see "Huge pages")."""

    @classmethod
    def create(cls, n: int) -> AnonBuffer:
        buf = cls(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _ask_for_huge_pages(buf)
        return buf


def _ask_for_huge_pages(buf: mmap.mmap) -> None:
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a Linux built without transparent huge pages: 4 KiB pages, slower, not wrong
        pass


def new_buffer(n: int) -> bytearray | AnonBuffer:
    """A new writable buffer of ``n`` zero bytes to fill: one asking for 2 MiB pages from 2 MiB on."""
    return AnonBuffer.create(n) if n >= HUGE_PAGE else bytearray(n)


def reusable(buf: object) -> bool:
    """Whether ``buf`` is a buffer :meth:`BlobStore.alloc` gives that may become a spare (not a
    memfd's, see "Files")."""
    return type(buf) in (bytearray, AnonBuffer)


def adoptable(buf: object) -> bool:
    """Whether :meth:`BlobStore.adopt` may keep ``buf`` itself: a buffer of a kind
    :meth:`BlobStore.alloc` gives (a memfd's then loads copy-on-write, :meth:`BlobStore.map_private`)."""
    return reusable(buf) or type(buf) is _FileBuffer


class _FileBuffer(mmap.mmap):
    """A shared, writable mapping of a memfd of its own; ``fd`` stays open while it lives, so
    that parts of it can be mapped again privately (:meth:`BlobStore.map_private`)."""

    fd: int

    @classmethod
    def create(cls, n: int) -> _FileBuffer:
        fd = os.memfd_create("gpuhub-blob", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, n)
            buf = cls(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if n >= HUGE_PAGE:
                _ask_for_huge_pages(buf)
        except BaseException:
            os.close(fd)
            raise
        buf.fd = fd
        weakref.finalize(buf, os.close, fd)
        return buf


class BlobStore:
    """Thread-safe in-memory map ``digest -> bytes-like``.

    :meth:`put` keeps a reference to the caller's object (no copy). Values received from peers
    live in buffers the store owns (:meth:`alloc`, :meth:`adopt`); :meth:`get` hands those out as
    read-only memoryviews. With ``spare_bytes`` > 0, :meth:`retain` keeps up to that many bytes of
    dropped owned buffers — only those nothing else references any more — and :meth:`alloc`
    reuses them for the next value of about the same size: a changed 1 GB variable then lands in
    memory that is already mapped, instead of page-faulting a fresh gigabyte (0.2 s/GiB on bare
    metal, about 0.8 s/GiB in a VM that hands freed memory back to its host). The price is that
    much extra resident memory per replica, so it is off by default.

    With ``file_backed``, :meth:`alloc` puts values of at least :data:`FILE_MIN` bytes in a memfd
    (an anonymous in-memory file) mapped shared, and :meth:`map_private` maps a page-aligned part
    of a stored one copy-on-write: the mapping shares the stored pages until someone writes to
    it, then that page becomes private, so the stored bytes never change. Such buffers are never
    kept as spares (a private mapping of a reused file would see the new value's bytes).
    """

    def __init__(self, spare_bytes: int = 0, *, file_backed: bool = False, keep_from_forks: bool = False) -> None:
        self.spare_bytes = spare_bytes
        self.file_backed = file_backed
        self.keep_from_forks = keep_from_forks
        self._blobs: dict[str, bytes | bytearray | memoryview] = {}
        self._owned: dict[str, int] = {}  # digest -> length, for buffers from alloc()
        self._spares: list[bytearray | AnonBuffer] = []
        self._nbytes = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._incoming: dict[str, int] = {}  # digest -> PUTs of it being received now

    def put(self, d: str, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` under ``d`` (the caller vouches that ``d == digest(data)`` and will not
        mutate it)."""
        size = memoryview(data).nbytes
        with self._lock:
            if d not in self._blobs:
                self._blobs[d] = data
                self._nbytes += size

    def alloc(self, n: int, *, anonymous: bool = False) -> bytearray | AnonBuffer | _FileBuffer:
        """A buffer of at least ``n`` bytes to receive a value into, then :meth:`adopt` or
        :meth:`recycle`: a spare when one fits within n + n/4; in a file-backed store, a new memfd
        for a value of :data:`FILE_MIN` or more, unless ``anonymous`` (for a value this process
        writes itself, that it never maps copy-on-write). Raises MemoryError."""
        to_file = self.file_backed and n >= FILE_MIN and not anonymous
        if not to_file:
            with self._lock:
                fits = [b for b in self._spares if n <= len(b) <= n + n // 4]
                if fits:
                    buf = min(fits, key=len)
                    self._spares = [b for b in self._spares if b is not buf]
                    return buf  # marked when it was first allocated
            try:
                buf = new_buffer(n)
            except OSError as e:  # mmap: ENOMEM
                raise MemoryError(f"no memory for {n} bytes: {e}") from None
        else:
            try:
                buf = _FileBuffer.create(n)
            except OSError as e:
                raise MemoryError(f"no memfd for {n} bytes: {e}") from None
        if self.keep_from_forks:
            _keep_from_forks(buf)
        return buf

    def adopt(self, d: str, buf: bytearray | AnonBuffer | _FileBuffer, n: int) -> None:
        """Keep the first ``n`` bytes of ``buf`` (from :meth:`alloc`) under ``d``."""
        with self._lock:
            if d not in self._blobs:
                self._blobs[d], self._owned[d] = buf, n
                self._nbytes += n
                return
        self.recycle(buf)  # someone stored the same value meanwhile

    def recycle(self, buf: bytearray | AnonBuffer | _FileBuffer) -> None:
        """Give back a buffer from :meth:`alloc` that was not adopted."""
        with self._lock:
            self._spare(buf, 4)  # the caller's variable, ours, _spare's, getrefcount's

    def _spare(self, buf: bytearray | AnonBuffer | _FileBuffer, refs: int) -> None:
        # ``refs``: the references the caller's frames hold; more means a view is still alive
        if (reusable(buf) and sys.getrefcount(buf) <= refs
                and sum(map(len, self._spares)) + len(buf) <= self.spare_bytes):
            self._spares.append(buf)

    def get(self, d: str) -> bytes | bytearray | memoryview | None:
        with self._lock:
            data = self._blobs.get(d)
            n = self._owned.get(d)
            if n is None:
                return data
            return memoryview(data)[:n].toreadonly()  # made under the lock: see _spare

    def map_private(self, d: str, offset: int, length: int) -> mmap.mmap | None:
        """A writable copy-on-write mapping of ``length`` bytes at ``offset`` (a multiple of the
        page size) of the stored value ``d``, or None when that value is not file-backed."""
        with self._lock:  # under the lock: retain() may drop the file meanwhile
            buf = self._blobs.get(d)
            if type(buf) is not _FileBuffer or offset + length > self._owned[d]:
                return None
            return mmap.mmap(buf.fd, length, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    # --- values on their way in (a peer's PUT) -----------------------------------------------
    def incoming(self, d: str) -> None:
        """A value with digest ``d`` is being received now; pair with :meth:`received`."""
        with self._lock:
            self._incoming[d] = self._incoming.get(d, 0) + 1

    def received(self, d: str) -> None:
        """The receive announced by :meth:`incoming` ended (stored or not)."""
        with self._lock:
            left = self._incoming.pop(d, 1) - 1
            if left > 0:
                self._incoming[d] = left
            self._arrived.notify_all()

    def wait_incoming(self, d: str, timeout: float) -> bool:
        """Wait while ``d`` is being received (an executor returns once a majority has its new
        values, so the last peer may still be receiving one when it must load it: waiting costs
        less than fetching it a second time). True when ``d`` is stored now."""
        with self._lock:
            self._arrived.wait_for(lambda: d in self._blobs or d not in self._incoming, timeout)
            return d in self._blobs

    def has(self, d: str) -> bool:
        with self._lock:
            return d in self._blobs

    __contains__ = has

    def retain(self, keep: set[str]) -> None:
        """Drop every blob whose digest is not in ``keep``."""
        with self._lock:
            self._drop([d for d in self._blobs if d not in keep])

    def discard(self, gone: set[str]) -> None:
        """Drop exactly these blobs (others, e.g. ones that arrived meanwhile, stay)."""
        with self._lock:
            self._drop([d for d in gone if d in self._blobs])

    def _drop(self, digests: list[str]) -> None:
        """Call with the lock held."""
        for d in digests:
            data = self._blobs.pop(d)
            n = self._owned.pop(d, None)
            if n is None:
                self._nbytes -= memoryview(data).nbytes
            else:
                self._nbytes -= n
                self._spare(data, 3)  # our variable, _spare's, getrefcount's
            del data

    def digests(self) -> set[str]:
        with self._lock:
            return set(self._blobs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blobs)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored values (spares not counted)."""
        with self._lock:
            return self._nbytes

    @property
    def spare_nbytes(self) -> int:
        with self._lock:
            return sum(map(len, self._spares))
