"""How long one migration decision takes at 1,000 servers: `gpuhub/scheduler/migration.py`'s
`plan_move` over 1,000 servers of 8 GPUs (random pending 0–150 GPUs of replicas and 0–8 busy),
for a 1-GPU kernel on three servers picked at random; `place_replicas` beside it, the same way,
in both its modes, and one elastic-pool decision (`gpuhub/scheduler/pool.py`, `PoolPolicy.plan`,
30 replicas a server, a quarter of the servers lent).
Run: `.venv/bin/python -m bench migration-policy`."""

from __future__ import annotations

import random
import time

from gpuhub.scheduler.migration import NoMigrationTarget, plan_move
from gpuhub.scheduler.placement import NodeView, place_replicas
from gpuhub.scheduler.pool import PoolPolicy, PoolServer, PoolSettings

SERVERS = 1000
DECISIONS = 2000


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e3, samples[int(len(samples) * 0.99) - 1] * 1e3


def main() -> str:
    rng = random.Random(1)
    nodes = [NodeView(f"n{i:04d}", 8, rng.randint(0, 150), rng.randint(0, 8)) for i in range(SERVERS)]
    moves, places, packs, pools = [], [], [], []
    servers = [PoolServer(v.name, 8, "lent" if i % 4 == 0 else "active", v.committed, v.pending, 30)
               for i, v in enumerate(nodes)]
    pool = PoolPolicy(PoolSettings(release_after_s=0))
    for _ in range(DECISIONS):
        placed = [(i, nodes[j]) for i, j in enumerate(rng.sample(range(SERVERS), 3))]
        t = time.perf_counter()
        try:
            plan_move(nodes, placed, 1, 7.0)
        except NoMigrationTarget:
            pass
        moves.append(time.perf_counter() - t)
        t = time.perf_counter()
        place_replicas(nodes, 1, 3, 7.0)
        places.append(time.perf_counter() - t)
        t = time.perf_counter()
        place_replicas(nodes, 1, 3, 7.0, pack=True)
        packs.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.plan(servers, rng.randint(0, 6000), 0.0, largest_request=8)
        pools.append(time.perf_counter() - t)
    return "\n".join([
        f"### One decision at {SERVERS:,} servers (`.venv/bin/python -m bench migration-policy`)", "",
        "| decision | p50 | p99 |", "|---|---:|---:|",
        "| `plan_move` (which replica moves where) | {:.2f} ms | {:.2f} ms |".format(*percentiles(moves)),
        "| `place_replicas` (a new kernel's three servers) | {:.2f} ms | {:.2f} ms |".format(*percentiles(places)),
        "| `place_replicas(pack=True)` (the same, elastic pool on) | {:.2f} ms | {:.2f} ms |".format(
            *percentiles(packs)),
        "| `PoolPolicy.plan` (the elastic pool's decision) | {:.2f} ms | {:.2f} ms |".format(*percentiles(pools)),
    ])


if __name__ == "__main__":
    print(main())
