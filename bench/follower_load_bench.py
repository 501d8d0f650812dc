"""A follower loading a changed large array: how long, and how long it starves other threads.

Run: `.venv/bin/python -m bench.follower_load_bench [SIZE_MIB [REPEATS]]`. In one process, a
thread that sleeps 1 ms in a loop stands in for pysyncobj's Raft thread; the figure that matters
for the next cell's election is the longest gap between its ticks while the main thread loads:

- ``pickle.loads``: the in-band pickle (cloudpickle, protocol 5) held in the blob store, as
  followers once loaded values; it copies the array holding the GIL;
- ``image.load``: the namespace image (gpuhub/kernel/image.py), its large buffer a raw blob received
  into a file-backed store and mapped copy-on-write (what a follower does now,
  ``Replica.load_image``).
"""

from __future__ import annotations

import pickle
import statistics
import sys
import threading
import time

import cloudpickle
import numpy as np

from gpuhub.kernel import image
from gpuhub.replication.blobstore import BlobStore, copy_into
from gpuhub.replication.digest import digest


def _longest_stall(load) -> tuple[float, float]:
    """(seconds ``load()`` took, longest gap between the ticker's ticks meanwhile)."""
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    value = load()
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    del value
    return elapsed, max(gaps)


def run(size_bytes: int = 1 << 30, repeats: int = 3) -> dict[str, list[tuple[float, float]]]:
    value = np.ones(size_bytes // 8)
    inband = cloudpickle.dumps(value, protocol=5)
    store = BlobStore(file_backed=True)
    captured = image.capture({"value": value}, set())
    (raw,) = captured.buffers
    buf = store.alloc(raw.nbytes)
    view = memoryview(buf)[:raw.nbytes]
    copy_into(view, raw)
    d = digest(view)
    view.release()
    store.adopt(d, buf, raw.nbytes)
    del buf, raw
    n = value.nbytes
    loads = {
        "pickle.loads (in band)": lambda: pickle.loads(inband),
        "image.load (copy-on-write maps)":
            lambda: image.load(captured.stream, [memoryview(store.map_private(d, 0, n))]),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in loads}
    for _ in range(repeats):
        for name, load in loads.items():
            results[name].append(_longest_stall(load))
    return results


def main(argv: list[str]) -> None:
    size = int(argv[0]) << 20 if argv else 1 << 30
    repeats = int(argv[1]) if len(argv) > 1 else 3
    print(f"| load of {size / 2**20:.0f} MiB | median s | longest stall of a 1 ms ticker, median ms |")
    print("|---|---:|---:|")
    for name, runs in run(size, repeats).items():
        print(f"| {name} | {statistics.median(r[0] for r in runs):.3f} "
              f"| {statistics.median(r[1] for r in runs) * 1000:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
