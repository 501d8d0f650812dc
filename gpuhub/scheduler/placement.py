"""Where a kernel's replicas go. Pure logic: the scheduler and the simulator call the same function.

Rules (docs/architecture.md, oversubscription vocabulary, following NotebookOS):
- never two replicas of one kernel on one node;
- a node must have at least as many GPUs as the kernel asks for per cell;
- admission: the node's subscription ratio after placing stays at or under ``max_subscription_ratio``;
- least-loaded first: most idle GPUs now, then the lowest subscription ratio, then the name (stable);
- or, with ``pack`` (an elastic pool runs, gpuhub/scheduler/pool.py), consolidate: the servers that
  can grant the kernel's GPUs now, the fullest of them first (best fit), then the others; so the
  pool's empty servers stay empty and can be lent.
Placement never promises a grant: grants are the node agent's decision at cell time (D1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PlacementError(RuntimeError):
    """Not enough suitable nodes; the message says why, for the user."""


@dataclass(frozen=True)
class NodeView:
    """What the scheduler knows of one node (reported by its agent)."""

    name: str
    gpu_count: int
    pending: int  # GPUs of replicas already placed there
    committed: int  # GPUs granted right now
    schedulable: bool = True

    @property
    def idle(self) -> int:
        return self.gpu_count - self.committed

    def ratio_after(self, gpus: int, replicas: int) -> float:
        if self.gpu_count == 0:
            return 0.0
        return (self.pending + gpus) / (self.gpu_count * replicas)


def place_replicas(
    nodes: Sequence[NodeView],
    gpus: int,
    replicas: int,
    max_subscription_ratio: float,
    exclude: Sequence[str] = (),
    count: int | None = None,
    pack: bool = False,
) -> list[NodeView]:
    """Choose ``replicas`` distinct nodes for a kernel whose cells each need ``gpus`` GPUs.

    ``count`` (default ``replicas``) chooses fewer, for replacing a kernel's lost replica: the
    subscription ratio still counts the kernel's ``replicas``; ``exclude`` names its other nodes.
    """
    count = replicas if count is None else count
    if replicas < 1:
        raise PlacementError("a kernel needs at least one replica")
    if gpus < 0:
        raise PlacementError("a kernel cannot ask for a negative number of GPUs")
    live = [n for n in nodes if n.schedulable and n.name not in exclude]
    big_enough = [n for n in live if n.gpu_count >= gpus]
    admitted = [n for n in big_enough if gpus == 0 or n.ratio_after(gpus, replicas) <= max_subscription_ratio]
    if len(admitted) < count:
        raise PlacementError(
            f"cannot place {count} replica(s) needing {gpus} GPU(s) each: "
            f"{len(live)} schedulable node(s), {len(big_enough)} with at least {gpus} GPU(s), "
            f"{len(admitted)} under the subscription ratio {max_subscription_ratio:g}"
        )
    if pack:
        admitted.sort(key=lambda n: (n.idle < gpus, n.idle if n.idle >= gpus else -n.idle, -n.pending, n.name))
    else:
        admitted.sort(key=lambda n: (-n.idle, n.ratio_after(gpus, replicas), n.name))
    return admitted[:count]
