"""Dirty-page tracking of large buffers (gpuhub/kernel/dirty.py): a wrong "unchanged" loses data.

Each scenario runs in a child forked from the test process, as a GPU cell runs in a child forked
from its replica: the buffers are allocated (and written) here before the fork. The copy-on-write
signal is tested everywhere; soft-dirty only where this kernel has it (dirty.SOFT_DIRTY).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
import traceback
import warnings

import numpy as np
import pytest

from gpuhub.kernel import dirty, hugepages
from gpuhub.replication.digest import digest

MIB = 1 << 20
MODES = {"cow": {"forked": True, "soft_dirty": False}}
if dirty.SOFT_DIRTY:
    MODES["soft-dirty"] = {"forked": False, "soft_dirty": True}
    MODES["both"] = {"forked": True, "soft_dirty": True}


def in_child(fn):
    """Run ``fn`` in a forked child; return its result or raise with its traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                out = ("ok", fn())
            except BaseException:
                out = ("error", traceback.format_exc())
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    assert chunks, "the child died without an answer"
    status, value = pickle.loads(b"".join(chunks))
    if status != "ok":
        pytest.fail(f"in the child:\n{value}")
    return value


def big_array(mib: int = 64) -> np.ndarray:
    a = np.arange(mib * MIB // 8, dtype=np.float64)  # every page written, so present
    return a


def check(mode: str, ns: dict, cell, names=None):
    """Arm over ``names`` (default: all of ns), run ``cell(ns)``, return {name: unchanged?}."""
    def child():
        tracker = dirty.Tracker.arm(ns, list(names or ns), **MODES[mode])
        assert tracker is not None, "no signal works in a forked child"
        cell(ns)
        return {n: tracker.unchanged(n, ns[n]) for n in (names or ns) if n in ns}
    return in_child(child)


@pytest.fixture(params=list(MODES))
def mode(request):
    return request.param


def test_write_of_one_element_is_detected(mode):
    ns = {"big": big_array(), "other": big_array()}

    def cell(ns):
        ns["big"][123_456] = -1.0

    assert check(mode, ns, cell) == {"big": False, "other": True}


def test_no_write_is_not_detected_and_reading_is_not_a_write(mode):
    ns = {"big": big_array(), "raw": bytearray(os.urandom(4 * MIB))}

    def cell(ns):
        assert ns["big"].sum() > 0
        assert bytes(ns["raw"][:10])
        ns["x"] = 1
        ns["copy"] = ns["big"].copy()  # new memory nearby is not the tracked buffer

    assert check(mode, ns, cell, ["big", "raw"]) == {"big": True, "raw": True}


def test_reassign_is_detected_by_id(mode):
    ns = {"big": big_array(), "same": big_array(), "other": big_array(), "spare": big_array()}
    ns["spare"][0] = -1.0

    def cell(ns):
        ns["big"] = ns["big"].copy()  # same content, another object
        ns["same"] = ns["same"]
        ns["kept"] = ns["other"]  # the armed array lives on, untouched …
        ns["other"] = ns.pop("spare")  # … but "other" is now another (untouched) array

    assert check(mode, ns, cell, ["big", "same", "other"]) == {"big": False, "same": True, "other": False}


def test_freed_and_reallocated_at_the_same_place_is_detected(mode):
    ns = {"big": big_array()}

    def cell(ns):
        old = ns.pop("big")
        ptr = old.ctypes.data
        del old
        new = np.empty(64 * MIB // 8)
        new[:] = 7.0
        ns["big"] = new
        return ptr == new.ctypes.data

    assert check(mode, ns, cell) == {"big": False}


@pytest.mark.parametrize("change", ["resize", "reshape", "dtype", "strides"])
def test_in_place_layout_changes_are_detected(mode, change):
    ns = {"big": big_array()}

    def cell(ns):
        a = ns["big"]
        if change == "resize":
            a.resize(a.size + 1, refcheck=False)
        elif change == "reshape":
            a.shape = (1024, -1)
        elif change == "dtype":
            a.dtype = np.int64  # same bytes, another value
        else:
            a.shape = (2, -1)
            with warnings.catch_warnings():  # deprecated in NumPy 2.4, still possible
                warnings.simplefilter("ignore", DeprecationWarning)
                a.strides = (8, 16)  # the same bytes, read in another order

    assert check(mode, ns, cell) == {"big": False}


def test_write_through_a_view_is_detected(mode):
    base = big_array()
    half = base.size // 2
    ns = {"big": base, "rev": base[::-1], "tail": base[half:], "head": base[:half]}

    def cell(ns):
        view = ns["big"][::3]
        view[-5] = 42.0  # near the end: the tail's pages and the base's

    assert check(mode, ns, cell, ["big", "rev", "tail", "head"]) == {
        "big": False, "rev": False, "tail": False, "head": True}


def test_view_written_through_its_base_is_detected(mode):
    base = big_array(8)
    ns = {"strided": base.reshape(1024, -1)[:, ::2], "base": base}

    def cell(ns):
        ns["base"][1] = -1.0  # an element the strided view does not show, on its pages

    # page granularity: a write between the view's elements still counts (safe side)
    assert check(mode, ns, cell, ["strided"]) == {"strided": False}


def test_bytearray_write_and_append_are_detected(mode):
    ns = {"w": bytearray(4 * MIB), "grown": bytearray(4 * MIB), "same": bytearray(4 * MIB)}
    for v in ns.values():
        v[:] = b"\1" * len(v)

    def cell(ns):
        ns["w"][-1] = 9
        ns["grown"] += b"x"

    assert check(mode, ns, cell) == {"w": False, "grown": False, "same": True}


def test_a_fork_in_the_cell_voids_the_copy_on_write_answer():
    ns = {"big": big_array()}

    def cell(ns):
        ns["big"][0] = 5.0  # written first: exclusive …
        pid = os.fork()  # … then shared again with a process that lives on
        if pid == 0:
            time.sleep(3)
            os._exit(0)

    def child():
        tracker = dirty.Tracker.arm(ns, ["big"], forked=True, soft_dirty=False)
        cell(ns)
        return tracker.unchanged("big", ns["big"])

    assert in_child(child) is False


def test_shared_and_untouched_memory_is_not_trusted(mode):
    shared = mmap.mmap(-1, 8 * MIB)  # MAP_SHARED: writes to it copy nothing, nor need this process
    shared.write(b"\1" * 8 * MIB)
    ns = {"shared": np.frombuffer(shared, dtype=np.uint8), "zeros": np.zeros(8 * MIB),
          "fine": big_array(8)}

    def cell(ns):
        ns["shared"][::4096] = 2  # every page written, and still mapped by the parent too

    assert check(mode, ns, cell) == {"shared": False, "zeros": False, "fine": True}


def test_small_and_object_arrays_are_not_tracked(mode):
    ns = {"small": np.ones(1000), "objects": np.array([object()] * (2 * MIB // 8)),
          "listy": [big_array(4)]}

    def cell(ns):
        pass

    assert check(mode, ns, cell) == {"small": False, "objects": False, "listy": False}


def test_not_a_fresh_child_and_no_soft_dirty_means_no_tracker(monkeypatch):
    monkeypatch.setattr(dirty, "SOFT_DIRTY", False)
    # this process was not forked just now: its probe page is not shared with a parent
    assert dirty.Tracker.arm({"big": big_array()}, ["big"], forked=True) is None
    assert dirty.Tracker.arm({"big": big_array()}, ["big"], forked=False) is None


def test_soft_dirty_probe_matches_this_kernel():
    assert dirty._probe_soft_dirty() == dirty.SOFT_DIRTY
    if not dirty.SOFT_DIRTY:
        assert dirty.Tracker.arm({}, [], forked=False) is None


def test_torch_cpu_tensor(mode):
    torch = pytest.importorskip("torch")
    ns = {"t": torch.ones(1 << 20), "w": torch.ones(1 << 20), "v": torch.ones(1 << 20)}

    def cell(ns):
        ns["w"][5] = 2.0
        ns["v"].numpy()[7] = 3.0  # a write torch does not count (_version)

    assert check(mode, ns, cell) == {"t": True, "w": False, "v": False}


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
    import pickle as p

    arr = p.loads(p.dumps(np.arange(64 * MIB // 8, dtype=np.float64), protocol=5))  # 4 KiB pages
    value = {"ndarray": arr, "bytes": arr.tobytes(), "bytearray": bytearray(arr.tobytes()),
             "memoryview": memoryview(bytearray(arr.tobytes()))[: 32 * MIB].toreadonly()}[kind]
    before = bytes(memoryview(value)[:4096]), bytes(memoryview(value)[-4096:])
    done = hugepages.prefer_huge_pages(value)
    assert (bytes(memoryview(value)[:4096]), bytes(memoryview(value)[-4096:])) == before
    if done and kind == "ndarray":
        assert _anon_huge_kib(arr.ctypes.data, arr.nbytes) >= 32 * 1024
    assert hugepages.prefer_huge_pages(np.ones(1000)) is False  # small: left alone
    assert hugepages.prefer_huge_pages([1, 2]) is False


# --- BufferTracker without a process: private mappings of blob store files (rule 8), API ---------
# (the sentinel and copy-on-write cases fork: tests/integration/test_dirty_process.py)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpuhub.replication.blobstore import BlobStore  # noqa: E402

PAGE = mmap.PAGESIZE


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
    assert dirty._Maps().kind(addr, addr + 4 * MIB)[0] == "file"
    anon = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE)
    assert dirty._Maps().kind(dirty._address(anon), dirty._address(anon) + 4 * MIB) == "anon"
    shared = mmap.mmap(-1, 4 * MIB)
    assert dirty._Maps().kind(dirty._address(shared), dirty._address(shared) + 4 * MIB) is None


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
    import ctypes
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


def test_anonymous_memory_without_a_signal_is_not_answered():
    # this process was not just forked: no copy-on-write signal, and a forked-child mode makes no sentinel
    a = big_array(4)
    tracker = dirty.BufferTracker.arm([(a.ctypes.data, a.nbytes, "d")], mode="forked-child")
    assert dirty.live_sentinel() is None
    if not dirty.SOFT_DIRTY:
        assert len(tracker) == 0 and tracker.digest_if_unchanged(a.ctypes.data, a.nbytes) is None
    with pytest.raises(ValueError):
        dirty.BufferTracker.arm([], mode="forked")


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
