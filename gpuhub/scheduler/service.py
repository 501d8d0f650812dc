"""The scheduler: knows the nodes (from agent heartbeats), places kernel replicas, keeps its books.

It never grants GPUs (the agents do, docs/architecture.md D1); it only places replicas, using the counts the
agents report. Its books are persisted, and rebuilt from the agents' units on start (D5).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from gpuhub.platform.config import ConfigError
from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.store import CorruptStore, JsonStore
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.metrics import kernel_start_histogram, migration_histogram
from gpuhub.scheduler.migration import Move, NoMigrationTarget, choose_target, plan_move
from gpuhub.scheduler.node_info import parse_counts, parse_node_info
from gpuhub.scheduler.node_tokens import AgentTokens
from gpuhub.scheduler.placement import NodeView, PlacementError, place_replicas
from gpuhub.scheduler.pool_loop import ElasticPool
from gpuhub.scheduler.quotas import LiveLease, QuotaPolicy, Quotas, UsageLedger

log = logging.getLogger(__name__)

KERNEL_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
REPLICA_SUFFIX = re.compile(r"-r(\d+)$")
# Unit states of a replica that is not running and will not come back by itself (systemd's
# Restart= shows "activating" while it restarts one; "gone": the agent no longer has the unit).
DEAD_UNIT_STATES = frozenset({"gone", "failed", "inactive"})
CHANGED_KEPT_S = 300.0  # how long a created or deleted kernel's id is remembered against stale unit listings
# A replica whose unit systemd has started again this often keeps failing there (a replica that
# cannot join its group exits after its ready timeout, 2 minutes, too slowly for systemd's start
# limit): it is replaced like a dead one.
REPLICA_RESTARTS_LOST = 3
# A migration asks at most this many candidate servers whether they can still grant.
MIGRATION_CANDIDATES = 3
# A drain that has waited this long for one replica's cell says so at WARNING, naming the user.
DRAIN_WAIT_WARN_S = 900.0
# Why a replica was not moved (Scheduler._fence), when the reason is not a running cell.
AGENT_SILENT = "could not be fenced (its agent did not answer)"
# How often a kernel that waits for servers' first heartbeats after a restart tries to place again.
UNHEARD_POLL_S = 0.2
# ... and for at most this long after the start (the provisioner gives a kernel creation 60 s).
UNHEARD_WAIT_MAX_S = 30.0


class UserLimitExceeded(PermissionError):
    """A user's new kernel would pass user_max_kernels or user_max_placed_gpus (403, with why)."""


def replica_unit(kernel_id: str, replica_id: int) -> str:
    return f"gpuhub-kernel-{kernel_id}-r{replica_id}"


@dataclass
class NodeRecord:
    name: str
    url: str
    info: dict  # the last heartbeat, as gpuhub/scheduler/node_info.py parsed it
    last_seen: float  # wall-clock time of the last heartbeat, for people (gpuhub nodes)
    # Set by an admin (gpuhub node drain): no new replica goes here, and the replicas here move away.
    drained: bool = False
    # The elastic pool's state of it (gpuhub/scheduler/pool_loop.py): "" (in service), "draining"
    # (to be lent: no new replica, its replicas move away), "lent", "acquiring"; and since when.
    pool: str = ""
    pool_since: float = 0.0
    # time.monotonic() of the last heartbeat: liveness must not move with the wall clock (a clock
    # step of a minute would count every server lost). From books: as long ago as last_seen says.
    seen: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.seen is None:
            self.seen = time.monotonic() - max(0.0, time.time() - self.last_seen)


@dataclass
class ReplicaRecord:
    node: str
    unit: str
    connection: dict | None = None  # from the agent: ip, 5 Jupyter ports, raft_port, blob_port, … (no key)
    id: int = -1  # the replica's id in the kernel's Raft group; books before replication: from "-r<i>"
    state: str = "unknown"  # the unit's state when the scheduler last asked its agent
    dead_since: float = 0.0  # when its unit was first seen dead (DEAD_UNIT_STATES); 0: not dead
    error: str | None = None  # a dead unit's last log lines, from its agent (why it exited)
    restarts: int = 0  # times systemd started the unit again after it failed, as its agent last said

    def note_state(self, state: str, now: float, error: str | None = None, restarts: int | None = None) -> None:
        """Record what the agent said; "unknown"/"unreachable" say nothing about the unit itself."""
        self.state = state
        if isinstance(restarts, int) and not isinstance(restarts, bool):
            self.restarts = restarts
        if state in DEAD_UNIT_STATES:
            self.dead_since = self.dead_since or now
            self.error = error or self.error
        elif state not in ("unknown", "unreachable"):
            self.dead_since = 0.0
            self.error = None

    def __post_init__(self) -> None:
        if self.id is None or self.id < 0:
            m = REPLICA_SUFFIX.search(self.unit)
            self.id = int(m.group(1)) if m else 0

    def peer(self) -> dict:
        """This replica's entry in its kernel's peers document (PUT /api/v1/units/{name}/peers)."""
        conn = self.connection or {}
        if "raft_port" not in conn or "blob_port" not in conn:
            raise ValueError(f"the agent of {self.node} reported no raft/blob ports for {self.unit} "
                             "(is it older than the scheduler?)")
        return {"id": self.id, "node": self.node, "raft": f"{conn['ip']}:{conn['raft_port']}",
                "blob": f"{conn['ip']}:{conn['blob_port']}", "connection": conn}


REPLICA_FIELDS = frozenset(f.name for f in fields(ReplicaRecord))


@dataclass
class KernelRecord:
    kernel_id: str
    user: str
    gpus: int
    replicas: list[ReplicaRecord] = field(default_factory=list)
    created_at: float = 0.0
    cwd: str = ""
    # The kernel's connection key, kept (books are 0600) to start a replacement replica; never in a view.
    key: str = field(default="", repr=False)
    peers_pending: bool = False  # a replacement's peers still have to reach every replica
    # This creation of the kernel id (a restart creates the kernel anew under its id): its replica
    # units carry it, so a unit of an earlier kernel under the id is told from the kernel's own.
    incarnation: str = ""

    def view(self) -> dict:
        v = asdict(self)
        del v["key"], v["peers_pending"], v["incarnation"]
        return v

    def books(self) -> dict:
        """Its entry in the books, without the incarnation, which the books keep beside the
        records, nor its replicas' restart counts (the agents say them again): releases before
        them read each with ``KernelRecord(**entry)`` and ``ReplicaRecord(**replica)`` (a rollback)."""
        v = asdict(self)
        del v["incarnation"]
        for r in v["replicas"]:
            del r["restarts"]
        return v

    @classmethod
    def from_books(cls, entry: dict, incarnation: str) -> KernelRecord:
        """The record :meth:`books` wrote; fields a later release added are left out (a rollback)."""
        known = {f.name for f in fields(cls)} - {"replicas", "incarnation"}  # given beside the entry
        reps = [ReplicaRecord(**{k: v for k, v in r.items() if k in REPLICA_FIELDS})
                for r in entry.get("replicas", [])]
        return cls(**{k: v for k, v in entry.items() if k in known}, replicas=reps, incarnation=incarnation)



@dataclass
class DrainWait:
    """A drain that waits for one replica's cell before it moves that replica."""

    replica: int  # the replica's id
    node: str  # its (drained) server
    since: float  # monotonic
    why: str = ""  # what the fence answered ("runs a CPU cell", …)


class Scheduler:
    def __init__(self, config: SchedulerConfig, agent_token: str | AgentTokens) -> None:
        """``agent_token``: what to present to the agents, one token for all or one per server."""
        self.config = config
        self.agent_tokens = agent_token if isinstance(agent_token, AgentTokens) else AgentTokens(agent_token)
        self.nodes: dict[str, NodeRecord] = {}
        self.kernels: dict[str, KernelRecord] = {}
        self.path = Path(config.state_dir) / "books.json"
        self.store = JsonStore(self.path)  # 0600: the books hold kernel keys
        self.counters = {"placements": 0, "placement_failures": 0, "replacements": 0, "migrations": 0,
                         "migration_failures": 0}
        self.kernel_start = kernel_start_histogram()
        self.migration_time = migration_histogram()
        self._moves: dict[str, str] = {}  # kernel -> the server a replica of it is moving to now
        self._last_migration: dict[str, float] = {}  # kernel -> when its last migration began (monotonic)
        self._tasks: set[asyncio.Task] = set()  # migrations under way
        self._placing: dict[str, list[str]] = {}  # kernel being created -> the servers chosen for it
        # kernel being created -> (its user, its GPUs, its creation): the id is taken from the first
        # request on, and it counts against its user's limits
        self._creating: dict[str, tuple[str, int, asyncio.Future]] = {}
        self.started = time.monotonic()
        # When the kernel's user (their Jupyter server) last asked about it, on the monotonic
        # clock: a kernel nobody asks about has lost its server (stop_orphaned_kernels).
        self._owner_heard: dict[str, float] = {}
        # kernel -> when its last creation or delete ended (monotonic; inf while it runs): a
        # reconcile's listing asked for before that shows its units as they were, and must not act
        # on them (a restart deletes the kernel and creates it anew under its id at once)
        self._units_changed: dict[str, float] = {}
        # (server, unit) -> kernel incarnation: a deleted kernel's replica whose server did not
        # answer the stop. Stopped when a reconcile finds it there, not adopted back.
        self._unstopped: dict[tuple[str, str], str] = {}
        self._heal_notes: dict[str, str] = {}  # kernel -> last reason it could not be healed (log once)
        # kernel -> the replica a drain fenced and waits for. The fence is kept while its cell
        # runs, so that the kernel's next cell runs on another replica.
        self._drain_waits: dict[str, DrainWait] = {}
        # Raises QuotaConfigError (a ValueError naming the setting) on limits it cannot use.
        self.quotas = Quotas(QuotaPolicy(config.quota_default, config.quota_groups, config.quota_users))
        problem = config.pool_problem()
        if problem:
            raise ValueError(problem)
        self.pool = ElasticPool(self) if config.pool_enabled else None

    # --- books -----------------------------------------------------------------
    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = {
            "nodes": {n: {"url": r.url, "info": r.info, "last_seen": r.last_seen, "drained": r.drained,
                          "pool": r.pool, "pool_since": r.pool_since}
                      for n, r in self.nodes.items()},
            "kernels": {k: r.books() for k, r in self.kernels.items()},
            "incarnations": {k: r.incarnation for k, r in self.kernels.items() if r.incarnation},
            "unstopped": [[node, unit, inc] for (node, unit), inc in self._unstopped.items()],
            "usage": self.quotas.ledger.to_dict(),
        }
        self.store.save(data)

    def load(self) -> None:
        try:
            data = self.store.load()
        except CorruptStore:
            log.error("books %s are corrupt; rebuilding from the agents", self.path)
            return
        if data is None:
            return
        for name, n in data.get("nodes", {}).items():
            try:  # books written before heartbeats were checked may hold one that breaks every view
                info = parse_node_info({**n["info"], "node": name, "url": n["url"]})
            except ValueError as exc:
                log.error("books: node %s dropped (%s); it is back with its next heartbeat", name, exc)
                continue
            self.nodes[name] = NodeRecord(name, n["url"], info, n["last_seen"], bool(n.get("drained", False)),
                                          str(n.get("pool", "")), float(n.get("pool_since", 0.0)))
        incarnations = data.get("incarnations", {})
        for kid, k in data.get("kernels", {}).items():
            self.kernels[kid] = KernelRecord.from_books(k, str(incarnations.get(kid, "")))
        self._unstopped = {(str(node), str(unit)): str(inc) for node, unit, inc in data.get("unstopped", [])}
        self.quotas.ledger = UsageLedger.from_dict(data.get("usage", {}))
        if self.pool is None or not self.pool.acts:  # no pool, or one that only reports: nothing is lent
            for rec in self.nodes.values():
                if rec.pool:
                    log.warning("node %s was %s by the elastic pool, which is off or only reports now: back in "
                                "service once its agent heartbeats", rec.name, rec.pool)
                    rec.pool = ""

    # --- nodes -----------------------------------------------------------------
    def heartbeat(self, info: dict) -> dict:
        """A server's heartbeat: its state, and the GPU-seconds its ended leases held. Answers with
        the usage batch it now has and the quotas of the users with kernels there."""
        if not isinstance(info, dict):
            raise ValueError("a heartbeat is a JSON object")
        usage = info.get("usage")
        info = parse_node_info(info)  # ValueError: nothing of it is kept
        name, url = info["node"], info["url"]
        answer: dict = {"ok": True}
        known = self.nodes.get(name)
        fresh = known is None
        now = time.time()
        if known is None:
            self.nodes[name] = NodeRecord(name, url, info, now, seen=time.monotonic())
        else:
            known.url, known.info, known.last_seen, known.seen = url, info, now, time.monotonic()
        if usage is not None:
            try:
                answer["usage_ack"] = self.quotas.ledger.apply(name, usage)
            except ValueError as exc:  # the server stays live; the agent drops what cannot be counted
                log.error("node %s sent a usage batch that cannot be counted: %s", name, exc)
                answer["usage_error"] = str(exc)
        if fresh:
            log.info("node %s registered (%s GPU(s)) at %s", name, info.get("gpu_count"), url)
        if fresh or usage is not None:
            self.quotas.ledger.prune(now)
            self.save()  # before the answer: an acknowledged batch is in the books
        if self.quotas.policy.enabled:
            users = {k.user for k in self.kernels.values() if any(r.node == name for r in k.replicas)}
            answer["quotas"] = self.quotas.node_view(name, users, now, self.live_leases())
        return answer

    def live_leases(self) -> list[LiveLease]:
        """Every GPU lease a cell runs under on the live servers (as their last heartbeats said),
        with its user. Lingering leases are not: no cell runs, and quotas count cells' GPUs."""
        out = []
        by_unit: dict[str, KernelRecord] | None = None
        for rec in self.nodes.values():
            if not self.live(rec):
                continue
            for le in rec.info.get("leases") or ():
                try:
                    if le.get("lingering_pid"):
                        continue
                    kernel_id = le.get("kernel_id") or ""
                    user = le.get("user") or ""
                    if not user:  # an agent from before quotas: the holder unit's kernel in the books
                        if by_unit is None:
                            by_unit = {r.unit: k for k in self.kernels.values() for r in k.replicas}
                        k = by_unit.get(le.get("holder"))
                        kernel_id, user = (k.kernel_id, k.user) if k else ("", "")
                    out.append(LiveLease(rec.name, user, kernel_id, len(le["gpus"]), float(le["granted_at"])))
                except (AttributeError, KeyError, TypeError, ValueError):
                    continue  # not a lease; the agent's own view is what counts for its GPUs
        return out

    def quota_status(self, user: str) -> dict:
        return self.quotas.status(user, time.time(), self.live_leases())

    def quota_statuses(self) -> list[dict]:
        now, leases = time.time(), self.live_leases()
        owners = {k.user for k in self.kernels.values()}
        return [self.quotas.status(u, now, leases) for u in self.quotas.users(now, leases, owners)]

    def grant_extra_hours(self, user: str, hours: float) -> dict:
        total = self.quotas.ledger.add_extra(user, hours, time.time())
        self.save()
        log.info("%g extra GPU-hour(s) for %s this week (%g in all)", hours, user, total)
        return self.quota_status(user)

    def set_drained(self, name: str, drained: bool) -> NodeRecord:
        """Drain a server (no new replicas; heal moves its replicas away, one per kernel at a time)
        or put it back in service. KeyError: no such server."""
        rec = self.nodes[name]
        if drained and not rec.drained:
            self._check_drainable(name)
        if rec.drained != drained:
            rec.drained = drained
            self.save()
            log.info("node %s %s", name, "drained: its replicas move to other servers" if drained
                     else "back in service")
        return rec

    def _check_drainable(self, name: str) -> None:
        """ValueError, naming a kernel, when draining ``name`` would leave one of the kernels there
        nowhere to move its replica: fewer other schedulable servers than its replicas need."""
        others = {v.name for v in self.node_views() if v.schedulable and v.name != name}
        for k in self.kernels.values():
            nodes = {r.node for r in k.replicas}
            if name in nodes and not others - nodes:
                raise ValueError(f"draining {name} would leave kernel {k.kernel_id} ({k.user}) no server to move "
                                 f"its replica to: its other replicas hold every other schedulable server "
                                 f"({len(others)}); add a server or undrain one first")

    def busy_targets(self) -> set[str]:
        """Servers a replica is on its way to: chosen for a kernel being created, or a move's target."""
        return {n for nodes in self._placing.values() for n in nodes} | {t for t in self._moves.values() if t}

    def live(self, rec: NodeRecord) -> bool:
        return time.monotonic() - rec.seen <= self.config.node_timeout_s

    def node_views(self) -> list[NodeView]:
        return [self.node_view(r) for r in self.nodes.values()]

    def node_view(self, r: NodeRecord) -> NodeView:
        return NodeView(
            name=r.name,
            gpu_count=int(r.info.get("gpu_count", 0)),
            pending=int(r.info.get("pending", 0)),
            committed=int(r.info.get("committed", 0)),
            schedulable=self.live(r) and self._may_place(r),
        )

    @staticmethod
    def _may_place(r: NodeRecord) -> bool:
        """Whether replicas may go to this server when it is live: a GPU server, not drained, not
        the elastic pool's (lent, being acquired or drained to be lent)."""
        return "gpu" in r.info.get("roles", ["gpu"]) and not r.drained and not r.pool

    async def ask_node(self, name: str) -> dict | None:
        """A server's state as its agent says it now (``GET /api/v1/node``), its GPU counts kept in
        the books until the next heartbeat; None when it is unknown or does not answer."""
        node = self.nodes.get(name)
        if node is None:
            return None
        try:
            _, info = await self.call_agent(node, "GET", "/api/v1/node", timeout=5)
        except ApiClientError as exc:
            log.debug("server %s did not answer: %s", name, exc)
            return None
        if not isinstance(info, dict):
            return None
        node.info.update(parse_counts(info))
        return info

    def _kernels_by_node(self) -> dict[str, list[KernelRecord]]:
        placed: dict[str, list[KernelRecord]] = {}
        for k in self.kernels.values():
            for rep in k.replicas:
                placed.setdefault(rep.node, []).append(k)
        return placed

    def node_states(self) -> dict[str, str]:
        """Each server's state (``node_state``), by name."""
        placed = self._kernels_by_node()
        return {r.name: self.node_state(r, len(placed.get(r.name, ()))) for r in self.nodes.values()}

    def nodes_view(self) -> list[dict]:
        placed = self._kernels_by_node()
        now = time.monotonic()
        waits: dict[str, list[dict]] = {}  # server -> the cells its drain waits for
        for kid, w in self._drain_waits.items():
            if kid in self.kernels:
                waits.setdefault(w.node, []).append({"kernel_id": kid, "user": self.kernels[kid].user,
                                                     "why": w.why, "waited_s": round(now - w.since, 1)})
        return [
            {"node": r.name, "url": r.url, "live": self.live(r), "last_seen": r.last_seen, "drained": r.drained,
             "state": self.node_state(r, len(placed.get(r.name, ()))),
             "kernel_replicas": len(placed.get(r.name, ())),
             "drain_waits": waits.get(r.name, []),
             # each kernel's GPUs once over this server's GPUs (pending / (GPUs x R) for R replicas each)
             "subscription_ratio": round(sum(k.gpus / len(k.replicas) for k in placed.get(r.name, ()))
                                         / r.info["gpu_count"], 3) if r.info.get("gpu_count") else 0.0,
             **{k: r.info.get(k)
                for k in ("gpu_count", "pending", "committed", "gpu_backend", "roles", "units", "leases", "version",
                          "release")}}
            for r in self.nodes.values()
        ]

    def node_state(self, rec: NodeRecord, replicas: int) -> str:
        """active, draining (drained, replicas still there), drained, lent or acquiring (the elastic
        pool's), or lost (no heartbeat)."""
        if rec.pool in ("lent", "acquiring"):
            return rec.pool
        if not self.live(rec):
            return "lost"
        if rec.drained or rec.pool == "draining":
            return "draining" if replicas or rec.pool == "draining" else "drained"
        return "active"

    # --- kernels ---------------------------------------------------------------
    async def create_kernel(self, user: str, kernel_id: str, key: str, gpus: int, replicas: int,
                            cwd: str) -> KernelRecord:
        if not KERNEL_ID.match(kernel_id):
            raise ValueError("kernel_id must be 1-64 lowercase letters, digits or '-'")
        if kernel_id in self.kernels:
            existing = self.kernels[kernel_id]
            if existing.user != user:
                raise PermissionError("that kernel belongs to another user")
            return existing
        if kernel_id in self._creating:  # taken by a request still placing it
            owner, _, creation = self._creating[kernel_id]
            if owner != user:
                raise PermissionError("that kernel belongs to another user")
            return await asyncio.shield(creation)  # the same request again (a retry): its answer
        self.check_user_limits(user, gpus)  # before the id is taken: no await in between
        creation = asyncio.get_running_loop().create_future()
        self._creating[kernel_id] = (user, gpus, creation)
        try:
            record = await self._create_kernel(user, kernel_id, key, gpus, replicas, cwd)
        except asyncio.CancelledError:
            creation.cancel()
            raise
        except Exception as exc:
            creation.set_exception(exc)
            creation.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        else:
            creation.set_result(record)
            return record
        finally:
            del self._creating[kernel_id]

    def check_user_limits(self, user: str, gpus: int) -> None:
        """A new kernel of ``user`` asking for ``gpus``: ValueError past kernel_max_gpus,
        UserLimitExceeded past the user's kernel or placed-GPU limit (kernels being created count)."""
        cfg = self.config
        if cfg.kernel_max_gpus and gpus > cfg.kernel_max_gpus:
            raise ValueError(f"a kernel may have at most {cfg.kernel_max_gpus} GPU(s), not {gpus} "
                             "(kernel_max_gpus: the largest profile's)")
        held = [k.gpus for k in self.kernels.values() if k.user == user]
        held += [g for owner, g, _ in self._creating.values() if owner == user]
        if cfg.user_max_kernels and len(held) >= cfg.user_max_kernels:
            raise UserLimitExceeded(f"{user} has {len(held)} kernel(s), the most one user may have at once "
                                    f"(user_max_kernels); shut one down first")
        if cfg.user_max_placed_gpus and sum(held) + gpus > cfg.user_max_placed_gpus:
            raise UserLimitExceeded(f"{user}'s kernels have {sum(held)} GPU(s); {gpus} more would pass the "
                                    f"{cfg.user_max_placed_gpus} one user's kernels may have together "
                                    "(user_max_placed_gpus); shut one down first")

    async def _create_kernel(self, user: str, kernel_id: str, key: str, gpus: int, replicas: int,
                             cwd: str) -> KernelRecord:
        started = time.monotonic()
        try:
            chosen = await self._place(kernel_id, gpus, replicas)
        except PlacementError:
            self.counters["placement_failures"] += 1
            if self.pool is not None:  # a kernel no active server set can take: the pool needs a server
                self.pool.placement_failed(kernel_id)
            raise
        record = KernelRecord(kernel_id=kernel_id, user=user, gpus=gpus, created_at=time.time(), cwd=cwd, key=key,
                              incarnation=secrets.token_hex(8))
        self._placing[kernel_id] = [n.name for n in chosen]  # the pool releases none of them meanwhile
        self._units_changed[kernel_id] = math.inf
        try:
            return await self._start_kernel(record, chosen, key, cwd, started)
        finally:
            self._placing.pop(kernel_id, None)
            self._units_changed[kernel_id] = time.monotonic()

    async def _place(self, kernel_id: str, gpus: int, replicas: int) -> list[NodeView]:
        """The servers for a new kernel's replicas (gpuhub/scheduler/placement.py). Right after a
        restart, servers in the books that have not sent a heartbeat since are not live yet (a
        restore brings back books minutes old): a kernel that does not fit without them waits for
        them, for at most the start-up grace that healing also gives them, instead of failing."""
        said, grace = False, min(self.config.node_timeout_s, UNHEARD_WAIT_MAX_S)
        while True:
            try:
                # With the elastic pool, consolidate: the servers that stay busy take the replicas.
                return place_replicas(self.node_views(), gpus, replicas, self.config.max_subscription_ratio,
                                      pack=self.pool is not None)
            except PlacementError:
                unheard = sorted(r.name for r in self.nodes.values() if r.seen < self.started and self._may_place(r))
                if not unheard or time.monotonic() - self.started >= grace:
                    raise
                if not said:
                    log.info("kernel %s waits for the first heartbeat of %s since the scheduler started",
                             kernel_id, ", ".join(unheard))
                    said = True
                await asyncio.sleep(UNHEARD_POLL_S)

    async def _start_kernel(self, record: KernelRecord, chosen: list[NodeView], key: str, cwd: str,
                            started: float) -> KernelRecord:
        kernel_id, user = record.kernel_id, record.user
        # The replicas start at once, each on its own server: a kernel starts in the time of the
        # slowest unit start, not of all three in a row.
        started_units = await asyncio.gather(
            *(self._start_replica(record, i, node.name, key, cwd) for i, node in enumerate(chosen)),
            return_exceptions=True)
        record.replicas = [r for r in started_units if isinstance(r, ReplicaRecord)]
        failed = next((r for r in started_units if isinstance(r, BaseException)), None)
        try:
            if failed is not None:
                raise failed
            # Only now are all addresses known: every replica learns the whole group.
            await self._send_peers(record)
        except ApiClientError:
            self.counters["placement_failures"] += 1
            for rep in record.replicas:  # all or nothing
                await self._stop_for_good(rep, record.incarnation)
            raise
        self.kernels[kernel_id] = record
        self.heard_from_owner(kernel_id)
        self.counters["placements"] += 1
        self.kernel_start.observe(time.monotonic() - started)
        self.save()
        log.info("kernel %s of %s placed on %s", kernel_id, user, ", ".join(r.node for r in record.replicas))
        return record

    async def _start_replica(self, record: KernelRecord, replica_id: int, node: str, key: str,
                             cwd: str) -> ReplicaRecord:
        """Start one replica unit; its peers come later (:meth:`_send_peers`)."""
        unit = replica_unit(record.kernel_id, replica_id)
        body = {"name": unit, "kind": "kernel", "user": record.user, "gpus": record.gpus, "cwd": cwd,
                "kernel": {"key": key, "kernel_id": record.kernel_id, "replica_id": replica_id,
                           "incarnation": record.incarnation}}
        if self.quotas.policy.enabled and record.gpus:
            # The user's limits go with the unit: its agent enforces them from the first cell on,
            # not from its next heartbeat (a new kernel per cell must not escape a quota).
            body["quotas"] = self.quotas.node_view(node, {record.user}, time.time(), self.live_leases())
        _, started = await self.call_agent(self.nodes[node], "POST", "/api/v1/units", body)
        # Count it now so the next placement sees it before the next heartbeat.
        self.nodes[node].info["pending"] = int(self.nodes[node].info.get("pending", 0)) + record.gpus
        return ReplicaRecord(node, unit, started.get("connection"), id=replica_id,
                             state=started.get("state", "unknown"))

    def peers_document(self, record: KernelRecord) -> dict:
        return {"replicas": [rep.peer() for rep in sorted(record.replicas, key=lambda r: r.id)]}

    async def _send_peers(self, record: KernelRecord) -> None:
        """PUT the whole group (every replica, itself included) to every replica's agent.

        Idempotent: after replacing a replica (a new node, new addresses), call it again and every
        replica's peers.json is rewritten. Raises ApiClientError if an agent refuses or is down.
        """
        try:
            doc = self.peers_document(record)
        except ValueError as exc:
            raise ApiClientError(502, str(exc), "") from None
        for rep in record.replicas:
            node = self.nodes.get(rep.node)
            if node is None:
                raise ApiClientError(0, f"node {rep.node} is unknown to the scheduler", rep.node)
            await self.call_agent(node, "PUT", f"/api/v1/units/{rep.unit}/peers", doc)

    # --- healing: a replacement for a lost replica (docs/architecture.md, lost replicas) ------------------------------
    async def call_agent(self, node: NodeRecord, method: str, path: str, body=None, timeout: float = 20.0):
        """``method path`` on ``node``'s agent with that agent's token: (status, JSON answer).
        ApiClientError when it fails, also when the scheduler holds no token for that agent."""
        try:
            token = self.agent_tokens.for_node(node.name)
        except ConfigError as exc:
            raise ApiClientError(0, str(exc), node.url) from None
        return await call_json(method, node.url + path, token, body, timeout=timeout)

    def node_live(self, name: str) -> bool:
        node = self.nodes.get(name)
        return node is not None and self.live(node)

    def _drained(self, node: str) -> bool:
        """Drained by an admin or by the elastic pool: its replicas move away."""
        rec = self.nodes.get(node)
        return bool(rec and (rec.drained or rec.pool == "draining"))

    def why_lost(self, rep: ReplicaRecord, now: float) -> str | None:
        """Why ``rep`` needs a replacement, or None. Its node stopped heartbeating, or its unit has
        been dead on a live node for ``replica_dead_grace_s`` (a node that rebooted within the node
        timeout comes back without its transient units; a replica may crash and exhaust systemd's
        restarts). The grace covers a kernel shutdown: replicas exit just before the kernel is
        deleted."""
        if not self.node_live(rep.node):
            return f"node {rep.node} was lost"
        if rep.dead_since and now - rep.dead_since >= self.config.replica_dead_grace_s:
            return f"its unit on {rep.node} is {rep.state}"
        if rep.restarts >= REPLICA_RESTARTS_LOST:
            return f"its unit on {rep.node} failed and was restarted {rep.restarts} times"
        return None

    async def heal(self) -> None:
        """Replace every lost replica (see :meth:`why_lost`) with a new one.

        The survivors keep the kernel working meanwhile (a Raft majority); the new replica joins
        their group and catches up from a snapshot plus the log. Without a majority nothing is
        replaced: the group could not commit the membership change.
        """
        if time.monotonic() - self.started < self.config.node_timeout_s:
            return  # after a restart every node gets one heartbeat period before it counts as lost
        now = time.time()
        for record in list(self.kernels.values()):
            if record.kernel_id in self._moves:
                continue  # a migration changes its group now
            if record.peers_pending:
                await self._resend_peers(record)
            lost = [(r, why) for r in record.replicas if (why := self.why_lost(r, now))]
            if lost:
                await self._replace_lost(record, lost)
                continue
            # A drain moves one replica of a kernel per pass, and only a kernel with nothing lost and
            # its last group change sent, so each move is one membership change of a full group.
            draining = [r for r in record.replicas if self._drained(r.node)]
            await self._lift_drain_fence(record, draining[0] if draining else None)
            if not draining or record.peers_pending:
                continue
            await self._drain_one(record, draining[0])

    async def _drain_one(self, record: KernelRecord, rep: ReplicaRecord) -> None:
        """Move ``rep`` off its drained server, unless its cell runs: then it is left to finish it,
        fenced meanwhile so that the kernel's next cell runs on another replica (a notebook that
        runs cells back to back would otherwise hold the drain up for as long as it runs)."""
        why = await self._fence(rep)
        if why is None:
            self._drain_waits.pop(record.kernel_id, None)
            if not await self._replace_lost(record, [(rep, f"node {rep.node} is drained")]):
                await self._unfence(rep)
            return
        wait = self._drain_waits.get(record.kernel_id)
        if wait is None or wait.replica != rep.id:
            wait = self._drain_waits[record.kernel_id] = DrainWait(rep.id, rep.node, time.monotonic())
        wait.why = why
        if time.monotonic() - wait.since < DRAIN_WAIT_WARN_S:
            then = "tried again at the next pass" if why == AGENT_SILENT else "it moves once the cell has ended"
            self._note(record, f"its replica on {rep.node} {why}: {then}", logging.INFO)
        else:
            self._note(record, f"the drain of {rep.node} has waited over {DRAIN_WAIT_WARN_S / 60:.0f} min for "
                               f"this kernel of {record.user}: its replica there {why} (the user can interrupt "
                               "the cell; deleting the kernel ends the wait)")

    async def _lift_drain_fence(self, record: KernelRecord, draining: ReplicaRecord | None) -> None:
        """The fence a drain held on a replica of ``record`` while its cell ran goes once that replica
        is no longer the one to move (its server was put back in service, or it left the group)."""
        held = self._drain_waits.get(record.kernel_id)
        if held is None or (draining is not None and draining.id == held.replica):
            return
        del self._drain_waits[record.kernel_id]
        rep = next((r for r in record.replicas if r.id == held.replica), None)
        if rep is not None:
            await self._unfence(rep)

    def _note(self, record: KernelRecord, why: str, level: int = logging.WARNING) -> None:
        if self._heal_notes.get(record.kernel_id) != why:
            self._heal_notes[record.kernel_id] = why
            log.log(level, "kernel %s: %s", record.kernel_id, why)

    async def _replace_lost(self, record: KernelRecord, lost: list[tuple[ReplicaRecord, str]]) -> bool:
        """Whether every replica in ``lost`` was replaced."""
        alive = len(record.replicas) - len(lost)
        if 2 * alive <= len(record.replicas):
            self._note(record, f"only {alive} of {len(record.replicas)} replicas are running; "
                               "without a majority its replicas cannot be replaced")
            return False
        if not record.key:
            self._note(record, "its key is not in the books (placed by an older scheduler); "
                               "lost replicas cannot be replaced")
            return False
        for rep, why in lost:
            # Never two replicas on one node; the node of a replica whose unit died may take the new
            # one, that of one that kept failing there only when no other can.
            others = [r.node for r in record.replicas if r is not rep and self.why_lost(r, time.time()) is None]
            tries = [[*others, rep.node], others] if rep.restarts >= REPLICA_RESTARTS_LOST else [others]
            for exclude in tries:
                try:
                    target = place_replicas(self.node_views(), record.gpus, len(record.replicas),
                                            self.config.max_subscription_ratio, exclude=exclude, count=1,
                                            pack=self.pool is not None)[0]
                    break
                except PlacementError as exc:
                    failed = exc
            else:
                self._note(record, f"replica {rep.id} ({why}) cannot be replaced yet: {failed}")
                return False
            if not await self._move_replica(record, rep, target.name, why):
                return False
        return True

    async def _move_replica(self, record: KernelRecord, rep: ReplicaRecord, target: str, why: str) -> bool:
        """Replace ``rep`` by a new replica on ``target``: start it, put it in the books in ``rep``'s
        place, stop ``rep`` if its server is there, and tell the group (a Raft membership change:
        the new replica catches up from its peers). False, with a note, when the new one did not start."""
        self._moves[record.kernel_id] = target
        try:
            new_id = max(r.id for r in record.replicas) + 1
            try:
                new = await self._start_replica(record, new_id, target, record.key, record.cwd)
            except ApiClientError as exc:
                self._note(record, f"starting a replacement for replica {rep.id} on {target} failed: {exc}")
                return False
            if self.kernels.get(record.kernel_id) is not record:  # shut down meanwhile
                await self._stop_replica(new)
                return False
            record.replicas = [r for r in record.replicas if r is not rep] + [new]
            record.peers_pending = True
            self.counters["replacements"] += 1
            self._heal_notes.pop(record.kernel_id, None)
            self.save()
            log.info("kernel %s: replica %d replaced (%s) by replica %d on %s",
                     record.kernel_id, rep.id, why, new.id, new.node)
            # The group first (its leader swaps the members at once; a cell may wait for the new
            # one), then the old unit, its files and journal, on a node that is still there.
            await self._resend_peers(record)
            if self.node_live(rep.node):
                await self._stop_replica(rep)
            return True
        finally:
            self._moves.pop(record.kernel_id, None)

    # --- migration: a waiting cell's kernel moves to a server that can grant (docs/architecture.md) --------
    async def migrate(self, kernel_id: str, asking_node: str) -> dict:
        """A cell of ``kernel_id`` waits because none of its servers can grant its GPUs (its agent on
        ``asking_node`` asks on its behalf). Begin moving one replica to a server that can grant
        now and answer at once: ``{"target", "replica", "moving"}``; the move runs in the background
        (the new replica joins the group and, once the router hands it the waiting cell, runs it).

        KeyError: no such kernel. PermissionError: ``asking_node`` holds none of its replicas.
        NoMigrationTarget: no server can take it now (the cell keeps waiting; ask again later)."""
        record = self.kernels.get(kernel_id)
        if record is None:
            raise KeyError(kernel_id)
        if not any(r.node == asking_node for r in record.replicas):
            raise PermissionError(f"server {asking_node} holds no replica of kernel {kernel_id}")
        moving = self._moves.get(kernel_id)
        if moving:
            return {"target": moving, "moving": True, "started": False}
        if moving is not None:
            raise NoMigrationTarget("a server for it is being chosen")
        if record.peers_pending:
            raise NoMigrationTarget("the kernel's last group change is still being sent to its replicas")
        now = time.time()
        if any(self.why_lost(r, now) for r in record.replicas):
            raise NoMigrationTarget("a replica of the kernel is lost and is being replaced first")
        last = self._last_migration.get(kernel_id)
        if last is not None and time.monotonic() - last < self.config.migration_interval_s:
            raise NoMigrationTarget(f"the kernel moved less than {self.config.migration_interval_s:g} s ago")
        self._moves[kernel_id] = ""  # one move at a time, from now on: the choice awaits the agents
        try:
            # Moving a replica takes it out of the group for a while: with another one down, the
            # group would lose its majority. Every unit must be running, as its agent says now.
            await asyncio.gather(*(self._refresh_state(r) for r in record.replicas))
            down = [r for r in record.replicas if r.state != "active"]
            if down:
                raise NoMigrationTarget(f"replica {down[0].id} on {down[0].node} is {down[0].state}; "
                                        "a kernel moves only while all its replicas run")
            await self._check_all_busy(record)
            try:
                move = await self._fresh_move(record)
            except NoMigrationTarget:
                if self.pool is not None:  # a cell waits that no active server can take: demand
                    self.pool.cell_waits(kernel_id, record.gpus)
                raise
        except BaseException:
            self._moves.pop(kernel_id, None)
            raise
        if self.pool is not None:
            self.pool.cell_placed(kernel_id)
        rep = next(r for r in record.replicas if r.id == move.replica)
        self._last_migration[kernel_id] = time.monotonic()
        self._moves[kernel_id] = move.target.name
        log.info("kernel %s: no server of its replicas can grant %d GPU(s): moving replica %d from %s to %s",
                 kernel_id, record.gpus, rep.id, rep.node, move.target.name)
        task = asyncio.ensure_future(self._migrate(record, rep, move.target.name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return {"target": move.target.name, "replica": rep.id, "moving": True, "started": True}

    async def _check_all_busy(self, record: KernelRecord) -> None:
        """NoMigrationTarget unless every server of the kernel is too busy to grant its GPUs now,
        as their agents say now: the ask comes with a lease token that user code can read, and a
        move restarts a replica, so a kernel that is not waiting must not move at will."""
        async def idle(rep: ReplicaRecord) -> int:
            info = await self.ask_node(rep.node)
            if info is None:
                return 0  # unknown, or not answering: it cannot grant either
            return int(info.get("gpu_count", 0)) - int(info.get("committed", 0))

        free = await asyncio.gather(*(idle(r) for r in record.replicas))
        for rep, n in zip(record.replicas, free, strict=True):
            if n >= record.gpus:
                raise NoMigrationTarget(f"{rep.node} can grant {record.gpus} GPU(s) now ({n} idle): no need to move")

    async def _fresh_move(self, record: KernelRecord) -> Move:
        """The move the policy (gpuhub/scheduler/migration.py) makes, with each candidate server's
        counts asked of its agent now (heartbeats may be seconds old): the best target that can
        still grant. NoMigrationTarget when none can."""
        views = {v.name: v for v in self.node_views()}
        placed = [(r.id, views[r.node]) for r in record.replicas if r.node in views]
        moves = plan_move(list(views.values()), placed, record.gpus, self.config.max_subscription_ratio,
                          limit=MIGRATION_CANDIDATES)
        for move in moves:
            if await self.ask_node(move.target.name) is None:
                continue
            view = self.node_view(self.nodes[move.target.name])
            if choose_target([view], record.gpus, len(record.replicas), self.config.max_subscription_ratio,
                             exclude=[r.node for r in record.replicas]):
                return Move(move.replica, move.source, view)
        raise NoMigrationTarget(f"none of the {len(moves)} server(s) that had {record.gpus} idle GPU(s) "
                                "can grant them now")

    async def _migrate(self, record: KernelRecord, rep: ReplicaRecord, target: str) -> None:
        started = time.monotonic()
        why = await self._fence(rep)
        if why is not None:
            log.info("kernel %s: replica %d on %s %s: no move", record.kernel_id, rep.id, rep.node, why)
            await self._unfence(rep)
            self._moves.pop(record.kernel_id, None)
            return
        try:
            moved = await self._move_replica(record, rep, target, f"a cell waits for a GPU; {target} has one")
        except Exception:  # a background task: say what went wrong, never lose it silently
            log.exception("kernel %s: moving replica %d to %s failed", record.kernel_id, rep.id, target)
            moved = False
        if moved:
            self.counters["migrations"] += 1
            self.migration_time.observe(time.monotonic() - started)
        else:
            self.counters["migration_failures"] += 1
            await self._unfence(rep)

    async def _fence(self, rep: ReplicaRecord) -> str | None:
        """Before a migration or a drain takes ``rep`` out of the group: its agent grants it no more
        GPUs and tells it to start no CPU cell, and says whether it holds GPUs or runs a CPU cell
        now (gpuhub/platform/move_fence.py). None: fenced, and no cell runs there, so it may move.
        Else why not: it runs a cell, or may have been elected to run the waiting one since the
        move was decided (a group that lost its executor would abort the cell); or its agent did
        not answer, and a CPU cell needs no agent to run (a lost server is replaced by heal, not
        moved). The caller lifts the fence or keeps it."""
        answer = await self._call_unit(rep, "POST", "/fence", "fence (before moving it)")
        if not answer:
            return AGENT_SILENT
        if answer.get("leases"):
            return "runs a GPU cell"
        if answer.get("executing"):
            return "runs a CPU cell"
        return None

    async def _unfence(self, rep: ReplicaRecord) -> None:
        await self._call_unit(rep, "DELETE", "/fence", "lift the fence (it lapses by itself in minutes) of")

    async def _call_unit(self, rep: ReplicaRecord, method: str, suffix: str, what: str) -> dict | None:
        """``method /api/v1/units/<rep's unit><suffix>`` on the agent of ``rep``'s server: its
        answer, or None when the server is gone from the books or the call failed (logged: "could
        not <what> <unit>")."""
        node = self.nodes.get(rep.node)
        if node is None:
            return None
        try:
            return (await self.call_agent(node, method, f"/api/v1/units/{rep.unit}{suffix}"))[1]
        except ApiClientError as exc:
            log.warning("could not %s %s on %s: %s", what, rep.unit, rep.node, exc)
            return None

    async def _resend_peers(self, record: KernelRecord) -> None:
        try:
            await self._send_peers(record)
        except ApiClientError as exc:
            self._note(record, f"could not tell every replica its new group yet: {exc}")
            return
        record.peers_pending = False
        self.save()

    async def _stop_replica(self, rep: ReplicaRecord) -> bool:
        """Stop ``rep``'s unit; False if its server is gone from the books or did not answer."""
        return await self._call_unit(rep, "DELETE", "", "stop") is not None

    async def _stop_for_good(self, rep: ReplicaRecord, incarnation: str) -> None:
        """Stop a replica of a kernel leaving the books; one whose server did not answer is stopped
        when a reconcile finds it (:attr:`_unstopped`), or it would bring the kernel back."""
        if await self._stop_replica(rep):
            self._unstopped.pop((rep.node, rep.unit), None)
        elif rep.node in self.nodes:
            self._unstopped[(rep.node, rep.unit)] = incarnation

    def heard_from_owner(self, kernel_id: str) -> None:
        """The kernel's user asked about it (their server polls it while it runs)."""
        if kernel_id in self.kernels:
            self._owner_heard[kernel_id] = time.monotonic()

    async def stop_orphaned_kernels(self) -> None:
        """Stop the kernels whose user's server has not asked about them for kernel_orphan_after_s:
        that server crashed or its host was lost, and nothing else would ever stop them (their
        replicas would hold their placements, and their GPU share, for good)."""
        limit = self.config.kernel_orphan_after_s
        if not limit:
            return
        now = time.monotonic()
        for kid, rec in list(self.kernels.items()):
            if kid in self._creating:
                continue
            heard = self._owner_heard.setdefault(kid, now)  # loaded or adopted: a whole grace from now
            if now - heard > limit:
                log.warning("kernel %s of %s: its server has not asked about it for %.0f s (the server is gone); "
                            "stopping it", kid, rec.user, now - heard)
                await self.delete_kernel(kid)

    async def delete_kernel(self, kernel_id: str) -> bool:
        self._units_changed[kernel_id] = math.inf  # until its units are stopped: listings show them meanwhile
        try:
            record = self.kernels.pop(kernel_id, None)
            self._last_migration.pop(kernel_id, None)
            self._drain_waits.pop(kernel_id, None)
            self._owner_heard.pop(kernel_id, None)
            if record is None:
                return False
            for rep in record.replicas:
                await self._stop_for_good(rep, record.incarnation)
            self.save()
            log.info("kernel %s stopped", kernel_id)
            return True
        finally:
            self._units_changed[kernel_id] = time.monotonic()

    async def kernel_status(self, kernel_id: str) -> dict | None:
        record = self.kernels.get(kernel_id)
        if record is None:
            return None
        await asyncio.gather(*(self._refresh_state(rep) for rep in record.replicas))
        return record.view()

    async def _refresh_state(self, rep: ReplicaRecord) -> None:
        node = self.nodes.get(rep.node)
        if node is None:
            rep.state = "unknown"
            return
        try:
            _, unit = await self.call_agent(node, "GET", f"/api/v1/units/{rep.unit}", timeout=5)
            error = unit.get("error")
            rep.note_state(unit.get("state", "unknown"), time.time(), error[-4000:] if isinstance(error, str) else None,
                           unit.get("restarts"))
        except ApiClientError as exc:
            rep.note_state("gone" if exc.status == 404 else "unreachable", time.time())

    async def reconcile(self) -> None:
        """Align the books with what the agents run: adopt unknown kernel units, drop vanished ones,
        stop units of deleted kernels and of earlier kernels under a kernel's id."""
        seen: dict[str, set[str]] = {}
        horizon = time.monotonic() - CHANGED_KEPT_S
        self._units_changed = {k: t for k, t in self._units_changed.items() if t > horizon}
        for node in list(self.nodes.values()):
            if not self.live(node):
                continue
            asked = time.monotonic()
            try:
                _, body = await self.call_agent(node, "GET", "/api/v1/units", timeout=5)
            except ApiClientError as exc:
                log.warning("reconcile: node %s unreachable: %s", node.name, exc)
                continue
            units = {u["name"]: u for u in body.get("units", []) if u.get("kind") == "kernel"}
            seen[node.name] = set(units)
            for key in [k for k in self._unstopped if k[0] == node.name]:
                listed = units.get(key[1])
                if listed is None or str(listed.get("incarnation") or "") != self._unstopped[key]:
                    del self._unstopped[key]  # gone meanwhile, or its agent replaced it with a new kernel's
            for name, u in units.items():
                kid = u.get("kernel_id") or ""
                if not kid or kid in self._creating:  # a kernel being created is in the books once it started
                    continue
                if self._units_changed.get(kid, -math.inf) >= asked:
                    continue  # created or deleted after this listing was asked for: it is out of date
                rec = self.kernels.get(kid)
                incarnation = str(u.get("incarnation") or "")
                stale = self._stale_unit(node.name, name, incarnation, rec)
                if stale:
                    log.warning("reconcile: stopping %s on %s, %s", name, node.name, stale)
                    await self._stop_for_good(ReplicaRecord(node.name, name, id=-1), incarnation)
                    seen[node.name].discard(name)
                    continue
                if rec is None:
                    rec = self.kernels[kid] = KernelRecord(kid, u.get("user", ""), int(u.get("gpus", 0)), [],
                                                           time.time(), incarnation=incarnation)
                    log.warning("reconcile: adopted kernel %s found on %s", kid, node.name)
                known = next((r for r in rec.replicas if r.unit == name and r.node == node.name), None)
                if known is None and rec.key:
                    # A replica that was replaced while its node was away: the group moved on.
                    log.warning("reconcile: stopping %s on %s, a replaced replica of kernel %s", name, node.name, kid)
                    await self._stop_replica(ReplicaRecord(node.name, name, id=-1))
                    seen[node.name].discard(name)
                elif known is None:
                    rid = u.get("replica_id")
                    rec.replicas.append(ReplicaRecord(node.name, name, u.get("connection"),
                                                      id=rid if isinstance(rid, int) else -1,
                                                      state=u.get("state", "unknown")))
                else:
                    known.note_state(u.get("state", known.state), time.time(), restarts=u.get("restarts"))
        await self._recover_keys(seen)
        now = time.time()
        for kid, rec in list(self.kernels.items()):
            kept = []
            for r in rec.replicas:
                if r.node in seen and r.unit not in seen[r.node]:
                    if not rec.key:
                        continue  # cannot be replaced without the key: forget it
                    r.note_state("gone", now)  # heal() replaces it
                kept.append(r)
            rec.replicas = kept
            if all(r.state in DEAD_UNIT_STATES for r in rec.replicas):
                log.info("reconcile: kernel %s has no running replica left; forgetting it", kid)
                del self.kernels[kid]
                for r in rec.replicas:
                    # Every unit its agent still lists goes, "gone" ones too (systemd forgot a unit
                    # that exited cleanly; the agent keeps its record and journal until told), or
                    # the next round would adopt the kernel again, and its journals would stay.
                    if r.unit in seen.get(r.node, ()):
                        await self._stop_for_good(r, rec.incarnation)
        self._unstopped = {k: v for k, v in self._unstopped.items() if k[0] in self.nodes}
        await self.stop_orphaned_kernels()
        self.forget_gone_nodes()
        self.save()

    def _stale_unit(self, node: str, unit: str, incarnation: str, rec: KernelRecord | None) -> str:
        """Why ``unit`` on ``node``, of a kernel the books hold as ``rec``, is left over from a kernel
        that no longer exists; "" if it is not."""
        if self._unstopped.get((node, unit)) == incarnation:
            return "a replica of a deleted kernel (its server did not answer the delete)"
        if rec is not None and rec.incarnation and incarnation and incarnation != rec.incarnation:
            return f"a replica of an earlier kernel under the id {rec.kernel_id}"
        return ""

    async def _recover_keys(self, seen: dict[str, set[str]]) -> None:
        """Kernels adopted without their key (books lost or corrupt) get it from an agent that runs
        one of their replicas: without it no replica of theirs could ever be replaced. After the
        adoption pass, so every replica of the kernel is adopted before the key marks others as
        replaced."""
        for rec in self.kernels.values():
            if rec.key:
                continue
            for rep in rec.replicas:
                node = self.nodes.get(rep.node)
                if node is None or rep.unit not in seen.get(rep.node, ()):
                    continue
                try:
                    _, body = await self.call_agent(node, "GET", f"/api/v1/units/{rep.unit}/key", timeout=5)
                except ApiClientError as exc:
                    log.debug("reconcile: no key for %s from %s: %s", rep.unit, rep.node, exc)
                    continue
                if isinstance(body, dict) and isinstance(body.get("key"), str) and body["key"]:
                    rec.key = body["key"]
                    log.info("reconcile: kernel %s has its key again (from %s)", rec.kernel_id, rep.node)
                    break

    def forget_gone_nodes(self) -> None:
        """Drop servers silent for ``node_forget_after_s`` that hold no replica: a renamed or retired
        server (or a heartbeat from no real server) must not stay in the books and views for ever.
        A server the elastic pool lent is kept: the pool takes it back by its name."""
        placed = {r.node for k in self.kernels.values() for r in k.replicas} | self.busy_targets()
        now = time.monotonic()
        for name, rec in list(self.nodes.items()):
            if name in placed or rec.pool in ("lent", "acquiring"):
                continue
            if now - rec.seen > self.config.node_forget_after_s:
                del self.nodes[name]
                log.info("node %s forgotten: no heartbeat for %.0f s and no replica there", name, now - rec.seen)
