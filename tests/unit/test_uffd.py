"""gpuhub/kernel/uffd.py: userfaultfd write-protection in asynchronous mode, on this machine's kernel
(skipped where it does not work). Its use by the write tracker: tests/integration/test_dirty_process.py."""

from __future__ import annotations

import mmap
import os

import pytest

from gpuhub.kernel import dirty, uffd

PAGE = mmap.PAGESIZE


@pytest.fixture
def wp():
    protector = uffd.write_protect()
    if protector is None:
        pytest.skip("userfaultfd write-protection does not work here")
    return protector


def bits(addr: int, pages: int) -> list[bool]:
    """The write-protect bit of each page (pagemap bit 57)."""
    return [bool(b & 0x02) for b in dirty._entries(addr // PAGE, pages)[7::8]]


def area(pages: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(pages):
        m[i * PAGE] = 1  # present
    return m, dirty._address(m)


def test_one_per_process_and_it_knows_what_mremap_does(wp):
    assert uffd.write_protect() is wp and wp.pid == os.getpid() and wp.fd >= 0
    assert isinstance(wp.mremap_clears, bool)


def test_a_write_clears_the_bit_a_read_does_not_protecting_again_sets_it(wp):
    m, addr = area(4)
    wp.protect(addr, addr + 4 * PAGE)
    assert bits(addr, 4) == [True] * 4
    _ = m[PAGE], m[2 * PAGE + 5]
    m[3 * PAGE + 100] = 7  # from Python: a user-space write
    os.preadv(os.open("/dev/zero", os.O_RDONLY | os.O_CLOEXEC), [memoryview(m)[:8]], 0)  # Linux writes
    assert bits(addr, 4) == [False, True, True, False]
    wp.protect(addr, addr + 4 * PAGE)
    assert bits(addr, 4) == [True] * 4
    m.close()


def test_a_range_not_mapped_raises(wp):
    m, addr = area(2)
    m.close()  # unmapped now
    with pytest.raises(OSError):
        wp.protect(addr, addr + 2 * PAGE)
