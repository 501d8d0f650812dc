"""The elastic GPU pool: how many servers stay active, which one is lent next, which comes back.

Pure logic, no clock of its own and no I/O: the scheduler's pool loop (gpuhub/scheduler/pool_loop.py)
and the simulator (gpuhub/sim/engine.py, ``--elastic``) drive the same :class:`PoolPolicy`, so
what the simulator reports is what the product does (docs/architecture.md, "Elastic pool").

A server is in one of these states:

``active``     takes replicas and grants GPUs;
``draining``   the pool wants to lend it: no new replica goes there, its replicas move away
               (a running cell finishes first), then it is released;
``lent``       released through the admin's hook (Slurm, IPMI, …): not ours until acquired;
``acquiring``  the acquire hook ran; it counts as provisioned until its agent heartbeats again;
``lost``       no heartbeat (the pool neither counts nor touches it).

The rule, evaluated every few seconds against the demand (GPUs granted now plus the GPUs of
cells waiting for one):

- keep ``demand + headroom_gpus`` GPUs in active (or coming) servers, and at least ``min_active``
  servers, at most ``max_active``; the replicas placed must also fit under the subscription ratio;
- keep ``spare_servers`` active servers (or coming ones) that could take a replica of the kernel
  with the largest request (``largest_request``: of the cells that ran or waited within
  ``spare_recent_s``, see :class:`RecentRequests`) under the
  subscription ratio and grant its cell now: idle GPUs scattered over busy
  servers cannot run a cell that needs many of them, and a spare can take it at once (migration
  prefers the fullest server that fits, so the spare stays free for such a cell);
- short of that: undrain draining servers first (free, instant), then acquire lent ones;
- a surplus that lasted ``release_after_s`` drains the server that is cheapest to empty (fewest
  replicas, nothing running), at most ``drain_step`` at a time; once it holds no replica and no
  lease it is released. Consolidation follows: draining servers take no replicas, so the replicas
  of a server being lent move onto servers that stay active.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

STATES = ("active", "draining", "lent", "acquiring", "lost")


class PoolSettingsError(ValueError):
    """Settings the pool cannot work with; the message names the setting."""


@dataclass(frozen=True)
class PoolSettings:
    min_active: int = 3  # never fewer active servers (at least a kernel's replicas)
    max_active: int = 0  # never more; 0: every server there is
    headroom_gpus: int = 0  # idle GPUs kept on beyond the demand, for cells that arrive
    spare_servers: int = 1  # active servers kept able to grant the largest request, for big cells
    release_after_s: float = 180.0  # a surplus must last this long before a server is drained
    spare_recent_s: float = 1200.0  # the spare is sized for requests of cells this recent
    drain_step: int = 2  # servers that may drain at once
    max_subscription_ratio: float = 7.0  # the placement limit (placement.py), for the replicas' room
    replicas: int = 3  # replicas per kernel (same)

    def check(self) -> PoolSettings:
        if self.min_active < 1:
            raise PoolSettingsError(f"pool_min_active must be at least 1, not {self.min_active}")
        if self.max_active and self.max_active < self.min_active:
            raise PoolSettingsError(f"pool_max_active ({self.max_active}) is below pool_min_active "
                                    f"({self.min_active})")
        if self.spare_servers < 0:
            raise PoolSettingsError(f"pool_spare_servers must not be negative, not {self.spare_servers}")
        if self.headroom_gpus < 0:
            raise PoolSettingsError(f"pool_headroom_gpus must not be negative, not {self.headroom_gpus}")
        if self.release_after_s < 0:
            raise PoolSettingsError(f"pool_release_after_s must not be negative, not {self.release_after_s}")
        if self.spare_recent_s < 0:
            raise PoolSettingsError(f"pool_spare_recent_s must not be negative, not {self.spare_recent_s}")
        if self.drain_step < 1:
            raise PoolSettingsError(f"pool_drain_step must be at least 1, not {self.drain_step}")
        return self


@dataclass(frozen=True)
class PoolServer:
    """What the pool knows of one server."""

    name: str
    gpu_count: int
    state: str  # one of STATES
    committed: int = 0  # GPUs granted there now
    pending: int = 0  # GPUs of the replicas placed there
    replicas: int = 0  # replicas placed there


@dataclass(frozen=True)
class PoolPlan:
    """What to do now; every list is in the order to do it. Empty: nothing."""

    acquire: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    wanted_gpus: int = 0  # GPUs the pool wants active now (demand + headroom, within the limits)

    def __bool__(self) -> bool:
        return bool(self.acquire or self.undrain or self.drain or self.release)


class RecentRequests:
    """The largest GPU request of a cell that ran or waited within the last ``window_s`` seconds:
    what the spare server is kept for. A kernel that asked for a whole server hours ago and has been
    idle since does not keep one on; its next cell waits for one undrain or acquire, and the spare
    stays while its cells keep coming."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.last: dict[int, float] = {}  # GPUs asked -> when a cell last asked for that many

    def note(self, gpus: int, now: float) -> None:
        if gpus > 0 and now >= self.last.get(gpus, now):
            self.last[gpus] = now

    def largest(self, now: float) -> int:
        """0 when no cell asked for a GPU within the window."""
        return max((g for g, t in self.last.items() if now - t <= self.window_s), default=0)


class PoolPolicy:
    """The pool rule with its memory: since when the surplus has lasted, and the recent cells'
    requests (its caller notes them, and passes ``recent.largest(now)`` to :meth:`plan`)."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings.check()
        self.surplus_since: float | None = None
        self.recent = RecentRequests(self.settings.spare_recent_s)

    def wanted_gpus(self, servers: Sequence[PoolServer], demand_gpus: int) -> int:
        """GPUs to keep active: the demand plus the headroom, and room for the replicas placed."""
        return self._wanted(demand_gpus, sum(v.pending for v in servers if v.state != "lost"))

    def _wanted(self, demand_gpus: int, pending: int) -> int:
        s = self.settings
        # A server takes replicas up to pending = ratio x GPUs x replicas (placement.py).
        return max(max(0, demand_gpus) + s.headroom_gpus, math.ceil(pending / (s.max_subscription_ratio * s.replicas)))

    def plan(self, servers: Sequence[PoolServer], demand_gpus: int, now: float,
             largest_request: int | None = None, lent: Collection[PoolServer] | None = None,
             min_servers: int = 0) -> PoolPlan:
        """What to do now, for ``demand_gpus`` GPUs granted or waiting; ``largest_request``: the most
        GPUs a kernel asks for per cell (None: a whole server). ``lent``, when given, lists the lent
        servers in the order to acquire them (largest first), and ``servers`` holds no lent one: a
        caller with many lent servers saves going through them at every decision. ``min_servers``
        raises ``min_active`` (the most replicas a kernel has: each needs a server of its own)."""
        s = self.settings
        least = max(s.min_active, min_servers)
        per_gpu = s.max_subscription_ratio * s.replicas  # pending a server may hold per GPU

        def can_spare(v: PoolServer) -> bool:
            """It could take a replica of the largest kernel and grant its cell now (migration.py)."""
            g = v.gpu_count
            need = g if largest_request is None or largest_request > g else largest_request
            return g - v.committed >= need and per_gpu * g - v.pending >= need

        # One pass over the servers (the simulator decides a million times a run): what each state
        # holds, the GPUs active or coming, the replicas' room, the spares.
        active: list[PoolServer] = []
        draining: list[PoolServer] = []
        coming: list[PoolServer] = []
        lent_here: list[PoolServer] = []
        have = pending = spare = 0
        smallest = -1  # the fewest GPUs of an active server
        for v in servers:
            state = v.state
            if state == "lost":
                continue
            pending += v.pending
            if state == "active":
                active.append(v)
                g = v.gpu_count
                have += g
                if smallest < 0 or g < smallest:
                    smallest = g
                spare += can_spare(v)
            elif state == "draining":
                draining.append(v)
            elif state == "acquiring":
                coming.append(v)
                have += v.gpu_count
            else:
                lent_here.append(v)
        total = len(servers)
        if lent is None:
            lent = sorted(lent_here, key=lambda v: (-v.gpu_count, v.name))
        else:
            total += len(lent)
        wanted = self._wanted(demand_gpus, pending)
        count = len(active) + len(coming)
        spare += len(coming)
        cap = s.max_active or total
        # Released: drained servers that hold nothing any more.
        release = tuple(v.name for v in draining if v.replicas == 0 and v.committed == 0)

        def enough() -> bool:
            return have >= wanted and count >= least and spare >= s.spare_servers

        if not enough():
            self.surplus_since = None
            undrain, acquire = [], []
            # The servers with the most replicas left first (they are the costliest to finish
            # draining); an empty one is still cheaper to keep than to release and acquire back.
            for v in sorted(draining, key=lambda v: (-v.replicas, v.name)):
                if enough() or count >= cap:
                    break
                if have >= wanted and count >= least and not can_spare(v):
                    continue  # only a spare is missing, and this one is not
                undrain.append(v.name)
                have += v.gpu_count
                count += 1
                spare += can_spare(v)
            # The largest lent servers first: fewest hooks to run for the GPUs wanted.
            for v in lent:
                if enough() or count >= cap:
                    break
                acquire.append(v.name)
                have += v.gpu_count
                count += 1
                spare += 1
            return PoolPlan(acquire=tuple(acquire), undrain=tuple(undrain),
                            release=tuple(n for n in release if n not in undrain), wanted_gpus=wanted)

        # Enough, maybe too much: drain what is surplus once the surplus has lasted.
        if count <= least or not active or have - smallest < wanted:
            self.surplus_since = None  # no server to spare (the common case: decided without a sort)
            return PoolPlan(release=release, wanted_gpus=wanted)
        drain: list[str] = []
        room = s.drain_step - sum(1 for v in draining if v.name not in release)
        cands = sorted(active, key=lambda v: (v.committed > 0, v.replicas, v.pending, v.committed, v.name))
        for v in cands:
            if len(drain) >= room or count - 1 < least or have - v.gpu_count < wanted:
                break
            if v.committed:
                break  # GPUs granted there: it empties by itself, and draining it would only idle it longer
            if spare - can_spare(v) < s.spare_servers:
                break  # the spare stays
            drain.append(v.name)
            have -= v.gpu_count
            count -= 1
            spare -= can_spare(v)
        if not drain:
            self.surplus_since = None
            return PoolPlan(release=release, wanted_gpus=wanted)
        if self.surplus_since is None:
            self.surplus_since = now
        if now - self.surplus_since < s.release_after_s:
            return PoolPlan(release=release, wanted_gpus=wanted)
        self.surplus_since = None  # the next drain waits for a surplus of its own
        return PoolPlan(drain=tuple(drain), release=release, wanted_gpus=wanted)
