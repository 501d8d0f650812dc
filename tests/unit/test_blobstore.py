"""A replica's blob store (gpuhub/replication/blobstore.py): keep, drop, reuse dropped buffers;
file-backed values mapped copy-on-write; the copy that fills its buffers."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from gpuhub.replication import blobstore
from gpuhub.replication.blobstore import FILE_MIN, BlobStore, copy_into
from gpuhub.replication.digest import digest


def test_store_put_get_retain():
    s = BlobStore()
    a, b = b"a" * 10, b"b" * 20
    s.put(digest(a), a)
    s.put(digest(b), b)
    s.put(digest(b), b)  # idempotent
    assert s.get(digest(a)) == a and s.has(digest(b)) and s.get("0" * 64) is None
    assert s.nbytes == 30 and len(s) == 2
    s.retain({digest(b)})
    assert not s.has(digest(a)) and s.get(digest(b)) == b and s.nbytes == 20
    s.retain(set())
    assert len(s) == 0 and s.nbytes == 0


def test_store_reuses_dropped_buffers_only_when_nothing_references_them():
    s = BlobStore(spare_bytes=10_000)
    buf = s.alloc(1000)
    buf[:] = b"x" * 1000
    s.adopt("a" * 64, buf, 1000)
    del buf
    view = s.get("a" * 64)
    assert bytes(view) == b"x" * 1000 and view.readonly
    s.retain(set())
    assert s.spare_nbytes == 0  # a view is alive: the buffer must not be reused
    del view

    buf = s.alloc(900)
    s.adopt("b" * 64, buf, 900)
    del buf
    assert len(s.get("b" * 64)) == 900 and s.nbytes == 900
    s.retain(set())
    assert s.spare_nbytes >= 900
    again = s.alloc(800)  # the 900-byte spare fits within n + n/4
    assert len(again) == 900 and s.spare_nbytes == 0
    s.recycle(again)
    assert s.spare_nbytes == 900
    assert s.alloc(10) is not again and s.spare_nbytes == 900  # far smaller: fresh, spare kept


# --- file-backed store: values loaded copy-on-write (gpuhub/kernel/replica.py) -------------------
MIB = 1 << 20


def store_bytes(store: BlobStore, data: bytes) -> str:
    """Receive ``data`` into the store as a follower does (alloc, fill, adopt); its digest."""
    buf = store.alloc(len(data))
    view = memoryview(buf)[:len(data)]
    copy_into(view, memoryview(data))
    d = digest(view)
    del view
    store.adopt(d, buf, len(data))
    return d


def test_a_value_mapped_copy_on_write_never_changes_the_stored_blob():
    store = BlobStore(file_backed=True)
    original = np.arange(MIB, dtype=np.float64)
    d = store_bytes(store, original.tobytes())
    value = np.frombuffer(store.map_private(d, 0, original.nbytes), dtype=np.float64)
    assert value.flags.writeable and np.array_equal(value, original)
    value += 1  # a CPU cell writing the loaded value in place
    value[-1] = -5
    assert digest(store.get(d)) == d
    again = np.frombuffer(store.map_private(d, 0, original.nbytes), dtype=np.float64)
    assert np.array_equal(again, original)
    part = store.map_private(d, mmap.PAGESIZE, mmap.PAGESIZE)  # a page-aligned part of it
    assert bytes(part) == original.tobytes()[mmap.PAGESIZE:2 * mmap.PAGESIZE]
    store.retain(set())  # the stored file goes; the value's private mapping stays valid
    assert value[0] == 1 and value[-1] == -5


def vm_flags(buf) -> list[str]:
    """The VmFlags of the mapping that holds ``buf`` (/proc/self/smaps)."""
    addr = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= addr < hi
            elif mapping and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the buffer")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="Linux built without transparent huge pages: nothing to ask for")
def test_new_buffers_ask_for_huge_pages_before_they_are_filled():
    files, memory = BlobStore(file_backed=True), BlobStore()
    for store in (files, memory):  # MADV_HUGEPAGE: granted where the transparent_hugepage settings allow
        assert "hg" in vm_flags(store.alloc(2 * MIB))
    # smaller than one huge page: nothing to ask (a small bytearray lives in malloc's memory, which
    # others in the process may have asked for huge pages: not checked)
    assert "hg" not in vm_flags(files.alloc(FILE_MIN))
    fresh = blobstore.new_buffer(2 * MIB)
    assert "hg" in vm_flags(fresh) and bytes(fresh[:4096]) == bytes(4096)


def test_map_private_refuses_what_is_not_file_backed():
    store = BlobStore(file_backed=False)
    d = store_bytes(store, b"\1" * MIB)
    assert store.map_private(d, 0, MIB) is None
    assert store.map_private("0" * 64, 0, 1) is None
    small = BlobStore(file_backed=True)  # below FILE_MIN: in memory, not in a file
    d = store_bytes(small, b"\1" * (FILE_MIN - 1))
    assert small.map_private(d, 0, FILE_MIN - 1) is None


def test_file_backed_buffers_are_never_kept_as_spares():
    store = BlobStore(spare_bytes=64 * MIB, file_backed=True)
    store_bytes(store, b"\1" * (2 * MIB))
    store.retain(set())
    assert store.spare_nbytes == 0


def test_executor_copies_are_anonymous_and_reused_received_values_get_a_fresh_file():
    store = BlobStore(spare_bytes=64 * MIB, file_backed=True)
    copy = store.alloc(2 * MIB, anonymous=True)  # the executor's own copy of a changed value
    assert blobstore.reusable(copy) and "hg" in vm_flags(copy)  # anonymous, in 2 MiB pages where granted
    copy[:] = b"\1" * len(copy)
    store.adopt("a" * 64, copy, len(copy))
    del copy
    store.retain(set())  # the value changed again: its old copy becomes a spare
    assert store.spare_nbytes == 2 * MIB
    received = store.alloc(2 * MIB)  # a value from a peer: never into an anonymous spare
    assert not blobstore.reusable(received) and store.spare_nbytes == 2 * MIB
    assert blobstore.reusable(store.alloc(2 * MIB, anonymous=True)) and store.spare_nbytes == 0


def test_copy_into_copies_in_steps_and_refuses_another_length(monkeypatch):
    monkeypatch.setattr(blobstore, "COPY_STEP", 1000)  # several steps, the last one partial
    src = bytes(range(256)) * 41
    dest = bytearray(len(src))
    copy_into(memoryview(dest), memoryview(src))
    assert dest == src
    with pytest.raises(ValueError, match="bytes into"):
        copy_into(memoryview(bytearray(10)), memoryview(src))
