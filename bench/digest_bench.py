"""The content hash (gpuhub/replication/digest.py) against the hashes it could have been.

Run: `.venv/bin/python -m bench digest` (or `-m bench.digest_bench [GIB]`). Over GIB (default 1)
GiB of random bytes in this process, alternating, REPEATS rounds: one thread of SHA-256, BLAKE2b
and BLAKE3 over the whole value, and the two tree hashes (16 MiB leaves in the digest's thread
pool, as ``digest`` hashes): the SHA-256 tree gpuhub used before (format 1) and ``digest``
itself (BLAKE3 leaves, format 2). Quoted: the median GB/s (GB = 1e9 bytes).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable

from blake3 import blake3

from gpuhub.replication import digest as digest_module

GIB = 1 << 30
REPEATS = 5


def sha256_tree(data: memoryview) -> str:
    """Format 1 of the digest (SHA-256 leaves and root), for comparison."""
    chunk, n = digest_module.CHUNK, data.nbytes
    parts = [data[i:i + chunk] for i in range(0, n, chunk)]
    leaves = digest_module._hash_pool().map(lambda p: hashlib.sha256(p).digest(), parts)
    h = hashlib.sha256(b"gpuhub-blob/1 sha256-tree 16MiB\0" + n.to_bytes(8, "big"))
    for leaf in leaves:
        h.update(leaf)
    return h.hexdigest()


def run(size: int, repeats: int = REPEATS) -> dict[str, float]:
    data = memoryview(os.urandom(size))
    hashes: dict[str, Callable[[memoryview], object]] = {
        "sha256, one thread": lambda d: hashlib.sha256(d).digest(),
        "blake2b, one thread": lambda d: hashlib.blake2b(d).digest(),
        "blake3, one thread": lambda d: blake3(d).digest(),
        "sha256 tree (format 1), pool": sha256_tree,
        "blake3 tree (`digest`, format 2), pool": digest_module.digest,
    }
    times: dict[str, list[float]] = {name: [] for name in hashes}
    for _ in range(repeats):
        for name, fn in hashes.items():
            t0 = time.perf_counter()
            fn(data)
            times[name].append(time.perf_counter() - t0)
    return {name: size / statistics.median(ts) / 1e9 for name, ts in times.items()}


def main(gib: float = 1.0) -> str:
    size = int(gib * GIB)
    rates = run(size)
    pool = digest_module._hash_pool()._max_workers
    lines = [f"### Content hash, {gib:g} GiB, {os.cpu_count()} CPUs, pool of {pool} "
             f"(`.venv/bin/python -m bench digest`, median of {REPEATS})", "",
             "| hash | GB/s |", "|---|---:|"]
    lines += [f"| {name} | {gbps:.2f} |" for name, gbps in rates.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0))
