"""Which pages did this process write? userfaultfd write-protection in asynchronous mode.

After every cell the kernel asks which of the namespace's large buffers the cell wrote
(gpuhub/kernel/dirty.py). Without this module the answer comes from page bits that cost more:
soft-dirty (kernels built without ``CONFIG_MEM_SOFT_DIRTY``, and arm64, never have it), else a
forked *sentinel* in a CPU kernel (every page then shared with a dormant child, so the kernel's
first write to a page copies it: about 0.5 s per GiB written, and a fork of the whole kernel per
cell), and copy-on-write bits in a GPU cell's child (which must then read a word of every page,
see rule 5 there). This module gives the answer without a fork or a copy, from Linux 6.7 on:

- a userfaultfd of this process, opened with ``UFFD_FEATURE_WP_ASYNC``, registered over a range in
  write-protect mode; ``UFFDIO_WRITEPROTECT`` sets the *uffd-wp* bit of every present page of it;
- the first write to such a page (from any thread, or by the Linux kernel for a system call such
  as ``read`` into the buffer) takes a minor fault that clears the bit and goes on: asynchronous
  mode delivers no event, so nothing has to read the descriptor and no write ever waits;
- ``/proc/self/pagemap`` shows the bit (bit 57, "pte is uffd-wp write-protected", Linux 5.13+):
  set means not written since it was protected.

What clears the bit besides a write, each read as "written" (never a wrong "unchanged"):
dropping the page (``MADV_DONTNEED``, ``munmap``; for anonymous memory Linux keeps no marker, so a
later read maps the zero page without the bit), a new mapping at the address, and a page moved by
``mremap`` (the destination is not registered, and since Linux 6.13 the moved entries lose the bit:
:attr:`WriteProtect.mremap_clears` says whether this kernel does). What keeps it: swap (the swap
entry carries it), page migration, huge pages split by a write. ``fork`` leaves the parent's bits:
the parent's next write to a shared page clears the bit before copying it. The child's copies of
the mappings are not registered and have no bit set.

Opened with ``UFFD_USER_MODE_ONLY``, which unprivileged processes may use whatever
``vm.unprivileged_userfaultfd`` says (Linux 5.11+); in asynchronous mode the flag changes nothing,
since no fault is ever handed to user space. A system call filter (a container's seccomp profile)
may still forbid ``userfaultfd``: :func:`write_protect` then answers None and the caller falls back.

A descriptor is tied to the address space that opened it: a forked child that used the one it
inherited would protect its *parent's* pages. Children close it at once (``os.register_at_fork``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import struct
import threading

log = logging.getLogger("gpuhub.uffd")

PAGE = mmap.PAGESIZE

# <asm/unistd.h>: the system call numbers where they differ by machine
_SYSCALLS = {"x86_64": {"userfaultfd": 323, "mremap": 25},
             "aarch64": {"userfaultfd": 282, "mremap": 216}}.get(platform.machine())

# <linux/userfaultfd.h>
_UFFD_API = 0xAA
_UFFD_USER_MODE_ONLY = 1
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _iowr(0x3F, 24)  # struct uffdio_api {api, features, ioctls}
_UFFDIO_REGISTER = _iowr(0x00, 32)  # struct uffdio_register {start, len, mode, ioctls}
_UFFDIO_WRITEPROTECT = _iowr(0x06, 24)  # struct uffdio_writeprotect {start, len, mode}

_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class WriteProtect:
    """This process's userfaultfd in asynchronous write-protect mode. :meth:`protect` a range, then
    read pagemap bit 57 of its pages: still set, not written since. The ioctls are thread-safe."""

    def __init__(self) -> None:
        if _SYSCALLS is None:
            raise OSError(errno.ENOSYS, f"userfaultfd: unknown machine {platform.machine()!r}")
        fd = _syscall(_SYSCALLS["userfaultfd"], os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"userfaultfd: {os.strerror(e)}")
        try:
            api = bytearray(struct.pack("QQQ", _UFFD_API, _FEATURE_WP_ASYNC, 0))
            fcntl.ioctl(fd, _UFFDIO_API, api)  # EINVAL: a feature this kernel lacks (WP_ASYNC: 6.7)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.pid = fd, os.getpid()
        self.mremap_clears = False  # set by the probe

    def protect(self, lo: int, hi: int) -> None:
        """Register [lo, hi) (page-aligned, private anonymous memory) and write-protect its present
        pages: from now on a write to one clears its bit. Raises OSError (EINVAL: not anonymous
        memory, or a gap; EBUSY: another userfaultfd holds it) and the range is then not tracked."""
        if os.getpid() != self.pid:
            raise OSError(errno.EBADF, "userfaultfd of another process (forked)")
        n = hi - lo
        fcntl.ioctl(self.fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", lo, n, _REGISTER_MODE_WP, 0)))
        fcntl.ioctl(self.fd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", lo, n, _WRITEPROTECT_MODE_WP)))

    def close(self) -> None:
        """Unregisters every range (closing the descriptor does)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _wp_bit(fd: int, addr: int) -> bool:
    """Pagemap bit 57 of the page at ``addr`` (byte 7, 0x02): still write-protected."""
    entry = os.pread(fd, 8, addr // PAGE * 8)
    return len(entry) == 8 and bool(entry[7] & 0x02)


def _probe(wp: WriteProtect) -> bool:
    """Whether the bit behaves as this module says here: set by protect, kept by a read, cleared by
    a write and by dropping the page (then read: the zero page); and whether mremap clears it
    (:attr:`WriteProtect.mremap_clears`)."""
    area = mmap.mmap(-1, 3 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pm = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        c = ctypes.c_char.from_buffer(area)
        addr = ctypes.addressof(c)
        del c  # an exported buffer would keep the mmap from closing
        area[0] = area[PAGE] = area[2 * PAGE] = 1  # present
        wp.protect(addr, addr + 3 * PAGE)
        set_ = _wp_bit(pm, addr) and _wp_bit(pm, addr + PAGE)
        _ = area[0]
        kept = _wp_bit(pm, addr)
        area[0] = 2
        cleared = not _wp_bit(pm, addr)
        area.madvise(mmap.MADV_DONTNEED, 2 * PAGE, PAGE)
        dropped = area[2 * PAGE] == 0 and not _wp_bit(pm, addr + 2 * PAGE)
        if not (set_ and kept and cleared and dropped):
            return False
        # move the protected second page over the (written) first one
        moved = _syscall(_SYSCALLS["mremap"], ctypes.c_void_p(addr + PAGE), ctypes.c_size_t(PAGE),
                         ctypes.c_size_t(PAGE), _MREMAP_MAYMOVE | _MREMAP_FIXED, ctypes.c_void_p(addr))
        wp.mremap_clears = moved == addr and area[0] == 1 and not _wp_bit(pm, addr)
        return True
    finally:
        os.close(pm)
        area.close()


_lock = threading.Lock()
_this: tuple[int, WriteProtect | None] | None = None  # (pid, what the probe gave in that process)


def write_protect() -> WriteProtect | None:
    """This process's :class:`WriteProtect`, opened and probed on first use; None where userfaultfd
    in asynchronous write-protect mode does not work here (older Linux, a system call filter)."""
    global _this
    pid = os.getpid()
    with _lock:
        if _this is None or _this[0] != pid:
            wp = None
            try:
                wp = WriteProtect()
                if not _probe(wp):
                    log.debug("userfaultfd write-protection does not behave as expected: not used")
                    wp.close()
                    wp = None
            except (OSError, ValueError) as exc:
                log.debug("no userfaultfd write-protection: %s", exc)
                if wp is not None:
                    wp.close()
                wp = None
            _this = (pid, wp)
        return _this[1]


def _after_fork_in_child() -> None:
    global _this, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _this is not None and _this[1] is not None:
        try:
            _this[1].close()  # the parent's: never drive its address space from here
        except OSError:
            pass
    _this = None


os.register_at_fork(after_in_child=_after_fork_in_child)
