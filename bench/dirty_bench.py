"""Buffer-level dirty tracking (gpuhub/kernel/dirty.py ``BufferTracker``) against hashing.

Run: `.venv/bin/python -m bench dirty` (or `-m bench.dirty_bench [GIB]`). In this process, arrays
of 128 MiB adding up to GIB (default 1) GiB:

- ``pass`` cell: ``BufferTracker.arm`` over them in-process + ``digest_if_unchanged`` of each,
  with each signal this machine has (userfaultfd write-protection, soft-dirty or the sentinel
  fork), vs ``digest`` of each (what the pickler pays without the tracker);
- the same check in a forked child (a GPU cell's, after a cell that wrote nothing): userfaultfd
  against copy-on-write bits with the first word of every page;
- the sentinel's fork + end, with the arrays in 4 KiB pages and in 2 MiB pages (1 and 4 GiB);
- writing all the arrays once (``a += 1``) under write-protection, while a sentinel lives (every
  page copied on write), and with neither.

Quoted: medians over REPEATS runs, seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import statistics
import sys
import time

import numpy as np

from gpuhub.kernel import dirty, uffd
from gpuhub.replication.digest import digest

GIB = 1 << 30
PIECE = 128 << 20
REPEATS = 5
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def arrays(total: int, huge: bool | None = None) -> list[np.ndarray]:
    """``total`` bytes of float64 arrays, every page written; in 2 MiB pages when ``huge``, in
    4 KiB pages when False, as numpy chooses when None."""
    out = []
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for _ in range(total // PIECE):
        a = np.empty(PIECE // 8)
        if huge is not None:
            lo = -(-a.ctypes.data // 4096) * 4096
            libc.madvise(lo, (a.ctypes.data + a.nbytes - lo) // 4096 * 4096,
                         MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
        a[:] = np.arange(a.size)
        out.append(a)
    return out


def anon_huge_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    return 0


def median(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def without_userfaultfd(off: bool = True):
    """Trackers use the other signals (as where userfaultfd does not work)."""
    real = uffd.write_protect
    if off:
        uffd.write_protect = lambda: None
    try:
        yield
    finally:
        uffd.write_protect = real


def arm_and_check(known, mode: str) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    tracker = dirty.BufferTracker.arm(known, mode=mode)
    t1 = time.perf_counter()
    got = [tracker.digest_if_unchanged(a, n) for a, n, _ in known]
    t2 = time.perf_counter()
    tracker.close()
    return t1 - t0, t2 - t1, sum(g == d for g, (_, _, d) in zip(got, known, strict=True))


def pass_cell(total: int = GIB, wp: bool = True) -> dict:
    arrs = arrays(total)
    known = [(a.ctypes.data, a.nbytes, digest(a)) for a in arrs]
    t_digest = median(lambda: [digest(a) for a in arrs])
    with without_userfaultfd(not wp):
        signal = dirty.in_process_signal()
        runs = [arm_and_check(known, "in-process") for _ in range(REPEATS)]
    return {"signal": signal, "digest": t_digest, "arm": statistics.median(r[0] for r in runs),
            "check": statistics.median(r[1] for r in runs), "answered": f"{runs[-1][2]}/{len(known)}"}


def child_check(total: int = GIB, wp: bool = True) -> dict:
    """Arm and check in a child forked just before, REPEATS times (one child each)."""
    arrs = arrays(total, huge=True)  # as a GPU kernel's replica holds them
    known = [(a.ctypes.data, a.nbytes, digest(a)) for a in arrs]
    runs = []
    with without_userfaultfd(not wp):
        for _ in range(REPEATS):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    os.write(w, pickle.dumps(arm_and_check(known, "forked-child")))
                finally:
                    os._exit(0)
            os.close(w)
            with os.fdopen(r, "rb") as f:
                runs.append(pickle.loads(f.read()))
            os.waitpid(pid, 0)
    return {"arm": statistics.median(r[0] for r in runs), "check": statistics.median(r[1] for r in runs),
            "answered": f"{runs[-1][2]}/{len(known)}"}


def sentinel_fork(total: int, huge: bool) -> dict:
    arrs = arrays(total, huge)  # noqa: F841 - held while the sentinel is forked
    start, end = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        s = dirty._Sentinel()
        t1 = time.perf_counter()
        s.end()
        start.append(t1 - t0)
        end.append(time.perf_counter() - t1)
    return {"fork": statistics.median(start), "end": statistics.median(end), "huge MiB": anon_huge_mib()}


def cow_write(total: int = GIB) -> dict:
    arrs = arrays(total)

    def write():
        for a in arrs:
            a += 1

    without = median(write)
    with_sentinel, protected = [], []
    for _ in range(REPEATS):
        s = dirty._Sentinel()
        t0 = time.perf_counter()
        write()
        with_sentinel.append(time.perf_counter() - t0)
        s.end()
    protector = uffd.write_protect()
    for _ in range(REPEATS if protector is not None else 0):
        for a in arrs:
            lo = -(-a.ctypes.data // dirty.PAGE) * dirty.PAGE
            protector.protect(lo, (a.ctypes.data + a.nbytes) // dirty.PAGE * dirty.PAGE)
        t0 = time.perf_counter()
        write()
        protected.append(time.perf_counter() - t0)
    return {"no sentinel": without, "sentinel": statistics.median(with_sentinel),
            "write-protected": statistics.median(protected) if protected else None}


def main(total: int = GIB) -> str:
    wp = uffd.write_protect() is not None
    lines = [f"## Buffer dirty tracking (`python -m bench.dirty_bench`), soft-dirty here: "
             f"{'yes' if dirty.SOFT_DIRTY else 'no'}, userfaultfd write-protection: {'yes' if wp else 'no'}", "",
             f"`pass` cell over {total / GIB:g} GiB in {total // PIECE} arrays:", "",
             "| where | signal | arm | digest_if_unchanged (all) | answered | digest instead |",
             "|---|---|---|---|---|---|"]
    for protect in (True, False) if wp else (False,):
        p = pass_cell(total, protect)
        lines.append(f"| in-process | {p['signal']} | {p['arm'] * 1e3:.1f} ms | {p['check'] * 1e3:.1f} ms "
                     f"| {p['answered']} | {p['digest']:.3f} s |")
    for protect in (True, False) if wp else (False,):
        c = child_check(total, protect)
        lines.append(f"| forked child, 2 MiB pages | {'userfaultfd' if protect else 'copy-on-write'} "
                     f"| {c['arm'] * 1e3:.1f} ms | {c['check'] * 1e3:.1f} ms | {c['answered']} | |")
    lines += ["", "| arrays | pages | sentinel fork | end + reap | AnonHugePages |", "|---|---|---|---|---|"]
    for size in (GIB, 4 * GIB):
        for huge in (False, True):
            r = sentinel_fork(size, huge)
            lines.append(f"| {size // GIB} GiB | {'2 MiB' if huge else '4 KiB'} | {r['fork'] * 1e3:.1f} ms "
                         f"| {r['end'] * 1e3:.1f} ms | {r['huge MiB']} MiB |")
    w = cow_write(total)
    protected = f", {w['write-protected']:.3f} s write-protected" if w["write-protected"] is not None else ""
    lines += ["", f"Writing {total / GIB:g} GiB (`a += 1`): {w['no sentinel']:.3f} s without a signal, "
              f"{w['sentinel']:.3f} s while a sentinel lives (copy-on-write faults){protected}"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else GIB))
