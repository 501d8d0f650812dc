"""Which large buffers did a cell write? Linux page bits instead of hashing (docs/architecture.md D4).

After every cell the executor captures the namespace as one image (gpuhub/kernel/image.py): one
pickle (protocol 5), every large buffer out of band and named by its content digest; the pickler
finds buffers anywhere inside values (arrays in dicts, DataFrame blocks, module parameters). A
buffer the group already has is neither copied nor sent, but knowing that its bytes are still
those of a known digest means hashing them: a pass over every large buffer of the namespace, every
cell. This module answers the same question from the kernel's page tables, in milliseconds, for
address ranges: :class:`BufferTracker`.

Signals, both read from ``/proc/self/pagemap`` (one 64-bit entry per page, flags readable
without privileges):

- **soft-dirty** (bit 55): writing ``4`` to ``/proc/self/clear_refs`` clears it on every page of
  the process; the kernel sets it again on the first write to a page. Needs a kernel built with
  ``CONFIG_MEM_SOFT_DIRTY``; :data:`SOFT_DIRTY` says whether it works here, probed once at import
  (``clear_refs`` writable *and* the bit seen to clear and to flip back on a write).
- **userfaultfd write-protection** (bit 57, Linux 6.7+, gpuhub/kernel/uffd.py): the tracker
  write-protects the ranges' pages through a userfaultfd in asynchronous mode; the first write to
  a page clears its bit, with no fork, no copy and no event to read.
- **copy-on-write** (bit 56, "exclusively mapped"): in a process forked just now (a GPU cell's
  child, or the kernel's sentinel, rule 1), every private page is shared between the two
  processes; the first write to a page copies it, and only then is the page mapped by the writer
  alone. Checked before use (:func:`_cow_works`), on a page the importing process wrote before
  forking.

``BufferTracker.arm(known, mode=)`` takes (address, nbytes, digest) of buffers whose digest is
known now (the buffers of the last image that this process holds, ``image.track``); afterwards
``digest_if_unchanged(address, nbytes)`` returns that digest only when the *same range* was armed
and **all** of the rules below hold; anything else answers None, and the caller hashes (a false
None costs time, a false digest silently loses data). No object identity or layout is involved,
only whether these bytes changed: shape, dtype and the rest travel in the pickle stream.

1. *Signals by mode.* In both, userfaultfd write-protection where it works
   (:func:`gpuhub.kernel.uffd.write_protect`; a range it cannot register is not tracked), and
   then no other signal. Else, ``"forked-child"`` (the GPU cell's child, forked from its replica
   just before the cell): copy-on-write, plus soft-dirty where it works (OR-ed in).
   ``"in-process"`` (the long-lived kernel): soft-dirty where it works; else a **sentinel**, a
   dormant child forked at arm
   (:class:`_Sentinel`): while it lives, every private anonymous page of the kernel is shared
   with it, so a page the kernel writes afterwards is copied and exclusive.
   The child runs no code of ours but system calls (it closes every other descriptor and blocks
   reading a pipe, all signals blocked, then ``os._exit``): the kernel is multi-threaded and a
   lock another thread held at the fork stays held in the child. ``os.fork`` itself still runs
   CPython's after-fork reinitialisation and the registered ``after_in_child`` hooks (threading,
   logging, random, ours) in the child, as every fork from the kernel does; should one of them
   hang, the child still ends, killed by :meth:`_Sentinel.end`. It ends at the next arm or at
   :meth:`BufferTracker.close` (killed through a pidfd and reaped), or when the kernel dies (end of
   file on the pipe). Without a signal (in-process with ``sentinel=False``, or a forked-child
   mode in a process that was not just forked, and no soft-dirty) anonymous memory is not tracked.
   Soft-dirty and write-protection bits are not touched by forks (a write to a page shared with a
   child clears the write-protect bit, or sets soft-dirty, before it copies the page): rule 4 is
   for copy-on-write only.
2. *Private memory only.* The range lies in private anonymous mappings (readable), or in one
   private mapping of a blob store file (rule 7), and is in the same kind of mapping when asked
   (``/proc/self/maps``). A shared mapping can be written by another process, or through another
   mapping, without touching our bits: never tracked.
3. *No interior page written.* Pages wholly inside the range must have no set bit among the armed
   signals (soft-dirty on a present page; the exclusive bit in copy-on-write mode; the
   write-protect bit *cleared*, under userfaultfd) and be present, or not present when armed
   (they read as zeros then) and either still absent or present and still all zeros, whatever
   their bits say. A swapped-out page is not trusted, at arm (the range is not tracked) or after
   (no answer): its content is not known without reading it back, and a swap entry never has the
   exclusive bit (a page written and then swapped out would read as unwritten). Under userfaultfd
   it is: protecting sets the bit on swap entries (and leaves a marker with the bit on empty
   ones), a write needs the page back in and clears it, so an entry that still has the bit, present
   or not, was not written since; the pages known to be zeros are those whose entries were empty
   just before protecting (after, an empty one and one whose data is in swap or being migrated
   look alike). Where ``mremap`` keeps the bit (rule 5), only present pages pass (a buffer with
   pages never touched, or swapped out when armed, is then hashed). The partial first
   and last page, which the range may share with other data (malloc's headers, heap neighbours,
   written for them), are judged by the range's own bytes on them instead, compared with a copy
   taken at arm, whatever the bits say. The copy is taken before the signals start (the
   sentinel's fork, clearing soft-dirty): a write after that moment cannot land in it unseen.
4. *Forks (copy-on-write only).* A page written *before* a fork is shared again with the new
   process while it lives, so the bit would hide the write. Python-level forks since arm are
   counted (``os.register_at_fork``); a live child process running this interpreter that was not
   there at arm also voids the answer. The sentinel, and any child already alive at arm (it was
   forked before, so shares no page written since), do not. A process forked from C code that is
   no longer our child (a daemon's double fork) would still escape this check; soft-dirty, when
   the kernel has it, is OR-ed in and is immune to it.
5. *Every interior page must still be the armed page.* A page present and not seen written may
   still be another page than the armed one: the zero page (``MADV_DONTNEED`` or a new mapping at
   the same place, then a read: neither bit is set by a read fault) or a page that ``mremap`` moved
   here with its copy-on-write state. So the first 8 bytes of every page are kept at arm (8 bytes
   per 4 KiB), and for a page whose first word was zero, a non-zero word and its value (or that
   the page was all zeros): they must read the same. For the zero page (4 KiB, or the huge zero
   page, which reads as a file page) this is a proof; for a page moved by ``mremap`` it is not (a
   moved page of the same first word, or non-zero word, passes), a residual risk of copy-on-write
   only (soft-dirty marks moved pages written). Under userfaultfd neither passes the bits: a
   dropped page leaves no bit behind, so the zero page read there has none (only a page that was
   empty when armed, all zeros then too, reads back with it), and a moved page has none where the
   kernel clears it on ``mremap`` (Linux 6.13+, probed): there the words are not read. A realloc
   that moves a buffer grows it, and the grown part is new pages (and another range: ``nbytes``
   differs).
6. *KSM.* A page merged by KSM is shared (bit 56 clear) and may be the zero page, whatever was
   written to it: no answer for anonymous memory while KSM holds merged pages of this process
   (``/proc/self/ksm_stat``; where the kernel does not say, of any process).
7. *Private mappings of blob store files* (followers map large values copy-on-write from a memfd,
   ``BlobStore.map_private``). A page still backed by the file (bit 61 set) was never written
   since the mapping; a written page becomes anonymous (bit 61 clear). The store writes such a
   file once, before storing it, and never reuses it (gpuhub/replication/blobstore.py), so a page
   that is **not present** reads the file too: it is as safe as a file page (a written page that
   ``MADV_DONTNEED`` dropped reads the file again: still the file's bytes). So a range in one
   private mapping of a file named :data:`BLOB_FILE` whose pages were all file pages or absent
   when armed held the file's bytes then, and holds them still when they still are, provided the
   same file is mapped at the same offset (device, inode and address minus offset, from
   ``/proc/self/maps``, must be the same). Needs no signal, no sentinel and no soft-dirty; a range
   with a page written before arming is not tracked. (User code that names its own memfd
   ``gpuhub-blob`` and writes it through another mapping defeats this rule.)
8. *One tracker at a time.* Every arm voids the trackers armed before it in the process (clearing
   soft-dirty bits, or a new sentinel, would hide their writes), and so does :meth:`close`.

Writes by devices (DMA into pinned pages) set no bit: pinning for write breaks copy-on-write
(so the page is exclusive, i.e. "written"), and CUDA's own pinned allocations are shared device
mappings, which rule 2 excludes. A page pinned for write *before* soft-dirty bits were cleared or
write-protection set, and written by a device after, would escape those two signals: where they
are the only signal, anonymous memory gets no answer while the process holds pinned pages
(``VmPin``, at arm or when asked). Pins that Linux does not count there remain a residual risk:
an ``O_DIRECT`` read in flight across the arming, memory registered with CUDA
(``cudaHostRegister``) or VFIO in a process that keeps it between cells.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from gpuhub.kernel import uffd

log = logging.getLogger("gpuhub.dirty")

PAGE = mmap.PAGESIZE
PAGEMAP = "/proc/self/pagemap"
CLEAR_REFS = "/proc/self/clear_refs"

# Byte 6 of a little-endian pagemap entry holds bit 55, byte 7 bits 56..63.
_SOFT_DIRTY = 0x80  # bit 55, in byte 6
_EXCLUSIVE = 0x01  # bit 56, in byte 7
_UFFD_WP = 0x02  # bit 57, in byte 7: still write-protected, i.e. not written since (uffd.py)
_FILE = 0x20  # bit 61, in byte 7: a page of a file (page cache) or shared anonymous memory
_SWAPPED = 0x40  # bit 62, in byte 7
_PRESENT = 0x80  # bit 63, in byte 7

# For bytes.translate(None, delete): the byte values that are fine; whatever is left is not.
_CLEAN_SD = bytes(b for b in range(256) if not b & _SOFT_DIRTY)


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

# A page the importing (replica) process wrote: right after a fork it is shared by the two processes,
# and exclusive in the one that writes it first (see _cow_works).
_COW_PAGE = _probe_page()
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_parent=_count_fork)


def _cow_works() -> bool:
    """Just after a fork (in a GPU cell's child, or in the kernel after forking its sentinel): does a
    first write turn a shared page exclusive here?"""
    if _COW_PAGE is None:
        return False
    try:
        n = _page_of(_address(_COW_PAGE))
        before = _entries(n, 1)[7]
        if not before & _PRESENT or before & _EXCLUSIVE:
            return False  # not shared: no fork just now
        _COW_PAGE[0] = (_COW_PAGE[0] + 1) % 256
        return bool(_entries(n, 1)[7] & _EXCLUSIVE)
    except OSError:
        return False


def _exe_children() -> set[tuple[int, str]] | None:
    """The live children that still run this interpreter, as (pid, start time); None: cannot tell."""
    try:
        exe = os.readlink("/proc/self/exe")
        pids = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += f.read().split()
    except OSError:
        return None
    found = set()
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                with open(f"/proc/{pid}/stat") as f:
                    found.add((int(pid), f.read().rsplit(")", 1)[-1].split()[19]))  # field 22
        except (OSError, IndexError):
            continue  # gone, or a zombie: holds no memory
    return found


def _pinned() -> bool:
    """Whether this process holds pages pinned for a device (``VmPin``: RDMA memory regions,
    io_uring fixed buffers): a device writes them without a fault, so no write-protect or
    soft-dirty bit shows it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmPin:"):
                    return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        return True
    return False


def _ksm_merged() -> bool:
    """Whether KSM may hold merged pages of this process (a merged page is shared, a zero-filled one
    may be the zero page: neither reads as written). Per process where the kernel says (6.10+: both
    counts in /proc/self/ksm_stat), else system-wide; no KSM in the kernel: False."""
    try:
        with open("/proc/self/ksm_stat") as f:
            stat = dict(line.split(maxsplit=1) for line in f.read().splitlines() if " " in line)
        if "ksm_merging_pages" in stat and "ksm_zero_pages" in stat:
            return int(stat["ksm_merging_pages"]) != 0 or int(stat["ksm_zero_pages"]) != 0
    except (OSError, ValueError):
        pass
    counts = ("pages_shared", "pages_sharing", "ksm_zero_pages", "zero_pages_sharing")
    if not os.path.isdir("/sys/kernel/mm/ksm"):
        return False
    try:
        total = 0
        for name in counts:
            try:
                with open(f"/sys/kernel/mm/ksm/{name}") as f:
                    total += int(f.read())
            except FileNotFoundError:
                continue
        return total != 0
    except (OSError, ValueError):
        return True


# --- mappings -------------------------------------------------------------------------------------
BLOB_FILE = "/memfd:gpuhub-blob"
"""How /proc/self/maps names the blob store's memfds (gpuhub/replication/blobstore.py, ``_FileBuffer``):
files written once, before they are stored, and never again (rule 7 of the module docstring)."""
_ANON = "anon"
_last_maps: _Maps | None = None


class _Maps:
    """/proc/self/maps as sorted ranges, each with its kind for :class:`BufferTracker`: ``"anon"``
    (readable, private, anonymous), ``("file", dev, inode, start - offset)`` (readable private
    mapping of a blob store file: the key names the file and where it is mapped) or None (anything
    else: shared, another file, unreadable)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts: list[int] = []
        self.ranges: list[tuple[int, int]] = []
        self.kinds: list[object] = []
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) >= 5:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5].strip() if len(parts) > 5 else ""
                perms = parts[1]
                private_anon = (perms[3] == "p" and parts[4] == "0"
                                and (path == "" or path == "[heap]" or path.startswith("[anon:")))
                kind = None
                if perms[0] == "r" and perms[3] == "p":
                    if private_anon:
                        kind = _ANON
                    elif path.removesuffix(" (deleted)") == BLOB_FILE:
                        kind = ("file", parts[3], int(parts[4]), start - int(parts[2], 16))
                self.starts.append(start)
                self.ranges.append((start, end))
                self.kinds.append(kind)

    @classmethod
    def now(cls) -> _Maps:
        """/proc/self/maps as it is now; parsed again only when its text changed (a capture asks
        once per buffer, and parsing a few hundred lines costs about a millisecond)."""
        global _last_maps
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode("utf-8", "replace")  # at once: reading /proc by lines is slow
        last = _last_maps
        if last is None or last.text != text:
            last = _last_maps = cls(text)
        return last

    def kind(self, lo: int, hi: int) -> object:
        """The one kind of the mappings that cover [lo, hi) without a gap, or None."""
        i = bisect.bisect_right(self.starts, lo) - 1
        pos, kind = lo, None
        while pos < hi:
            if i < 0 or i >= len(self.ranges):
                return None
            start, end = self.ranges[i]
            if not start <= pos < end or self.kinds[i] is None or (pos > lo and self.kinds[i] != kind):
                return None
            kind, pos = self.kinds[i], end
            i += 1
        return kind


# --- the tracker ----------------------------------------------------------------------------------
MODES = ("forked-child", "in-process")
_WORDS = PAGE // 8  # 8-byte words per page
_Z8 = bytes(8)

# byte 7 of an entry that is fine for an interior page of a range (rules 3 and 7)
# (bit 61 in anonymous memory: the huge zero page, which rule 5 tells from the armed page)
_OK_ANON = bytes(b for b in range(256) if b & _PRESENT)
_OK_ANON_COW = bytes(b for b in range(256) if b & _PRESENT and not b & _EXCLUSIVE)
# Under write-protection a page not present keeps the bit too: a swap entry, or the marker that
# protecting an empty entry leaves (Linux turns WP_UNPOPULATED on with asynchronous mode).
_OK_ANON_WP = bytes(b for b in range(256) if b & _UFFD_WP and b & (_PRESENT | _SWAPPED))
# Where mremap keeps the bit, a moved entry could pass it: only present pages, whose words rule 5 reads.
_OK_ANON_WP_PRESENT = bytes(b for b in range(256) if b & _UFFD_WP and b & _PRESENT)
_OK_FILE = bytes(b for b in range(256) if b & _FILE or not b & (_PRESENT | _SWAPPED))
_PRESENT_01 = bytes(1 if b & _PRESENT else 0 for b in range(256))  # for bytes.translate
_IN_USE_01 = bytes(1 if b & (_PRESENT | _SWAPPED) else 0 for b in range(256))
_NOT_SWAPPED_01 = bytes(0 if b & _SWAPPED else 1 for b in range(256))
_NOT_SWAPPED = bytes(b for b in range(256) if not b & _SWAPPED)

_generation = 0  # every arm in this process adds one: it voids every tracker armed before
_sentinel: _Sentinel | None = None  # the in-process sentinel, if one lives
_arm_lock = threading.Lock()

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)


def _view(addr: int, n: int) -> memoryview:
    """A read-only memoryview of ``n`` bytes at ``addr`` (no copy)."""
    return _from_memory(addr, n, 0x100)  # PyBUF_READ


def _zero_words(data: bytes) -> list[int]:
    """Indices of the 8-byte words of ``data`` that are zero."""
    out, i = [], data.find(_Z8)
    while i >= 0:
        if i % 8:
            i = data.find(_Z8, i - i % 8 + 8)
            continue
        out.append(i // 8)
        i = data.find(_Z8, i + 8)
    return out


def _first_words(page: int, count: int) -> bytes:
    """The first 8 bytes of each of ``count`` pages from page number ``page``."""
    return _view(page * PAGE, count * PAGE).cast("Q")[::_WORDS].tobytes()


def _witness(page: int) -> int:
    """Index of a non-zero 8-byte word of the page, or -1 when the page is all zeros."""
    rest = _view(page * PAGE, PAGE).tobytes().lstrip(b"\0")
    return (PAGE - len(rest)) // 8 if rest else -1


class _Sentinel:
    """A dormant child forked by an in-process tracker: while it lives, every private page the
    kernel had is shared with it, so a page the kernel writes afterwards is copied and becomes
    exclusive (bit 56). The child blocks reading a pipe and exits when it reads end of file; it
    starts with every signal blocked (a signal for the process group runs no handler of ours in it,
    and writes nothing to the kernel's wakeup fd) and closes every other file descriptor.
    :meth:`end` closes the pipe, kills and reaps it; if the kernel dies, the pipe closes too."""

    def __init__(self) -> None:
        r, w = os.pipe()  # O_CLOEXEC
        try:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            try:
                pid = os.fork()
                if pid == 0:  # the child: system calls only, no lock that another thread may hold
                    try:
                        os.closerange(0, r)
                        os.closerange(r + 1, _max_fd())
                        os.read(r, 1)
                    finally:
                        os._exit(0)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self.pid, self._w = pid, w
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = None

    def end(self) -> None:
        if self._w < 0:
            return
        os.close(self._w)
        self._w = -1
        pidfd, self._pidfd = self._pidfd, None
        try:
            if pidfd is not None:  # immune to the pid being reaped elsewhere and reused
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
            else:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # reaped by someone else (a SIGCHLD handler)
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _max_fd() -> int:
    try:
        return max(os.sysconf("SC_OPEN_MAX"), 3)
    except (OSError, ValueError):
        return 1 << 16


def in_process_signal() -> str:
    """What an in-process tracker (with ``sentinel`` allowed) uses here: ``"userfaultfd"``,
    ``"soft-dirty"`` or ``"sentinel"``."""
    if uffd.write_protect() is not None:
        return "userfaultfd"
    return "soft-dirty" if SOFT_DIRTY else "sentinel"


def live_sentinel() -> int | None:
    """The pid of this process's sentinel, if one lives (for tests and diagnostics)."""
    s = _sentinel
    return s.pid if s is not None and s._w >= 0 else None


@dataclass(frozen=True)
class _Armed:
    digest: str | None  # None: the range was given twice with different digests
    kind: object  # _ANON, or the file key of _Maps
    page: int  # page number of the first page wholly inside the range
    count: int  # pages wholly inside the range
    edges: tuple[bytes, bytes]  # the range's bytes before and after those pages, when armed
    absent: frozenset[int]  # anon: pages (index from ``page``) not present when armed: zeros
    firsts: bytes  # anon: the first 8 bytes of each page when armed (zeros where absent)
    zero_first: dict[int, tuple[int, int]]  # anon: present pages whose first word was 0 ->
    # (index of a non-zero word, its value) then, or (-1, 0) when the page was all zeros


class BufferTracker:
    """Which buffers (address ranges) still hold the bytes they had when armed, so that their
    content digest is still valid. See the module docstring, rules 1-8."""

    def __init__(self, mode: str, generation: int, armed: dict[tuple[int, int], _Armed],
                 soft_dirty: bool, cow: bool, sentinel: _Sentinel | None, wp: bool = False,
                 exact: bool = False) -> None:
        self.mode = mode
        self.generation = generation
        self.armed = armed
        self.soft_dirty = soft_dirty
        self.cow = cow
        self.wp = wp  # userfaultfd write-protection
        self.exact = exact  # the bits alone prove a page is the armed one (rule 5): no words read
        self.pinned = (wp or soft_dirty) and not cow and _pinned()  # see _pinned
        self.sentinel = sentinel
        self.forks = _forks
        self.children = _exe_children() if cow else None
        self.closed = False

    @classmethod
    def arm(cls, known: Iterable[tuple[int, int, str]], *, mode: str, sentinel: bool = True) -> BufferTracker:
        """Start tracking the buffers ``known``: (address, nbytes, digest of those bytes now).

        ``mode``: ``"forked-child"`` (this process was forked just now, e.g. a GPU cell's child:
        userfaultfd write-protection where it works, else copy-on-write bits) or ``"in-process"``
        (the long-lived kernel: userfaultfd write-protection, else soft-dirty bits, else a sentinel
        child, see :class:`_Sentinel`; with ``sentinel`` False, only soft-dirty). Arming voids
        every tracker armed before in this process (and ends its sentinel). Never raises for a buffer it cannot track:
        :meth:`digest_if_unchanged` then answers None for it."""
        global _generation, _sentinel
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        digests: dict[tuple[int, int], str | None] = {}
        for address, nbytes, d in known:
            key = (int(address), int(nbytes))
            digests[key] = d if digests.get(key, d) == d else None
        with _arm_lock:
            _generation += 1
            generation = _generation
            old, _sentinel = _sentinel, None
            if old is not None:
                old.end()
            maps = _Maps.now()
            kinds = {k: maps.kind(k[0], k[0] + k[1]) if k[1] > 0 else None for k in digests}
            # The partial first and last pages are judged by their bytes (rule 3): copied before
            # the signals start (the fork, clearing soft-dirty), so that no write after that
            # moment can land in the copy and go unseen.
            edges = {k: _edges_of(k[0], k[0] + k[1], *_whole_pages(k[0], k[0] + k[1]))
                     for k, kind in kinds.items() if kind is not None}
            sd = cow = wp = exact = False
            allow_sentinel, sentinel = sentinel, None
            protector = None
            if _ANON in kinds.values() and (mode == "forked-child" or allow_sentinel):
                protector = uffd.write_protect()
            empty: dict[tuple[int, int], set[int]] = {}
            if protector is not None:  # first: a write after this is seen; the rest only reads
                wp, exact = True, protector.mremap_clears
                empty = _empty_pages(kinds)
                _write_protect(protector, kinds)
            elif _ANON in kinds.values():
                sd = SOFT_DIRTY
                if sd:
                    try:
                        clear_soft_dirty()  # first, as above
                    except OSError:
                        sd = False
                if mode == "forked-child":
                    cow = _cow_works()
                elif not sd and allow_sentinel:
                    try:
                        sentinel = _sentinel = _Sentinel()
                    except OSError as exc:
                        log.debug("no sentinel: %s", exc)
                    cow = sentinel is not None and _cow_works()
            armed = {}
            fd = os.open(PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for key, d in digests.items():
                    kind = kinds[key]
                    if kind is None or (kind is _ANON and not (sd or cow or wp)):
                        continue
                    a = _snapshot(key[0], key[0] + key[1], d, kind, fd, edges[key], words=not exact,
                                  empty=empty.get(key))
                    if a is not None:
                        armed[key] = a
            finally:
                os.close(fd)
            return cls(mode, generation, armed, sd, cow, sentinel, wp, exact)

    def __len__(self) -> int:
        return len(self.armed)

    def __enter__(self) -> BufferTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def digest_if_unchanged(self, address: int, nbytes: int) -> str | None:
        """The digest given at arm for exactly this range, when its bytes provably did not change
        since; None when that is not known (the caller hashes the bytes)."""
        a = self.armed.get((address, nbytes))
        if a is None or a.digest is None or self.closed or self.generation != _generation:
            return None
        try:
            if _Maps.now().kind(address, address + nbytes) != a.kind:
                return None  # unmapped, mapped again (another file, or shared), made unreadable
            if a.kind is _ANON:
                if self.cow and self._forked():
                    return None
                if (self.wp or self.soft_dirty) and not self.cow and (self.pinned or _pinned()):
                    return None
                if not self._anon_clean(a) or _ksm_merged():
                    return None
            elif not _file_clean(a):
                return None
            if _edges_of(address, address + nbytes, a.page, a.count) != a.edges:
                return None
        except OSError as exc:
            log.debug("dirty tracking of %#x+%d failed: %s", address, nbytes, exc)
            return None
        return a.digest

    def close(self) -> None:
        """End this tracker (and its sentinel, if it still lives); it answers None from now on."""
        global _sentinel
        self.closed = True
        with _arm_lock:
            if self.sentinel is not None:
                if _sentinel is self.sentinel:
                    _sentinel = None
                self.sentinel.end()

    def _forked(self) -> bool:
        """Whether the copy-on-write answer is void: this process forked since arm (in Python), or a
        live child running this interpreter was not there when armed (the sentinel was)."""
        if _forks != self.forks:
            return True
        now = _exe_children()
        return now is None or self.children is None or not now <= self.children

    def _anon_clean(self, a: _Armed) -> bool:
        if not a.count:
            return True
        entries = _entries(a.page, a.count)
        flags = entries[7::8]
        ok = (_OK_ANON_COW if self.cow else _OK_ANON_WP if self.exact
              else _OK_ANON_WP_PRESENT if self.wp else _OK_ANON)
        # a page not present when armed (zeros) is judged by its bytes (below), unless swapped out
        if flags.translate(None, ok) and any(f not in ok and (i not in a.absent or f & _SWAPPED)
                                             for i, f in enumerate(flags)):
            return False
        if (self.soft_dirty and entries[6::8].translate(None, _CLEAN_SD)
                and any(sd & _SOFT_DIRTY and f & _PRESENT
                        for sd, f in zip(entries[6::8], flags, strict=True))):
            return False
        # A present page with no write seen may still be another page than the armed one: the zero
        # page (after MADV_DONTNEED, or a new mapping at the same place, then a read), or a page
        # moved here by mremap. Its first word (or the non-zero word it had) must be as armed.
        # (Not under write-protection where mremap clears the bit: neither page has the bit.)
        if not self.exact:
            for i, j in _present_runs(flags):
                if _first_words(a.page + i, j - i) != a.firsts[8 * i:8 * j]:
                    return False
            for i, (w, value) in a.zero_first.items():
                if w >= 0 and ctypes.c_uint64.from_address((a.page + i) * PAGE + 8 * w).value != value:
                    return False
        # absent when armed, here now: must still be all zeros
        return not any(flags[i] & _PRESENT and _witness(a.page + i) >= 0 for i in a.absent)


def _file_clean(a: _Armed) -> bool:
    """Every page still reads the (never changed) file: a file page, or not present at all."""
    return not a.count or not _entries(a.page, a.count)[7::8].translate(None, _OK_FILE)


def _edges_of(lo: int, hi: int, page: int, count: int) -> tuple[bytes, bytes]:
    """The bytes of [lo, hi) before and after its ``count`` whole pages from ``page``."""
    if not count:
        return ctypes.string_at(lo, hi - lo), b""
    start, end = page * PAGE, (page + count) * PAGE
    return ctypes.string_at(lo, start - lo), ctypes.string_at(end, hi - end)


def _present_runs(flags: bytes) -> list[tuple[int, int]]:
    """[i, j) runs of the pages whose pagemap byte 7 says present."""
    present, runs, i = flags.translate(_PRESENT_01), [], 0
    while (i := present.find(1, i)) >= 0:
        j = present.find(0, i)
        j = len(present) if j < 0 else j
        runs.append((i, j))
        i = j
    return runs


def _empty_pages(kinds: dict[tuple[int, int], object]) -> dict[tuple[int, int], set[int]]:
    """For each anonymous range, the pages (index from its first whole page) with an empty entry:
    neither present nor swapped out, so all zeros. Read *before* write-protecting: protection turns
    an empty entry into a marker that the page map shows as a swap entry, like a page whose data
    is in swap or being migrated (those are not zeros)."""
    out = {}
    fd = os.open(PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for key, kind in kinds.items():
            page, count = _whole_pages(key[0], key[0] + key[1])
            if kind is _ANON and count:
                out[key] = _absent(_entries(page, count, fd)[7::8], _IN_USE_01)
    finally:
        os.close(fd)
    return out


def _absent(flags: bytes, table: bytes = _PRESENT_01) -> set[int]:
    """Indexes of the pages whose pagemap byte 7 ``table`` maps to 0 (by default: not present),
    cost following their number."""
    present, absent = flags.translate(table), set()
    i = present.find(0)
    while i >= 0:
        j = present.find(1, i)
        j = len(present) if j < 0 else j
        absent.update(range(i, j))
        i = present.find(0, j)
    return absent


def _whole_pages(lo: int, hi: int) -> tuple[int, int]:
    """(first page number, count) of the pages wholly inside [lo, hi); (0, 0) when none."""
    page, end = -(-lo // PAGE), hi // PAGE
    return (page, end - page) if end > page else (0, 0)


def _write_protect(protector: uffd.WriteProtect, kinds: dict[tuple[int, int], object]) -> None:
    """Write-protect the whole pages of every anonymous range, each page once: ranges that overlap
    (views of one array) are merged first, since protecting a page again would hide a write made
    to it since the first time. A range that cannot be protected (another userfaultfd holds it, a
    mapping Linux will not register) is not tracked: its kind becomes None."""
    spans: list[tuple[int, int, list[tuple[int, int]]]] = []  # (first page, end page, keys)
    pages = {k: _whole_pages(k[0], k[0] + k[1]) for k, kind in kinds.items() if kind is _ANON}
    for key in sorted(pages, key=pages.__getitem__):
        page, count = pages[key]
        if not count:
            continue
        if spans and page < spans[-1][1]:  # overlaps
            first, end, keys = spans[-1]
            spans[-1] = (first, max(end, page + count), [*keys, key])
        else:
            spans.append((page, page + count, [key]))
    for first, end, keys in spans:
        try:
            protector.protect(first * PAGE, end * PAGE)
        except OSError as exc:
            log.debug("cannot write-protect pages %#x..%#x: %s", first * PAGE, end * PAGE, exc)
            for key in keys:
                kinds[key] = None


def _snapshot(lo: int, hi: int, d: str | None, kind: object, fd: int, edges: tuple[bytes, bytes],
              words: bool = True, empty: set[int] | None = None) -> _Armed | None:
    """What arming keeps of [lo, hi); ``edges``: its bytes outside whole pages, taken earlier;
    ``words``: keep the first word of every present page (rule 5); ``empty``: the range was just
    write-protected, and these pages had empty entries before (the only ones known to be zeros; a
    page swapped out is tracked too: its entry keeps the bit until a write)."""
    page, count = _whole_pages(lo, hi)
    entries = _entries(page, count, fd) if count else b""
    flags = entries[7::8]
    firsts = bytearray(8 * count)
    absent: set[int] = set()
    zero_first: dict[int, tuple[int, int]] = {}
    if kind is _ANON:
        if flags.translate(None, _NOT_SWAPPED) and (
                empty is None or (words and not _absent(flags, _NOT_SWAPPED_01) <= empty)):
            # swapped out: its content is not known without reading it back in (under
            # write-protection, fine where its bit alone is trusted: exact mode, no words)
            return None
        absent = _absent(flags) if empty is None else empty  # not read: they read as zeros
        for i, j in _present_runs(flags) if words else ():
            run = _first_words(page + i, j - i)
            firsts[8 * i:8 * j] = run
            for z in _zero_words(run):
                w = _witness(page + i + z)
                zero_first[i + z] = (w, ctypes.c_uint64.from_address((page + i + z) * PAGE + 8 * w).value
                                     if w >= 0 else 0)
    elif flags.translate(None, _OK_FILE):
        return None  # a page was written before arming: the bytes are not the file's
    return _Armed(d, kind, page, count, edges, frozenset(absent),
                  bytes(firsts), zero_first)
