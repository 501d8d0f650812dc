"""Per-cell GPU leases on one node: the only authority over this node's GPUs (docs/architecture.md D1).

Pure logic, no I/O: the agent's HTTP API and the simulator drive the same class.

Vocabulary (docs/architecture.md, oversubscription vocabulary):
- *pending* GPUs: the sum of the GPU specs of the replicas placed on this node;
- *committed* GPUs: GPUs granted to an executing cell right now (never more than the node has);
- *lingering* GPUs: held between cells by a kernel's idle cell process (its CUDA context and GPU
  memory), so that its next cell starts warm; taken back the moment another grant needs them.
A grant is all-or-nothing and immediate: either ``n`` GPUs are free now (once lingering leases
are taken back: :meth:`LeaseBook.reclaimable`), or the request is refused.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field


class LeaseError(ValueError):
    """A request the book cannot even consider (e.g. more GPUs than the node has)."""


@dataclass
class Lease:
    lease_id: str
    holder: str
    gpus: tuple[int, ...]  # indices into the node's GPU list
    granted_at: float
    holder_pid: int | None = None
    expires_at: float | None = None  # None: lives until released or its holder dies
    user: str = ""  # the holder's user and kernel: what quotas count (gpuhub/agent/quota_gate.py)
    kernel_id: str = ""
    # Lingering: no cell runs; this process (the kernel's idle cell process) holds the GPUs' memory
    # and is ended when another grant needs them.
    lingering_pid: int | None = None
    lingering_since: float | None = None

    def to_dict(self) -> dict:
        return {
            "lease_id": self.lease_id,
            "holder": self.holder,
            "gpus": list(self.gpus),
            "granted_at": self.granted_at,
            "holder_pid": self.holder_pid,
            "expires_at": self.expires_at,
            "user": self.user,
            "kernel_id": self.kernel_id,
            "lingering_pid": self.lingering_pid,
            "lingering_since": self.lingering_since,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Lease:
        return cls(
            lease_id=d["lease_id"],
            holder=d["holder"],
            gpus=tuple(d["gpus"]),
            granted_at=d["granted_at"],
            holder_pid=d.get("holder_pid"),
            expires_at=d.get("expires_at"),
            user=d.get("user", ""),
            kernel_id=d.get("kernel_id", ""),
            lingering_pid=d.get("lingering_pid"),
            lingering_since=d.get("lingering_since"),
        )


@dataclass
class LeaseBook:
    """GPU accounting for one node with ``gpu_count`` GPUs."""

    gpu_count: int
    leases: dict[str, Lease] = field(default_factory=dict)
    placed: dict[str, int] = field(default_factory=dict)  # replica id -> GPUs it may ask for
    _ids: Iterable[int] = field(default_factory=itertools.count, repr=False)
    random_ids: bool = True  # the simulator turns this off for speed and reproducibility

    # --- placement (pending) -------------------------------------------------
    def place(self, replica_id: str, gpus: int) -> None:
        if gpus < 0:
            raise LeaseError("a replica cannot ask for a negative number of GPUs")
        self.placed[replica_id] = gpus

    def unplace(self, replica_id: str) -> None:
        self.placed.pop(replica_id, None)

    @property
    def pending(self) -> int:
        return sum(self.placed.values())

    # --- grants (committed) --------------------------------------------------
    @property
    def busy(self) -> set[int]:
        """GPUs some lease holds, lingering ones too (their memory is in use)."""
        return {g for lease in self.leases.values() for g in lease.gpus}

    @property
    def lingering(self) -> set[int]:
        return {g for lease in self.leases.values() if lease.lingering_pid is not None for g in lease.gpus}

    @property
    def committed(self) -> int:
        """GPUs a running cell holds: lingering ones are not (another grant takes them back)."""
        return len(self.busy) - len(self.lingering)

    @property
    def free(self) -> int:
        """GPUs no lease holds: a grant takes these without ending a lingering lease."""
        return self.gpu_count - len(self.busy)

    def can_grant(self, n: int) -> bool:
        return 0 <= n <= self.free

    def grant(
        self,
        n: int,
        holder: str,
        now: float,
        holder_pid: int | None = None,
        ttl_s: float | None = None,
        user: str = "",
        kernel_id: str = "",
    ) -> Lease | None:
        """Grant ``n`` GPUs now, or return None if they are not all free."""
        if n < 0:
            raise LeaseError("cannot grant a negative number of GPUs")
        if n > self.gpu_count:
            raise LeaseError(f"asked for {n} GPUs but this node has {self.gpu_count}")
        if n > self.free:
            return None
        busy = self.busy
        chosen = tuple(i for i in range(self.gpu_count) if i not in busy)[:n]
        lease_id = secrets.token_hex(8) if self.random_ids else f"l{next(self._ids)}"
        lease = Lease(
            lease_id=lease_id,
            holder=holder,
            gpus=chosen,
            granted_at=now,
            holder_pid=holder_pid,
            expires_at=None if ttl_s is None else now + ttl_s,
            user=user,
            kernel_id=kernel_id,
        )
        self.leases[lease_id] = lease
        return lease

    def linger(self, lease_id: str, pid: int, now: float) -> Lease | None:
        """The cell under ``lease_id`` is over and process ``pid`` keeps its GPUs warm until the
        holder's next cell, or until another grant needs them. None: no such lease."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.lingering_pid, lease.lingering_since = pid, now
        return lease

    def resume(self, lease_id: str, now: float) -> Lease | None:
        """The holder's next cell runs under its lingering lease. None: it was taken back."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.lingering_pid is None:
            return None
        lease.lingering_pid = lease.lingering_since = None
        lease.granted_at = now
        return lease

    def reclaimable(self, n: int, ending: Collection[str] = ()) -> list[Lease] | None:
        """The lingering leases to end so that ``n`` GPUs are free, longest lingering first ([] when
        they are free already); None when even ending every one would not free ``n``. ``ending``:
        leases being ended for another ask already, whose GPUs are that one's."""
        free = self.free
        taken: list[Lease] = []
        for lease in sorted((le for le in self.leases.values()
                             if le.lingering_pid is not None and le.lease_id not in ending),
                            key=lambda le: le.lingering_since or 0.0):
            if free >= n:
                break
            taken.append(lease)
            free += len(lease.gpus)
        return taken if free >= n else None

    def release(self, lease_id: str) -> Lease | None:
        """Release a lease. Idempotent: releasing an unknown or released lease returns None."""
        return self.leases.pop(lease_id, None)

    def release_holder(self, holder: str) -> list[Lease]:
        """Release every lease of one holder (its replica stopped)."""
        gone = [lease for lease in self.leases.values() if lease.holder == holder]
        for lease in gone:
            del self.leases[lease.lease_id]
        return gone

    def expire(self, now: float, holder_alive: Callable[[Lease], bool] = lambda lease: True) -> list[Lease]:
        """Drop leases whose time ran out or whose holder died; return them."""
        dead = [
            lease
            for lease in self.leases.values()
            if (lease.expires_at is not None and lease.expires_at <= now) or not holder_alive(lease)
        ]
        for lease in dead:
            del self.leases[lease.lease_id]
        return dead

    def subscription_ratio(self, replicas: int) -> float:
        """SR_h = pending / (G * R); a node without GPUs has ratio 0 for CPU-only replicas."""
        if self.gpu_count == 0:
            return 0.0
        return self.pending / (self.gpu_count * replicas)
