"""dirty.BufferTracker where it forks: the in-process sentinel, forks voiding copy-on-write answers,
the forked-child mode; the scenarios of a cell in every mode and signal (writes through views,
bytearrays, reallocations, shared memory, a fork during the cell, torch); property tests over
random arrays and writes (a wrong digest loses data).

An in-process arm on a kernel without soft-dirty (this VM) write-protects the pages through a
userfaultfd (gpuhub/kernel/uffd.py), or forks a sentinel child where that does not work (the tests
named *sentinel* turn userfaultfd off to get one), and the forked-child mode runs in a child forked
from the test process (as a GPU cell runs in a child forked from its replica: the buffers are
allocated and written before the fork), so these tests live here rather than in tests/unit (no
process there). Without a process: tests/unit/test_dirty.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhub.kernel import dirty, image, uffd

MIB = 1 << 20
PAGE = dirty.PAGE
MADV_DONTNEED = 4


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


def known(arrays: dict) -> list[tuple[int, int, str]]:
    """(address, nbytes, name) of contiguous arrays, as the pickler's buffer_callback finds them."""
    return [(a.ctypes.data, a.nbytes, name) for name, a in arrays.items()]


def answers(tracker, arrays: dict) -> dict:
    return {name: tracker.digest_if_unchanged(a.ctypes.data, a.nbytes) for name, a in arrays.items()}


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")  # a zombie still has one: gone means reaped


def madvise(addr: int, n: int, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(addr, n, advice) == 0, ctypes.get_errno()


def no_userfaultfd(monkeypatch) -> None:
    """In-process trackers fork a sentinel, as where userfaultfd is missing or filtered."""
    monkeypatch.setattr(uffd, "write_protect", lambda: None)


@pytest.fixture
def sentinel(monkeypatch):
    """In-process arms use the sentinel (unless soft-dirty works: then the test is skipped)."""
    if dirty.SOFT_DIRTY:
        pytest.skip("soft-dirty works here: no sentinel")
    no_userfaultfd(monkeypatch)


@pytest.fixture
def in_process():
    """Arm in-process; every tracker is closed after the test (no sentinel left behind)."""
    trackers = []

    def arm(arrays: dict):
        t = dirty.BufferTracker.arm(known(arrays), mode="in-process")
        trackers.append(t)
        return t

    yield arm
    for t in trackers:
        t.close()
    assert dirty.live_sentinel() is None


def test_sentinel_lives_until_the_next_arm_or_close_and_is_reaped(sentinel, in_process):
    a = {"a": np.arange(MIB, dtype=np.float64)}
    first = in_process(a)
    pid = dirty.live_sentinel()
    assert pid is not None and first.cow and alive(pid)
    assert answers(first, a) == {"a": "a"}  # the sentinel is a live child running python: exempt
    second = in_process(a)
    assert not alive(pid), "the previous sentinel is reaped at the next arm"
    assert answers(first, a) == {"a": None}  # voided by the new arm
    pid2 = dirty.live_sentinel()
    second.close()
    second.close()
    assert dirty.live_sentinel() is None and not alive(pid2)
    assert answers(second, a) == {"a": None}


def test_a_write_just_after_the_sentinel_forks_is_seen(sentinel, in_process, monkeypatch):
    """The sentinel's fork is the moment from which writes are seen (the kernel arms between cells
    while a notebook's threads run): a write that lands after the fork but before arming reads the
    page map and the edge bytes is seen, on the partial first page as on an interior one."""
    edge = np.zeros((1 << 18) + 1)
    edge = edge[1:] if edge.ctypes.data % PAGE == 0 else edge[:-1]  # element 0 on a partial page
    arrays = {"edge": edge, "inner": np.zeros(1 << 18), "kept": np.zeros(1 << 18)}

    class RacingSentinel(dirty._Sentinel):
        def __init__(self) -> None:
            super().__init__()
            arrays["edge"][0] = 7  # another thread's write, just after the fork
            arrays["inner"][1 << 17] = 7

    monkeypatch.setattr(dirty, "_Sentinel", RacingSentinel)
    tracker = in_process(arrays)
    assert answers(tracker, arrays) == {"edge": None, "inner": None, "kept": "kept"}


def test_writes_reads_and_neighbours(in_process):
    base = np.arange(16 * MIB // 8, dtype=np.float64)
    arrays = {"w": np.arange(2 * MIB), "r": np.arange(2 * MIB), "edge": np.arange(2 * MIB),
              "head": base[:base.size // 2], "tail": base[base.size // 2:], "base": base,
              "ba": np.frombuffer(bytearray(os.urandom(4 * MIB)), np.uint8)}
    tracker = in_process(arrays)
    arrays["w"][12345] = -1
    assert arrays["r"].sum() > 0
    arrays["edge"][-1] += 1  # the last byte: on the partial last page
    arrays["tail"][-2] = 0.5
    assert answers(tracker, arrays) == {"w": None, "r": "r", "edge": None, "head": "head", "tail": None,
                                        "base": None, "ba": "ba"}


def test_a_fork_after_a_write_voids_the_answer_a_child_from_before_does_not(sentinel, in_process):
    arrays = {"a": np.arange(2 * MIB, dtype=np.float64), "b": np.arange(2 * MIB, dtype=np.float64)}
    r, w = os.pipe()
    early = os.fork()  # a child from before arm: shares no page written after
    if early == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    try:
        tracker = in_process(arrays)
        assert answers(tracker, arrays) == {"a": "a", "b": "b"}
        arrays["a"][0] = 7.0  # written: exclusive, …
        assert answers(tracker, arrays)["a"] is None
        late = os.fork()  # … then shared again with a new child
        if late == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        assert answers(tracker, arrays) == {"a": None, "b": None}
    finally:
        os.close(w)
        os.close(r)
        for pid in (early, locals().get("late")):
            if pid:
                os.waitpid(pid, 0)


def test_zero_page_after_madvise_or_reallocation_is_not_the_armed_page(in_process):
    arrays = {"dropped": np.arange(4 * MIB // 8, dtype=np.float64) + 1,
              "zeros": np.zeros(4 * MIB // 8), "untouched": np.empty(4 * MIB // 8)}  # never written
    tracker = in_process(arrays)
    d = arrays["dropped"]
    madvise((d.ctypes.data // PAGE + 3) * PAGE, 2 * PAGE, MADV_DONTNEED)
    assert d.sum() > 0  # a read maps the zero page: present, shared, unwritten
    arrays["untouched"].sum()  # absent when armed, zero page now: still zeros, fine
    madvise((arrays["zeros"].ctypes.data // PAGE + 3) * PAGE, 2 * PAGE, MADV_DONTNEED)
    arrays["zeros"].sum()
    # Under write-protection a dropped page comes back without the bit: answered only if it was
    # not there when armed (a zero page then and now); malloc may have handed out used memory.
    zeros = tracker.armed[(arrays["zeros"].ctypes.data, arrays["zeros"].nbytes)]
    first = arrays["zeros"].ctypes.data // PAGE + 3 - zeros.page
    dropped_then = {first, first + 1} <= zeros.absent
    assert answers(tracker, arrays) == {"dropped": None, "zeros": "zeros" if dropped_then or not tracker.wp else None,
                                        "untouched": "untouched"}


def test_freed_and_reallocated_at_the_same_address(in_process):
    for fill in ("write", "read", "nothing"):
        arrays = {"a": np.arange(8 * MIB // 8, dtype=np.float64)}
        before = arrays["a"].tobytes()
        tracker = in_process(arrays)
        addr = arrays["a"].ctypes.data
        del arrays["a"]
        arrays["a"] = new = np.empty(8 * MIB // 8)
        if fill == "write":
            new[:] = 3.0
        elif fill == "read":
            new.sum()
        if new.ctypes.data == addr:  # on the heap, free + malloc may leave the bytes as they were
            got = tracker.digest_if_unchanged(addr, new.nbytes)
            assert got is None or new.tobytes() == before, fill
            if fill == "write":
                assert got is None


@pytest.fixture
def write_protected():
    if uffd.write_protect() is None:
        pytest.skip("userfaultfd write-protection does not work here")


def test_write_protection_forks_nothing_and_a_fork_hides_no_write(write_protected, in_process):
    arrays = {"a": np.arange(2 * MIB, dtype=np.float64), "b": np.arange(2 * MIB, dtype=np.float64)}
    tracker = in_process(arrays)
    assert tracker.wp and not tracker.cow and dirty.live_sentinel() is None
    arrays["a"][4096] = 7.0  # interior pages (the first and last are compared by their bytes)
    r, w = os.pipe()
    pid = os.fork()  # shares every page with a child that lives on: the bits stay the parent's
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    try:
        arrays["b"][-4096] = 7.0  # a write to a page shared with the child: copied, and seen
        assert answers(tracker, arrays) == {"a": None, "b": None}
        c = {"c": np.arange(2 * MIB, dtype=np.float64)}
        again = in_process(c)
        assert answers(again, c) == {"c": "c"}  # a child alive at arm voids nothing here
        c["c"][4096] = 1.0
        assert answers(again, c) == {"c": None}
    finally:
        os.close(w)
        os.close(r)
        os.waitpid(pid, 0)


def test_a_page_swapped_out_when_armed_is_not_taken_for_zeros(write_protected, in_process, monkeypatch):
    """After write-protection, an empty entry (a marker) and a page whose data is in swap look the
    same in the page map. A page that was in swap at arm and is dropped after (its entry empty
    again, reading zeros) has changed: no answer. The page map is doctored, the bytes are real."""
    arrays = {"a": np.arange(2 * MIB, dtype=np.float64) + 1}
    a = arrays["a"]
    victim = (a.ctypes.data // PAGE + 8)  # an interior page
    real = dirty._entries
    state = {"armed": False}

    def entries(first_page: int, npages: int, fd=None) -> bytes:
        out = bytearray(real(first_page, npages, fd))
        i = victim - first_page
        if 0 <= i < npages:
            out[8 * i:8 * i + 8] = bytes(7) + bytes([0x00 if state["armed"] else 0x42])  # swapped | wp
        return bytes(out)

    monkeypatch.setattr(dirty, "_entries", entries)
    tracker = in_process(arrays)
    assert tracker.wp
    state["armed"] = True  # now: dropped, reads as zeros
    ctypes.memset(victim * PAGE, 0, PAGE)
    assert answers(tracker, arrays) == {"a": None}


def test_overlapping_ranges_are_protected_once(write_protected, in_process, monkeypatch):
    """A view and its base: protecting the shared pages a second time would hide a write that
    another thread made between the two (the first range would read as unwritten)."""
    base = np.arange(4 * MIB // 8, dtype=np.float64)
    arrays = {"base": base, "tail": base[base.size // 2:]}
    real, calls = uffd.WriteProtect.protect, []

    def protect(self, lo: int, hi: int) -> None:
        real(self, lo, hi)
        calls.append((lo, hi))
        base[-4096] = -1.0  # another thread's write just after it: an interior page of both ranges

    monkeypatch.setattr(uffd.WriteProtect, "protect", protect)
    tracker = in_process(arrays)
    assert len(calls) == 1
    assert answers(tracker, arrays) == {"base": None, "tail": None}


def test_pinned_pages_void_page_bit_answers(write_protected, in_process, monkeypatch):
    arrays = {"a": np.arange(2 * MIB, dtype=np.float64)}
    tracker = in_process(arrays)
    assert answers(tracker, arrays) == {"a": "a"}
    monkeypatch.setattr(dirty, "_pinned", lambda: True)  # as with an RDMA region registered
    assert answers(tracker, arrays) == {"a": None}


def test_a_range_another_userfaultfd_holds_is_not_tracked(write_protected, in_process):
    maps = [mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE) for _ in range(2)]  # new: registered by no one
    arrays = {name: np.frombuffer(m, dtype=np.uint8) for name, m in zip(("held", "free"), maps, strict=True)}
    for a in arrays.values():
        a[:] = 1
    other = uffd.WriteProtect()  # user code's own userfaultfd, registered first
    try:
        held = arrays["held"]
        lo = -(-held.ctypes.data // PAGE) * PAGE
        other.protect(lo, (held.ctypes.data + held.nbytes) // PAGE * PAGE)
        tracker = in_process(arrays)
        assert answers(tracker, arrays) == {"held": None, "free": "free"}
    finally:
        other.close()


def test_a_child_never_drives_its_parents_userfaultfd(write_protected):
    parent = uffd.write_protect()

    def child():
        mine = uffd.write_protect()
        return parent.fd, mine is not parent and (mine is None or mine.pid == os.getpid())

    fd, own = in_child(child)
    assert fd == -1 and own  # closed in the child at the fork; the child opened its own
    assert uffd.write_protect() is parent and parent.fd >= 0  # still open here


def test_sentinel_with_busy_threads(sentinel, in_process):
    """Arm while other threads allocate, log and hold locks: the sentinel ends every time."""
    import logging
    stop = threading.Event()
    lock = threading.Lock()

    def busy():
        log = logging.getLogger("gpuhub.test")
        while not stop.is_set():
            with lock:
                _ = [bytearray(1000) for _ in range(50)]
                log.debug("busy")

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        arrays = {"a": np.arange(2 * MIB, dtype=np.float64)}
        for _ in range(30):
            tracker = in_process(arrays)
            assert answers(tracker, arrays) == {"a": "a"}
        tracker.close()
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_forked_child_mode():
    arrays = {"w": np.arange(2 * MIB, dtype=np.float64), "k": np.arange(2 * MIB, dtype=np.float64)}

    def child():
        t = dirty.BufferTracker.arm(known(arrays), mode="forked-child")
        arrays["w"][5] = 0
        return t.cow or t.wp, answers(t, arrays), dirty.live_sentinel()

    signal, got, sentinel = in_child(child)
    assert signal and sentinel is None
    assert got == {"w": None, "k": "k"}


# --- the scenarios of a cell, in both modes --------------------------------------------------------
def where(value) -> tuple[int, int]:
    """(address, nbytes) of a contiguous buffer, as the image's pickler finds it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.data_ptr(), value.untyped_storage().nbytes()
    mv = memoryview(value).cast("B")
    try:
        return image.address_of(mv), mv.nbytes
    finally:
        mv.release()


def check(mode: str, ns: dict, cell, names=None) -> dict:
    """Arm over the buffers of ``names`` (default: all of ``ns``), each under its name as digest; run
    ``cell(ns)``; return {name: the digest answered for the buffer ``ns[name]`` is now}."""
    names = list(names or ns)

    def run():
        t = dirty.BufferTracker.arm([(*where(ns[n]), n) for n in names], mode=mode)
        try:
            assert t.soft_dirty or t.cow or t.wp, "no signal works here"
            cell(ns)
            return {n: t.digest_if_unchanged(*where(ns[n])) for n in names if n in ns}
        finally:
            t.close()

    if mode == "forked-child":
        return in_child(run)  # ns was allocated (and written) here, before the fork
    got = run()
    assert dirty.live_sentinel() is None
    return got


@pytest.fixture(params=["forked-child", "in-process", "forked-child, copy-on-write", "in-process, sentinel"])
def mode(request, monkeypatch):
    """Each mode, and each without userfaultfd: copy-on-write bits in the child, the sentinel (where
    soft-dirty is missing) in-process."""
    mode, _, without = request.param.partition(", ")
    if without:
        if uffd.write_protect() is None:
            pytest.skip("no userfaultfd here: the plain mode is this one")
        if without == "sentinel" and dirty.SOFT_DIRTY:
            pytest.skip("soft-dirty works here: no sentinel")
        no_userfaultfd(monkeypatch)
    return mode


def big_array(mib: int = 16) -> np.ndarray:
    return np.arange(mib * MIB // 8, dtype=np.float64)  # every page written, so present


def test_write_of_one_element_is_seen(mode):
    ns = {"big": big_array(), "other": big_array(), "small": np.ones(100), "small2": np.ones(100)}

    def cell(ns):
        ns["big"][123_456] = -1.0
        ns["small"][5] = 0  # within one page: its bytes are compared

    assert check(mode, ns, cell) == {"big": None, "other": "other", "small": None, "small2": "small2"}


def test_no_write_is_not_seen_and_reading_is_not_a_write(mode):
    ns = {"big": big_array(), "raw": bytearray(os.urandom(4 * MIB))}

    def cell(ns):
        assert ns["big"].sum() > 0
        assert bytes(ns["raw"][:10])
        ns["x"] = 1
        ns["copy"] = ns["big"].copy()  # new memory nearby is not the tracked buffer

    assert check(mode, ns, cell, ["big", "raw"]) == {"big": "big", "raw": "raw"}


def test_rebinding_answers_for_the_bytes_not_the_name(mode):
    ns = {"big": big_array(), "same": big_array(), "other": big_array(), "spare": big_array()}
    ns["spare"][0] = -1.0

    def cell(ns):
        ns["big"] = ns["big"].copy()  # same content, other memory: not armed, hashed
        ns["same"] = ns["same"]
        ns["kept"] = ns["other"]  # the armed array lives on, untouched …
        ns["other"] = ns.pop("spare")  # … and "other" is now the (untouched) armed "spare"

    assert check(mode, ns, cell, ["big", "same", "other", "spare"]) == {
        "big": None, "same": "same", "other": "spare"}


def test_freed_and_reallocated_at_the_same_place_is_seen(mode):
    ns = {"big": big_array(64)}

    def cell(ns):
        old = ns.pop("big")
        del old
        new = np.empty(64 * MIB // 8)  # often at the same address
        new[:] = 7.0
        ns["big"] = new

    assert check(mode, ns, cell) == {"big": None}


def test_reallocation_in_place_is_seen(mode):
    ns = {"resized": big_array(), "grown": bytearray(4 * MIB)}
    ns["grown"][:] = b"\1" * len(ns["grown"])

    def cell(ns):
        ns["resized"].resize(ns["resized"].size + 1, refcheck=False)  # realloc: another range
        ns["grown"] += b"x"

    assert check(mode, ns, cell) == {"resized": None, "grown": None}


def test_write_through_a_view_is_seen(mode):
    base = big_array()
    half = base.size // 2
    ns = {"big": base, "tail": base[half:], "head": base[:half]}

    def cell(ns):
        view = ns["big"][::3]
        view[-5] = 42.0  # near the end: the tail's pages and the base's

    assert check(mode, ns, cell) == {"big": None, "tail": None, "head": "head"}


def test_a_neighbour_written_on_a_shared_edge_page_is_compared_by_bytes(mode):
    base = big_array(4)
    # Where malloc put base decides which slices start and end mid-page (after earlier tests freed
    # large blocks, glibc serves 4 MiB from the heap at any 16-byte offset): choose the slice's ends so
    # that both do.
    addr, _ = where(base)
    start = next(i for i in range(1000, 1100) if (addr + 8 * i) % PAGE)
    end = next(i for i in range(base.size - 1000, base.size - 900) if (addr + 8 * i) % PAGE)
    ns = {"part": base[start:end], "base": base}
    lo, n = where(ns["part"])
    assert lo % PAGE and (lo + n) % PAGE  # partial first and last page, shared with the rest of base

    def cell(ns):
        ns["base"][start - 1] = -1.0  # just before "part": on its first page
        ns["base"][end] = -1.0  # just after "part": on its last page

    assert check(mode, ns, cell) == {"part": "part", "base": None}


def test_bytearray_write_is_seen(mode):
    ns = {"w": bytearray(4 * MIB), "same": bytearray(4 * MIB)}
    for v in ns.values():
        v[:] = b"\1" * len(v)

    def cell(ns):
        ns["w"][-1] = 9

    assert check(mode, ns, cell) == {"w": None, "same": "same"}


def test_shared_memory_is_never_trusted_untouched_memory_is(mode):
    shared = mmap.mmap(-1, 8 * MIB)  # MAP_SHARED: writes to it copy nothing, nor need this process
    shared.write(b"\1" * 8 * MIB)
    quiet = mmap.mmap(-1, 8 * MIB)
    ns = {"shared": np.frombuffer(shared, dtype=np.uint8), "quiet": np.frombuffer(quiet, dtype=np.uint8),
          "zeros": np.zeros(8 * MIB // 8), "fine": big_array(8)}  # zeros: pages never touched

    def cell(ns):
        ns["shared"][::4096] = 2  # every page written, and still mapped by the parent too

    assert check(mode, ns, cell) == {"shared": None, "quiet": None, "zeros": "zeros", "fine": "fine"}


def test_a_fork_during_the_cell_voids_the_copy_on_write_answer_not_write_protection(monkeypatch):
    ns = {"big": big_array(), "other": big_array()}

    def cell(ns):
        ns["big"][0] = 5.0  # written first: exclusive …
        pid = os.fork()  # … then shared again with a process that lives on
        if pid == 0:
            time.sleep(3)
            os._exit(0)

    if uffd.write_protect() is not None:
        assert check("forked-child", ns, cell) == {"big": None, "other": "other"}
        no_userfaultfd(monkeypatch)
    assert check("forked-child", ns, cell) == {"big": None, "other": None}


def test_torch_cpu_tensor(mode):
    torch = pytest.importorskip("torch")
    ns = {"t": torch.ones(1 << 20), "w": torch.ones(1 << 20), "v": torch.ones(1 << 20)}

    def cell(ns):
        ns["w"][5] = 2.0
        ns["v"].numpy()[7] = 3.0  # a write torch does not count (_version): the pages do

    assert check(mode, ns, cell) == {"t": "t", "w": None, "v": None}


# --- property: random arrays, random writes, frees, reallocations, copies and views ----------------
OPS = ["edge byte", "slice", "whole", "same value", "free+empty", "free+empty+fill", "copy", "view write",
       "read", "madvise+read"]
unit = st.floats(0, 1, exclude_max=True)
PLANS = st.fixed_dictionaries({
    # elements (int64), a view of the middle or the whole array, where the view starts and its length
    "buffers": st.lists(st.tuples(st.integers(MIB // 8, 3 * MIB // 8), st.booleans(), unit, unit),
                        min_size=1, max_size=5),
    # operation, on which buffer, two positions, a byte
    "ops": st.lists(st.tuples(st.sampled_from(OPS), unit, unit, unit, st.integers(1, 255)), max_size=6),
})


def make_buffers(plan) -> dict:
    bufs = {}
    for i, (n, view, u, v) in enumerate(plan["buffers"]):
        a = np.random.default_rng(i).integers(1, 1 << 62, n, dtype=np.int64)
        if view:
            lo = int(u * n / 4)
            a = a[lo:lo + n // 2 + int(v * (n - lo - n // 2))]  # its base stays alive through the view
        bufs[f"b{i}"] = a
    return bufs


def run_plan(plan, bufs, arm) -> tuple[int, int]:
    """Arm over ``bufs``, apply the operations; check every answer against the bytes.
    Returns (untouched buffers answered, untouched buffers)."""
    armed = {name: (a.ctypes.data, a.nbytes, a.tobytes()) for name, a in bufs.items()}
    tracker = arm(known(bufs))
    names, touched = sorted(bufs), set()
    for op, which, u, v, byte in plan["ops"]:
        name = names[int(which * len(names))]
        a = bufs[name]
        if op == "edge byte":  # the byte before / at / after a page boundary inside the buffer
            k = int(u * (a.nbytes // PAGE + 1))
            off = (a.ctypes.data // PAGE + k) * PAGE - a.ctypes.data + int(v * 3) - 1
            a.view(np.uint8)[min(max(off, 0), a.nbytes - 1)] ^= byte
        elif op == "slice":
            i = int(u * a.size)
            a[i:i + 1 + int(v * (a.size - i))] = -5
        elif op == "whole":
            a[:] = a + 1
        elif op == "same value":  # leaves the bytes as they were: either answer is right
            i = int(u * a.size)
            a[i] = a[i]
        elif op in ("free+empty", "free+empty+fill"):
            n = a.size
            del a
            bufs[name] = np.empty(n, dtype=np.int64)  # often at the same address
            if op == "free+empty+fill":
                bufs[name][:] = byte
        elif op == "copy":
            bufs[name] = a.copy()
        elif op == "view write":
            a[::7][int(u * ((a.size - 1) // 7 + 1))] = 0
        elif op == "read":
            int(a.sum())
        else:
            madvise((a.ctypes.data // PAGE + 1) * PAGE, PAGE, MADV_DONTNEED)
            int(a.sum())
        if op != "read":
            touched.add(name)
    hits = untouched = 0
    for name, a in bufs.items():
        where = (a.ctypes.data, a.nbytes)
        got = tracker.digest_if_unchanged(*where)
        # whatever armed range this buffer now occupies, a digest must be that range's and the bytes its
        owners = [other for other, (addr, n, _) in armed.items() if (addr, n) == where]
        if got is not None:
            assert got in owners, (name, got, owners)
            assert a.tobytes() == armed[got][2], f"{name}: reported unchanged as {got}, bytes differ"
        if name not in touched:
            untouched += 1
            hits += got is not None
    tracker.close()
    assert tracker.digest_if_unchanged(*armed[names[0]][:2]) is None
    return hits, untouched


STATS = {mode: [0, 0] for mode in ("in-process", "in-process, sentinel", "forked-child", "forked-child, copy-on-write")}
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=150, **SETTINGS)
@given(PLANS)
def test_property_in_process(plan):
    hits, untouched = run_plan(plan, make_buffers(plan), lambda k: dirty.BufferTracker.arm(k, mode="in-process"))
    STATS["in-process"][0] += hits
    STATS["in-process"][1] += untouched
    assert dirty.live_sentinel() is None
    # Soundness (no changed buffer answered) is asserted inside run_plan. How many untouched buffers
    # are answered is only reported (test_property_hit_rates): a miss costs a hash, not data, and on
    # a loaded machine the kernel may legitimately move a page (khugepaged) or refuse the sentinel.


@settings(max_examples=60, **SETTINGS)
@given(PLANS)
def test_property_in_process_sentinel(plan):
    if dirty.SOFT_DIRTY or dirty.in_process_signal() == "sentinel":
        return  # the test above covers the one in-process signal this kernel has
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uffd, "write_protect", lambda: None)
        hits, untouched = run_plan(plan, make_buffers(plan),
                                   lambda k: dirty.BufferTracker.arm(k, mode="in-process"))
    STATS["in-process, sentinel"][0] += hits
    STATS["in-process, sentinel"][1] += untouched
    assert dirty.live_sentinel() is None


@settings(max_examples=60, **SETTINGS)
@given(PLANS)
def test_property_forked_child(plan):
    bufs = make_buffers(plan)  # here: a GPU cell's child works on the replica's buffers
    hits, untouched = in_child(lambda: run_plan(plan, bufs, lambda k: dirty.BufferTracker.arm(k, mode="forked-child")))
    STATS["forked-child"][0] += hits
    STATS["forked-child"][1] += untouched


@settings(max_examples=60, **SETTINGS)
@given(PLANS)
def test_property_forked_child_copy_on_write(plan):
    if uffd.write_protect() is None:
        return  # the test above covers the one signal this kernel has in a child
    bufs = make_buffers(plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uffd, "write_protect", lambda: None)
        hits, untouched = in_child(
            lambda: run_plan(plan, bufs, lambda k: dirty.BufferTracker.arm(k, mode="forked-child")))
    STATS["forked-child, copy-on-write"][0] += hits
    STATS["forked-child, copy-on-write"][1] += untouched


def test_property_hit_rates():
    """Printed with -s: the share of untouched buffers answered by the property tests above."""
    for mode, (hits, untouched) in STATS.items():
        if untouched:
            print(f"\n{mode}: {hits}/{untouched} untouched buffers answered")
