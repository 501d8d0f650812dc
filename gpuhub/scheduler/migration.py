"""Which replica of a kernel moves, and where, when none of its servers can grant a waiting cell.

Pure logic: the scheduler (gpuhub/scheduler/service.py, ``Scheduler.migrate``) and the simulator
(gpuhub/sim/engine.py) call the same function, so what the simulator reports is what the product
does (docs/architecture.md, "Migration").

Rules:
- the target has the cell's GPUs idle now, is schedulable (live, not drained), holds no replica of
  the kernel, and stays within the subscription ratio after taking the replica;
- best fit: of the servers that can grant, the one with the fewest idle GPUs left over, then the
  most subscribed (``pending``): servers already busy stay busy, and empty ones stay empty so an
  elastic pool can give them back; the name breaks ties (stable);
- the replica that moves is the one on the most subscribed of the kernel's servers (moving it
  relieves the server whose GPUs are most contended), then the one with the fewest idle GPUs,
  then the highest replica id.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from gpuhub.scheduler.placement import NodeView


class NoMigrationTarget(RuntimeError):
    """No server can take the replica and grant the cell now; the message says why, for the user."""


@dataclass(frozen=True)
class Move:
    replica: int  # the replica id that leaves
    source: str  # its server
    target: NodeView  # where its replacement starts


def choose_target(nodes: Sequence[NodeView], gpus: int, replicas: int, max_subscription_ratio: float,
                  exclude: Sequence[str], limit: int = 3) -> list[NodeView]:
    """The best ``limit`` servers that could take a replica of a kernel and grant its ``gpus`` now,
    best first (one pass over the servers, no sort of them all)."""
    excluded = set(exclude)
    fits = (n for n in nodes if n.schedulable and n.name not in excluded and n.gpu_count >= gpus
            and n.idle >= gpus and n.ratio_after(gpus, replicas) <= max_subscription_ratio)
    return heapq.nsmallest(limit, fits, key=lambda n: (n.idle - gpus, -n.pending, n.name))


def choose_replica(placed: Sequence[tuple[int, NodeView]]) -> tuple[int, NodeView]:
    """Of a kernel's replicas (id, its server), the one to move."""
    if not placed:
        raise NoMigrationTarget("the kernel has no replica to move")

    def pressure(item: tuple[int, NodeView]) -> tuple[float, int, int]:
        rid, node = item
        ratio = node.pending / node.gpu_count if node.gpu_count else 0.0
        return (-ratio, node.idle, -rid)

    return min(placed, key=pressure)


def plan_move(nodes: Sequence[NodeView], placed: Sequence[tuple[int, NodeView]], gpus: int,
              max_subscription_ratio: float, limit: int = 3) -> list[Move]:
    """The moves worth trying for a kernel whose cell needs ``gpus`` GPUs that none of its servers
    (``placed``: replica id and server) can grant: one replica, up to ``limit`` candidate targets,
    best first. Raises NoMigrationTarget when there is none."""
    if gpus < 1:
        raise NoMigrationTarget("a cell without GPUs never waits for a server")
    rid, source = choose_replica(placed)
    targets = choose_target(nodes, gpus, len(placed), max_subscription_ratio,
                            exclude=[n.name for _, n in placed], limit=limit)
    if not targets:
        schedulable = [n for n in nodes if n.schedulable and n.name not in {p.name for _, p in placed}]
        free = [n for n in schedulable if n.idle >= gpus]
        raise NoMigrationTarget(
            f"no other server can grant {gpus} GPU(s) now ({len(schedulable)} other schedulable server(s), "
            f"{len(free)} with {gpus} idle GPU(s), none of them under the subscription ratio "
            f"{max_subscription_ratio:g} after taking a replica)" if free else
            f"no other server has {gpus} idle GPU(s) now ({len(schedulable)} other schedulable server(s))")
    return [Move(rid, source.name, t) for t in targets]
