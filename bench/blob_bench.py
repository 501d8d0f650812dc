"""State sync of one large changed value to both followers (docs/architecture.md D4), on loopback.

Run: `.venv/bin/python -m bench.blob_bench [SIZE_MIB [REPEATS]]`. Two ``BlobServer``s (the
followers) run in this process on 127.0.0.1; each repeat changes one byte of a numpy-sized value
(so the digest is new), hashes it (``digest``, quoted as GB/s) and times ``push_all`` of it to both
followers, receivers' digest check included. Quoted: median seconds and GB/s (value size / time),
and the CPU seconds the process spent per push (all threads: sender, receivers, hashing), which
says what a push costs even when other work shares the machine.

Configurations:
- ``cold``: the default store; every push lands in freshly allocated memory (page faults);
- ``warm``: ``BlobStore(spare_bytes=…)`` and ``retain()`` after each push, as a replica does when
  a variable changes: the next value of that size reuses the dropped buffer;
- ``warm-noverify``: as warm, with ``BlobServer(verify=False)`` (no re-hash on receipt: what the
  hash costs);
- ``memfd``: ``BlobStore(file_backed=True)``, as CPU kernels' replicas use (values received into
  a memfd, so they can be mapped copy-on-write; never reused, so cold like ``cold``).
"""

from __future__ import annotations

import os
import secrets
import statistics
import sys
import time

import numpy as np

from gpuhub.replication.blobclient import push_all
from gpuhub.replication.blobserver import BlobServer
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest

CONFIGS = {  # name -> (spare buffers, verify on receipt, memfd store)
    "cold": (False, True, False),
    "warm": (True, True, False),
    "warm-noverify": (True, False, False),
    "memfd": (False, True, True),
}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _push_times(value: np.ndarray, repeats: int, spare: bool, verify: bool, memfd: bool,
                digest_times: list[float]) -> tuple[list[float], list[float]]:
    key = secrets.token_bytes(32)
    n = value.nbytes
    stores = [BlobStore(spare_bytes=2 * n if spare else 0, file_backed=memfd) for _ in range(2)]
    servers = [BlobServer(s, key, "127.0.0.1", 0, verify=verify).start() for s in stores]
    addrs = [s.address for s in servers]
    times, cpus = [], []
    try:
        for i in range(repeats + (1 if spare else 0)):  # warm: one untimed push fills the spares
            value[0] += 1  # wraps: uint8
            t0 = time.perf_counter()
            d = digest(value)
            digest_times.append(time.perf_counter() - t0)
            c0, t0 = _cpu(), time.perf_counter()
            errors = push_all(addrs, key, {d: value})
            elapsed, cpu = time.perf_counter() - t0, _cpu() - c0
            if any(errors.values()):
                raise RuntimeError(f"push_all failed: {errors}")
            if not all(s.has(d) for s in stores):
                raise RuntimeError("a follower lacks the pushed value")
            if not (spare and i == 0):
                times.append(elapsed)
                cpus.append(cpu)
            for s in stores:
                s.retain(set())
    finally:
        for s in servers:
            s.stop()
    return times, cpus


def run(size_bytes: int = 1 << 30, repeats: int = 5, *,
        configs: tuple[str, ...] = tuple(CONFIGS), verbose: bool = True) -> dict:
    """Measure (and print the table); returns the figures (seconds, GB/s with GB = 1e9 bytes)."""
    words = np.random.default_rng(0).integers(0, 2**64 - 1, -(-size_bytes // 8), dtype=np.uint64,
                                              endpoint=True)
    value = words.view(np.uint8)[:size_bytes]
    digest_times: list[float] = []
    result: dict = {"size_bytes": size_bytes, "repeats": repeats, "cpus": os.cpu_count(),
                    "loadavg_before": os.getloadavg()[0], "push": {}}
    for name in configs:
        spare, verify, memfd = CONFIGS[name]
        times, cpus = _push_times(value, repeats, spare, verify, memfd, digest_times)
        med = statistics.median(times)
        result["push"][name] = {"median_s": med, "gbps": size_bytes / med / 1e9,
                                "min_s": min(times), "times": times,
                                "cpu_s": statistics.median(cpus)}
    dmed = statistics.median(digest_times)
    result["digest_s"], result["digest_gbps"] = dmed, size_bytes / dmed / 1e9
    result["loadavg_after"] = os.getloadavg()[0]
    if verbose:
        print(table(result), flush=True)
    return result


def table(r: dict) -> str:
    size = r["size_bytes"]
    lines = [
        (f"value {size / 2**20:.0f} MiB, pushed to 2 followers on 127.0.0.1; {r['cpus']} CPUs; "
         f"load average {r['loadavg_before']:.2f} before, {r['loadavg_after']:.2f} after"),
        "",
        "| what | median s | best s | GB/s (size / median) | CPU s (all threads) |",
        "|---|---:|---:|---:|---:|",
        f"| digest (BLAKE3 tree) | {r['digest_s']:.3f} | | {r['digest_gbps']:.2f} | |",
    ]
    for name, p in r["push"].items():
        lines.append(f"| push_all to 2, {name} | {p['median_s']:.3f} | {p['min_s']:.3f} "
                     f"| {p['gbps']:.2f} | {p['cpu_s']:.2f} |")
    return "\n".join(lines)


def main() -> str:
    r = run(verbose=False)
    return "## Large values beside the log (blob push)\n\n`python -m bench.blob_bench`\n\n" + table(r)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    run(args[0] << 20 if args else 1 << 30, args[1] if len(args) > 1 else 5)
