"""Dirty-page tracking of large buffers (gpuhub/kernel/dirty.py) without a process: the soft-dirty
probe, private mappings of blob store files (rule 7), the API; and huge pages for large values
(gpuhub/kernel/hugepages.py). Anonymous memory (userfaultfd write-protection, and the fallbacks
that fork: the copy-on-write child, the in-process sentinel) is tested in
tests/integration/test_dirty_process.py; userfaultfd itself in tests/unit/test_uffd.py.
A wrong digest loses data."""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhub.kernel import dirty, hugepages, uffd
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest

MIB = 1 << 20
PAGE = mmap.PAGESIZE


def big_array(mib: int = 64) -> np.ndarray:
    return np.arange(mib * MIB // 8, dtype=np.float64)  # every page written, so present


def test_soft_dirty_probe_matches_this_kernel():
    assert dirty._probe_soft_dirty() == dirty.SOFT_DIRTY


def test_anonymous_memory_without_a_signal_is_not_answered(monkeypatch):
    monkeypatch.setattr(dirty, "SOFT_DIRTY", False)
    monkeypatch.setattr(uffd, "write_protect", lambda: None)
    a = big_array(4)
    # not just forked: no copy-on-write signal, and the forked-child mode makes no sentinel
    tracker = dirty.BufferTracker.arm([(a.ctypes.data, a.nbytes, "d")], mode="forked-child")
    assert len(tracker) == 0 and tracker.digest_if_unchanged(a.ctypes.data, a.nbytes) is None
    # in-process with the sentinel turned off (GPUHUB_WRITE_TRACKING=hash)
    tracker = dirty.BufferTracker.arm([(a.ctypes.data, a.nbytes, "d")], mode="in-process", sentinel=False)
    assert len(tracker) == 0 and tracker.digest_if_unchanged(a.ctypes.data, a.nbytes) is None
    assert dirty.live_sentinel() is None
    with pytest.raises(ValueError):
        dirty.BufferTracker.arm([], mode="forked")


def _anon_huge_kib(addr: int, n: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [addr, addr + n)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < addr + n and end > addr
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("kind", ["ndarray", "bytes", "bytearray", "memoryview"])
def test_prefer_huge_pages_keeps_the_bytes(kind):
    arr = pickle.loads(pickle.dumps(np.arange(64 * MIB // 8, dtype=np.float64), protocol=5))  # 4 KiB pages
    value = {"ndarray": arr, "bytes": arr.tobytes(), "bytearray": bytearray(arr.tobytes()),
             "memoryview": memoryview(bytearray(arr.tobytes()))[: 32 * MIB].toreadonly()}[kind]
    before = bytes(memoryview(value)[:4096]), bytes(memoryview(value)[-4096:])
    done = hugepages.prefer_huge_pages(value)
    assert (bytes(memoryview(value)[:4096]), bytes(memoryview(value)[-4096:])) == before
    if done and kind == "ndarray":
        assert _anon_huge_kib(arr.ctypes.data, arr.nbytes) >= 32 * 1024
    assert hugepages.prefer_huge_pages(np.ones(1000)) is False  # small: left alone
    assert hugepages.prefer_huge_pages([1, 2]) is False


# --- private mappings of blob store files (rule 7) ----------------------------------------------
def stored_file(store: BlobStore, data: bytes) -> str:
    """Store ``data`` as a file-backed blob (as a follower receives it); its digest."""
    buf = store.alloc(len(data))
    buf[:len(data)] = data
    d = digest(data)
    store.adopt(d, buf, len(data))
    return d


def private_map(store: BlobStore, d: str, n: int) -> tuple[mmap.mmap, int]:
    m = store.map_private(d, 0, n)
    assert m is not None
    return m, dirty._address(m)


def test_blob_files_are_named_as_the_tracker_expects():
    store = BlobStore(file_backed=True)
    d = stored_file(store, os.urandom(4 * MIB))
    _m, addr = private_map(store, d, 4 * MIB)  # kept mapped
    assert dirty._Maps.now().kind(addr, addr + 4 * MIB)[0] == "file"
    anon = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE)
    assert dirty._Maps.now().kind(dirty._address(anon), dirty._address(anon) + 4 * MIB) == "anon"
    shared = mmap.mmap(-1, 4 * MIB)
    assert dirty._Maps.now().kind(dirty._address(shared), dirty._address(shared) + 4 * MIB) is None


def test_private_file_mapping_written_or_not():
    store = BlobStore(file_backed=True)
    data = os.urandom(8 * MIB)
    m, addr = private_map(store, stored_file(store, data), 8 * MIB)
    m[5 * PAGE + 1] = m[5 * PAGE + 1]  # a page written before arming (same byte: still anonymous)
    ranges = {"whole": (addr, 8 * MIB), "head": (addr + 6 * PAGE + 100, 2 * MIB), "tail": (addr + 6 * MIB, 2 * MIB),
              "mid": (addr + 3 * MIB + 7, MIB), "written-before": (addr + 4 * PAGE, 4 * PAGE)}
    tracker = dirty.BufferTracker.arm([(a, n, name) for name, (a, n) in ranges.items()], mode="in-process")
    assert dirty.live_sentinel() is None  # no anonymous range: no sentinel
    assert bytes(m[:PAGE]) == data[:PAGE]  # reading faults file pages in: not a write
    m[6 * MIB - 1] = (m[6 * MIB - 1] + 1) % 256  # on tail's first page, outside tail: bytes compared
    m[3 * MIB + 7 + 5000] ^= 0xFF  # inside mid
    got = {name: tracker.digest_if_unchanged(a, n) for name, (a, n) in ranges.items()}
    assert got == {"whole": None, "head": "head", "tail": "tail", "mid": None, "written-before": None}
    assert tracker.digest_if_unchanged(addr, 8 * MIB - 1) is None  # not an armed range
    tracker.close()
    assert tracker.digest_if_unchanged(addr + 100, 2 * MIB) is None


def test_a_written_page_dropped_by_madvise_reads_the_file_again():
    store = BlobStore(file_backed=True)
    data = os.urandom(2 * MIB)
    m, addr = private_map(store, stored_file(store, data), 2 * MIB)
    tracker = dirty.BufferTracker.arm([(addr, 2 * MIB, "d")], mode="in-process")
    m[PAGE] ^= 1
    assert tracker.digest_if_unchanged(addr, 2 * MIB) is None
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(addr + PAGE, PAGE, 4) == 0  # MADV_DONTNEED: the file's page again
    assert bytes(m) == data
    assert tracker.digest_if_unchanged(addr, 2 * MIB) == "d"


def test_arming_again_voids_the_previous_tracker_and_conflicting_digests_void_a_range():
    store = BlobStore(file_backed=True)
    _m, addr = private_map(store, stored_file(store, os.urandom(2 * MIB)), 2 * MIB)  # kept mapped
    first = dirty.BufferTracker.arm([(addr, 2 * MIB, "d"), (addr, MIB, "x"), (addr, MIB, "y")],
                                    mode="in-process")
    assert first.digest_if_unchanged(addr, 2 * MIB) == "d"
    assert first.digest_if_unchanged(addr, MIB) is None  # two digests for one range: neither trusted
    second = dirty.BufferTracker.arm([(addr, 2 * MIB, "d")], mode="in-process")
    assert first.digest_if_unchanged(addr, 2 * MIB) is None
    assert second.digest_if_unchanged(addr, 2 * MIB) == "d"
    second.close()
    second.close()  # idempotent


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_private_file_mappings(data):
    """Random ranges of a private mapping of a stored file, random writes: never a wrong digest."""
    store = BlobStore(file_backed=True)
    n = data.draw(st.integers(256, 300), label="pages") * PAGE  # FILE_MIN: 1 MiB
    content = os.urandom(n)
    m, addr = private_map(store, stored_file(store, content), n)
    ranges = set()
    for _ in range(data.draw(st.integers(1, 6))):
        lo = data.draw(st.integers(0, n - 1))
        ranges.add((lo, data.draw(st.integers(1, n - lo))))
    tracker = dirty.BufferTracker.arm([(addr + lo, k, f"{lo}+{k}") for lo, k in ranges], mode="in-process")
    touched = set()
    for _ in range(data.draw(st.integers(0, 5))):
        kind = data.draw(st.sampled_from(["edge byte", "slice", "same byte", "read"]))
        if kind == "edge byte":
            page = data.draw(st.integers(0, n // PAGE - 1))
            i = min(n - 1, max(0, page * PAGE + data.draw(st.sampled_from([-1, 0, PAGE - 1]))))
            m[i] = (m[i] + data.draw(st.integers(1, 255))) % 256
        elif kind == "slice":
            i = data.draw(st.integers(0, n - 1))
            j = data.draw(st.integers(i + 1, n))
            m[i:j] = bytes(j - i)
        elif kind == "same byte":  # a write that changes no byte: either answer is right
            i = data.draw(st.integers(0, n - 1))
            m[i] = m[i]
        else:
            bytes(m[data.draw(st.integers(0, n - 1)):])
        touched.add(kind)
    hits = 0
    for lo, k in ranges:
        got = tracker.digest_if_unchanged(addr + lo, k)
        same = m[lo:lo + k] == content[lo:lo + k]
        assert got is None or (got == f"{lo}+{k}" and same), (lo, k, got)
        hits += got is not None
    if touched <= {"read"}:
        assert hits == len(ranges)  # nothing written: every range answered
    tracker.close()
    m.close()
