"""Buffer-level dirty tracking (gpuhub/kernel/dirty.py ``BufferTracker``) against hashing.

Run: `.venv/bin/python -m bench dirty` (or `-m bench.dirty_bench [GIB]`). In this process, arrays
of 128 MiB adding up to GIB (default 1) GiB:

- ``pass`` cell: ``BufferTracker.arm`` over them (in-process mode: soft-dirty where the kernel has
  it, else the sentinel fork) + ``digest_if_unchanged`` of each, vs ``digest`` of each (what the
  pickler pays without the tracker);
- the sentinel's fork + end, with the arrays in 4 KiB pages and in 2 MiB pages (1 and 4 GiB);
- writing all the arrays once (``a += 1``) while a sentinel lives (every page copied on write)
  vs with none.

Quoted: medians over REPEATS runs, seconds.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import numpy as np

from gpuhub.kernel import dirty
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


def pass_cell(total: int = GIB) -> dict:
    arrs = arrays(total)
    known = [(a.ctypes.data, a.nbytes, digest(a)) for a in arrs]
    t_digest = median(lambda: [digest(a) for a in arrs])
    t_arm, t_check, hits = [], [], 0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        tracker = dirty.BufferTracker.arm(known, mode="in-process")
        t1 = time.perf_counter()
        got = [tracker.digest_if_unchanged(a, n) for a, n, _ in known]
        t2 = time.perf_counter()
        tracker.close()
        t_arm.append(t1 - t0)
        t_check.append(t2 - t1)
        hits = sum(g == d for g, (_, _, d) in zip(got, known, strict=True))
    return {"digest": t_digest, "arm": statistics.median(t_arm), "check": statistics.median(t_check),
            "answered": f"{hits}/{len(known)}"}


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
    with_sentinel = []
    for _ in range(REPEATS):
        s = dirty._Sentinel()
        t0 = time.perf_counter()
        write()
        with_sentinel.append(time.perf_counter() - t0)
        s.end()
    return {"no sentinel": without, "sentinel": statistics.median(with_sentinel)}


def main(total: int = GIB) -> str:
    lines = [f"## Buffer dirty tracking (`python -m bench.dirty_bench`), soft-dirty here: "
             f"{'yes' if dirty.SOFT_DIRTY else 'no (sentinel fork)'}", ""]
    p = pass_cell(total)
    lines += [f"`pass` cell over {total / GIB:g} GiB in {total // PIECE} arrays: digest {p['digest']:.3f} s; "
              f"arm {p['arm'] * 1e3:.1f} ms + digest_if_unchanged {p['check'] * 1e3:.1f} ms "
              f"(answered {p['answered']})", "",
              "| arrays | pages | sentinel fork | end + reap | AnonHugePages |", "|---|---|---|---|---|"]
    for size in (GIB, 4 * GIB):
        for huge in (False, True):
            r = sentinel_fork(size, huge)
            lines.append(f"| {size // GIB} GiB | {'2 MiB' if huge else '4 KiB'} | {r['fork'] * 1e3:.1f} ms "
                         f"| {r['end'] * 1e3:.1f} ms | {r['huge MiB']} MiB |")
    w = cow_write(total)
    lines += ["", f"Writing {total / GIB:g} GiB (`a += 1`): {w['no sentinel']:.3f} s without a sentinel, "
              f"{w['sentinel']:.3f} s while one lives (copy-on-write faults)"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else GIB))
