"""Discrete-event simulation of notebook sessions on a GPU cluster (heapq event queue).

The simulator drives the real scheduler and agent logic: replicas are placed with
:func:`gpuhub.scheduler.placement.place_replicas`, and every GPU a cell (or a reservation, or a
batch job) holds is granted and released through a per-node :class:`gpuhub.agent.leases.LeaseBook`.
There is no second implementation of placement or grants here.

Policies (see docs/simulator.md for the full rules):

``reservation``
    A session holds its ``gpus`` GPUs on one node (best fit) from its start to its end; its cells
    start as soon as the previous cell of the session ended. A session that finds no node with
    enough free GPUs waits in a queue (its cells wait with it).
``batch``
    Each GPU cell is a job: it waits in one cluster-wide FIFO queue (strict: the head blocks the
    queue) for a node with enough free GPUs (best fit), holds them for ``batch_start_cost_s`` plus
    its duration, and starts executing after the start cost. CPU-only cells pay the start cost but
    do not queue.
``gpuhub``
    At session start, R replicas are placed with ``place_replicas`` under the subscription-ratio cap;
    a session that cannot be placed waits in a FIFO queue and is retried whenever replicas leave or
    nodes are added. A cell is elected with the kernel's rule (gpuhub/replication/election.py,
    ``local_choice``): each replica proposes LEAD if its node's ``LeaseBook`` can grant now, in
    placement order; the previous executor wins if it can, else the first LEAD; if none can grant, the cell waits
    until GPUs free on one of those nodes (waiters on a node are tried in arrival order, a cell that
    fits may pass one that does not). Unless ``migration`` is off, a cell none of whose replicas'
    nodes can grant moves one replica with the product's policy (gpuhub/scheduler/migration.py) to
    a node that can, and starts there ``migration_s`` later (the new replica's start and catch-up;
    the GPUs are held from the move on); a waiting cell asks again every ``migration_retry_s``, as
    a kernel does. Every cell of a GPU session takes the session's GPUs, as a kernel's does
    (``cells_take_kernel_gpus``; busy GPU-hours stay those the trace's cells use).

``--elastic`` (gpuhub only) runs the product's elastic pool (gpuhub/scheduler/pool.py): every
``pool_interval_s`` the pool's rule decides which servers are acquired (active ``acquire_s`` later,
provisioned meanwhile), which drain (their idle replicas move with the placement rule onto servers
that stay active; a running cell finishes first) and which, empty, are released. ``--autoscale`` is
the NotebookOS baseline: it scales on demand but never moves a replica, so a server holding one
replica of an idle session stays on.

Within a session cells run one at a time, in submission order, as a kernel does.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from gpuhub.agent.leases import LeaseBook
from gpuhub.replication.election import FAILED, Election, local_choice
from gpuhub.scheduler.migration import NoMigrationTarget, plan_move
from gpuhub.scheduler.placement import NodeView, PlacementError, place_replicas
from gpuhub.scheduler.pool import PoolPolicy, PoolServer, PoolSettings, PoolSettingsError

from .trace import Session, Trace

POLICIES = ("reservation", "batch", "gpuhub")

# event kinds; the number is also the tie-break at equal times (frees before takes)
_CELL_END = 0
_SESSION_END = 1
_SESSION_START = 2
_CELL_SUBMIT = 3
_AUTOSCALE = 4
_MIGRATE_RETRY = 5
_POOL = 6
_ACQUIRED = 7


class SimError(ValueError):
    """A configuration the simulator cannot run (e.g. a session needs more GPUs than a node has)."""


@dataclass
class SimConfig:
    policy: str = "gpuhub"
    nodes: int | None = None  # None: sized from the trace (see default_nodes)
    gpus_per_node: int = 8
    replicas: int = 3
    max_subscription_ratio: float = 7.0
    autoscale: bool = False
    closed_loop: bool = False
    batch_start_cost_s: float = 5.0
    autoscale_interval_s: float = 30.0
    scale_out_factor: float = 1.05
    scale_in_factor: float = 1.1
    scale_buffer_hosts: int = 3
    scale_max_step: int = 2
    record_timeline: bool = False
    migration: bool = True  # gpuhub: move a replica when none of a cell's nodes can grant
    migration_s: float = 3.0  # a move's start + catch-up before the cell starts (bench migration)
    migration_retry_s: float = 5.0  # a waiting cell asks for a move again this often (gpuhub/kernel/moves.py)
    elastic: bool = False  # gpuhub: the product's elastic pool (gpuhub/scheduler/pool.py)
    pool: PoolSettings = field(default_factory=PoolSettings)  # its settings (replicas/ratio: from above)
    pool_interval_s: float = 10.0  # how often the pool decides (the scheduler's pool loop)
    acquire_s: float = 30.0  # a lent server's acquire hook until its agent heartbeats
    grant_timeout_s: float = 300.0  # a cell waiting longer fails for real (GPUHUB_GRANT_TIMEOUT_S)
    # gpuhub: every cell of a GPU kernel takes the kernel's GPUs, as the product's kernels do (a
    # cell cannot say beforehand that it will not touch a GPU). False: a GPU session's cells that
    # use no GPU in the trace take none (what a product that knew could save).
    cells_take_kernel_gpus: bool = True


@dataclass
class SimResult:
    policy: str
    sessions: int
    cells: int
    nodes: int
    gpus_per_node: int
    replicas: int
    max_subscription_ratio: float
    autoscale: bool
    elastic: bool
    closed_loop: bool
    horizon_s: float
    gpu_hours_reserved: float
    gpu_hours_busy: float
    gpu_hours_committed: float
    gpu_hours_provisioned: float
    gpu_hours_physical_limit: float
    gpu_hours_saved_provisioned: float
    gpu_hours_saved_vs_reservation: float
    gpu_hours_saved_bound: float
    saved_frac_of_bound: float
    delay_mean_s: float
    delay_p50_s: float
    delay_p95_s: float
    delay_p99_s: float
    delay_max_s: float
    frac_started_within_1s: float
    frac_started_within_10s: float
    cells_over_grant_timeout: int
    migrations: int
    replica_moves: int
    sessions_waited: int
    session_wait_max_s: float
    peak_committed_gpus: int
    peak_active_nodes: int
    mean_active_nodes: float
    scale_outs: int
    scale_ins: int
    servers_released: int
    servers_acquired: int
    events: int
    # not in to_dict(): raw material for plots
    delays: array = field(default_factory=lambda: array("d"), repr=False)
    timeline: list = field(
        default_factory=list, repr=False
    )  # (t, gpus held, provisioned nodes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("delays")
        d.pop("timeline")
        return d


def peak_reserved_gpus(trace: Trace) -> int:
    points = []
    for s in trace.sessions:
        if s.gpus:
            points.append((s.start_s, 1, s.gpus))
            points.append((s.end_s, 0, -s.gpus))
    points.sort()
    level = peak = 0
    for _, _, g in points:
        level += g
        peak = max(peak, level)
    return peak


def physical_limit_gpu_seconds(trace: Trace, gpus_per_node: int) -> float:
    """The busy GPUs at each moment, packed into whole servers: no policy that binds GPUs only
    while cells run (and keeps servers off otherwise) can provision less."""
    points = []
    for s in trace.sessions:
        for t, d, g in s.cells:
            if g and d > 0:
                points.append((t, g))
                points.append((t + d, -g))
    points.sort()
    total, level, last = 0.0, 0, None
    for t, g in points:
        if last is not None:
            total += math.ceil(level / gpus_per_node) * gpus_per_node * (t - last)
        level += g
        last = t
    return total


def as_kernels_run_it(trace: Trace) -> Trace:
    """The trace as gpuhub's kernels run it: every cell of a session that asks for GPUs takes them
    all, also a cell that uses none (its GPUs are held while it runs, not used). Busy GPU-hours
    and the physical limit stay the trace's own: what the cells use."""
    return Trace([s if not s.gpus or all(g == s.gpus for _, _, g in s.cells)
                  else replace(s, cells=[(t, d, s.gpus) for t, d, _ in s.cells]) for s in trace.sessions])


def default_nodes(trace: Trace, gpus_per_node: int, replicas: int) -> int:
    """Enough nodes for the reservation baseline: ceil(peak reserved GPUs / G) + R."""
    return math.ceil(peak_reserved_gpus(trace) / gpus_per_node) + replicas


def percentile(sorted_values, p: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (0 for an empty one)."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    k = max(0, min(n - 1, math.ceil(p / 100.0 * n) - 1))
    return float(sorted_values[k])


class _Node:
    __slots__ = (
        "active",
        "book",
        "bucket",
        "cordoned",
        "idx",
        "lent_view",
        "name",
        "pool",
        "pool_server",
        "residents",
        "view",
        "waiters",
    )

    def __init__(self, idx: int, gpus: int):
        self.idx = idx
        self.name = f"n{idx:05d}"
        self.book = LeaseBook(gpus, random_ids=False)
        self.active = False
        self.cordoned = False
        self.pool = "lent"  # --elastic: its pool state (gpuhub/scheduler/pool.py STATES)
        self.lent_view: PoolServer | None = None  # --elastic: how the pool sees it while lent
        self.pool_server: tuple | None = None  # --elastic: (view, pool state, PoolServer) last built
        self.residents: dict = {}  # gpuhub: replica key -> (session state, replica index)
        self.view: NodeView | None = None  # cached NodeView, None when stale
        self.waiters: deque = deque()  # gpuhub: (session state, wait token)
        self.bucket = (
            -1
        )  # reservation/batch: index into free buckets, -1 when not listed

    def idle(self) -> bool:
        return not self.book.leases and not self.book.placed


class _Lent:
    """The lent nodes as the pool rule reads them (``PoolPolicy.plan(lent=...)``), in the order
    they were lent, without building a list of them at every decision."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return (n.lent_view for n in self.nodes.values())

    def __contains__(self, item) -> bool:
        return any(v is item for v in self)


class _SState:
    __slots__ = (
        "arrived",
        "cpu_node",
        "done",
        "executor",
        "finished",
        "hold",
        "hold_node",
        "hold_since",
        "lease",
        "lease_node",
        "ncells",
        "placed",
        "queue",
        "replicas",
        "running",
        "s",
        "sid",
        "token",
        "trace_ended",
        "waiting",
    )

    def __init__(self, s: Session):
        self.s = s
        self.sid = s.session_id
        self.ncells = len(s.cells)
        self.queue: deque = (
            deque()
        )  # submitted, not yet started: (cell index, submit time)
        self.running = False
        self.lease = None
        self.lease_node: _Node | None = None
        self.executor: _Node | None = None
        self.cpu_node: _Node | None = None  # where its running CPU cell runs (a drain waits for it)
        self.replicas: list[_Node] = []
        self.placed = False
        self.done = 0
        self.trace_ended = False
        self.finished = False
        self.hold = None  # reservation lease
        self.hold_node: _Node | None = None
        self.hold_since = 0.0
        self.token = (
            0  # bumps when a waiting head cell starts: stale waiter entries are skipped
        )
        self.waiting = False
        self.arrived = 0.0


class Simulator:
    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        progress: Callable[[int, int], None] | None = None,
    ):
        if config.policy not in POLICIES:
            raise SimError(
                f"unknown policy {config.policy!r} (choose from {', '.join(POLICIES)})"
            )
        if config.gpus_per_node < 1:
            raise SimError("--gpus-per-node must be at least 1")
        if config.replicas < 1:
            raise SimError("--replicas must be at least 1")
        if config.max_subscription_ratio <= 0:
            raise SimError("--max-subscription-ratio must be positive")
        self.trace = trace
        self.cfg = config
        self.G = config.gpus_per_node
        for s in trace.sessions:
            if s.gpus > self.G:
                raise SimError(
                    f"session {s.session_id!r} asks for {s.gpus} GPUs but nodes have {self.G} (--gpus-per-node)"
                )
        n = (
            config.nodes
            if config.nodes is not None
            else default_nodes(trace, self.G, config.replicas)
        )
        if n < 1:
            raise SimError("--nodes must be at least 1")
        if config.policy == "gpuhub" and n < config.replicas:
            raise SimError(
                f"{config.replicas} replicas need at least {config.replicas} nodes, got --nodes {n}"
            )
        self.N = n
        self.nodes = [_Node(i, self.G) for i in range(n)]
        self.pool: PoolPolicy | None = None
        if config.elastic:
            if config.policy != "gpuhub":
                raise SimError("--elastic is the gpuhub policy's pool; use it with --policy gpuhub")
            if config.autoscale:
                raise SimError("--elastic and --autoscale are two ways to size the cluster: choose one")
            if config.acquire_s < 0 or config.pool_interval_s <= 0:
                raise SimError("--acquire-s must not be negative and the pool interval must be positive")
            try:
                self.pool = PoolPolicy(
                    replace(
                        config.pool.check(),
                        replicas=config.replicas,
                        max_subscription_ratio=config.max_subscription_ratio,
                        min_active=min(max(config.pool.min_active, config.replicas), n),
                    )
                )
            except PoolSettingsError as exc:
                raise SimError(str(exc)) from None
        self.progress = progress
        self.heap: list = []
        self.seq = 0
        self.delays = array("d")
        # free buckets (reservation, batch): buckets[f] = nodes with f free GPUs, schedulable
        self.buckets: list[dict] = [{} for _ in range(self.G + 1)]
        self.batch_queue: deque = deque()  # (state, cell index, submit time)
        self.res_queue: deque = deque()  # reservation sessions waiting for GPUs
        self.place_queue: deque = deque()  # gpuhub sessions waiting for placement
        self.committed_gs = 0.0  # GPU-seconds held
        self.committed_now = 0
        self.peak_committed = 0
        self.active_count = 0
        self.peak_active = 0
        self.prov_node_s = 0.0
        self.prov_t = None
        self.now = 0.0
        self.sessions_waited = 0
        self.session_wait_max = 0.0
        self.scale_outs = 0
        self.scale_ins = 0
        self.servers_released = 0
        self.servers_acquired = 0
        self.acquiring_count = 0
        self.replica_moves = 0
        self.migrations = 0
        self.events = 0
        self.waiting_gpus = 0  # demand not served yet (for the autoscaler)
        self.timeline: list = []
        self.live_sessions = 0
        # --elastic: the nodes not lent, the lent ones, and what the pool last looked at
        self.pooled: dict[int, _Node] = {}
        self.lent = _Lent()
        self.pool_version = 0  # bumps whenever a GPU, a replica or a node's pool state changes
        self.pool_seen: tuple | None = None

    # ------------------------------------------------------------------ utilities
    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, obj))

    def _held(self, delta: int, t: float) -> None:
        self.pool_version += 1
        self.committed_now += delta
        self.peak_committed = max(self.peak_committed, self.committed_now)
        if self.cfg.record_timeline:
            self.timeline.append((t, self.committed_now, self.active_count + self.acquiring_count))

    def _set_active(self, node: _Node, active: bool, t: float) -> None:
        if node.active == active:
            return
        self._account_prov(t)
        node.active = active
        node.cordoned = False
        node.view = None
        self.active_count += 1 if active else -1
        self.peak_active = max(self.peak_active, self.active_count)
        self._rebucket(node)
        if self.cfg.record_timeline:
            self.timeline.append((t, self.committed_now, self.active_count + self.acquiring_count))

    def _account_prov(self, t: float) -> None:
        if self.prov_t is not None:
            self.prov_node_s += (self.active_count + self.acquiring_count) * (t - self.prov_t)
        self.prov_t = t

    def _rebucket(self, node: _Node) -> None:
        if node.bucket >= 0:
            del self.buckets[node.bucket][node.idx]
            node.bucket = -1
        if node.active and not node.cordoned:
            f = node.book.free
            self.buckets[f][node.idx] = node
            node.bucket = f

    def _best_fit(self, g: int) -> _Node | None:
        for f in range(g, self.G + 1):
            b = self.buckets[f]
            if b:
                return next(iter(b.values()))
        return None

    def _view(self, node: _Node) -> NodeView:
        v = node.view
        if v is None:
            book = node.book
            v = node.view = NodeView(
                node.name,
                book.gpu_count,
                book.pending,
                book.committed,
                not node.cordoned,
            )
        return v

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        cfg = self.cfg
        sessions = self.trace.sessions
        if cfg.policy == "gpuhub" and cfg.cells_take_kernel_gpus:
            sessions = as_kernels_run_it(self.trace).sessions
        states = [_SState(s) for s in sessions]
        total_cells = sum(st.ncells for st in states)
        if not states:
            return self._result(0.0, 0.0, total_cells)
        t0 = min(s.start_s for s in self.trace.sessions)
        self.now = t0
        self.prov_t = t0
        if cfg.autoscale:
            for node in self.nodes[
                : min(self.N, max(cfg.scale_buffer_hosts, cfg.replicas))
            ]:
                self._set_active(node, True, t0)
            self._push(t0, _AUTOSCALE, None)
        elif self.pool is not None:
            for node in self.nodes:
                node.lent_view = PoolServer(node.name, node.book.gpu_count, "lent")
                self.lent.nodes[node.idx] = node
            for node in self.nodes[: self.pool.settings.min_active]:
                self._set_active(node, True, t0)
                node.pool = "active"
                del self.lent.nodes[node.idx]
                self.pooled[node.idx] = node
            self._push(t0, _POOL, None)
        else:
            for node in self.nodes:
                self._set_active(node, True, t0)
        for st in states:
            self._push(st.s.start_s, _SESSION_START, st)
        self.live_sessions = len(states)

        heap = self.heap
        pop = heapq.heappop
        progress = self.progress
        every = 1 << 16
        ev = 0
        while heap:
            t, kind, _, obj = pop(heap)
            self.now = t
            ev += 1
            if kind == _CELL_END:
                self._cell_end(obj, t)
            elif kind == _CELL_SUBMIT:
                self._submit(obj, t)
            elif kind == _SESSION_START:
                self._session_start(obj, t)
            elif kind == _SESSION_END:
                obj.trace_ended = True
                if obj.done == obj.ncells:
                    self._finish(obj, t)
            elif kind == _MIGRATE_RETRY:
                self._retry_migration(obj, t)
            elif kind == _POOL:
                self._pool_tick(t)
            elif kind == _ACQUIRED:
                self._acquired(obj, t)
            else:
                self._autoscale(t)
            if progress is not None and ev % every == 0:
                progress(len(self.delays), total_cells)
        self.events = ev
        stuck = [st for st in states if not st.finished]
        if stuck:
            raise SimError(
                f"{len(stuck)} session(s) never got their GPUs or replicas (first: {stuck[0].sid!r}, "
                f"{stuck[0].s.gpus} GPU(s)); the cluster is too small for them or the subscription "
                "ratio too low"
            )
        if progress is not None:
            progress(len(self.delays), total_cells)
        return self._result(t0, self.now, total_cells)

    # ------------------------------------------------------------------ sessions
    def _session_start(self, st: _SState, t: float) -> None:
        st.arrived = t
        s = st.s
        pol = self.cfg.policy
        if pol == "reservation":
            if s.gpus == 0:
                st.hold_since = t
                st.placed = True
            elif not self._reserve(st, t):
                self.res_queue.append(st)
                self.waiting_gpus += s.gpus
        elif pol == "gpuhub":
            if not self._place(st, t):
                self.place_queue.append(st)
        else:
            st.placed = True
        if st.ncells:
            self._push(s.cells[0][0], _CELL_SUBMIT, st)
        self._push(s.end_s, _SESSION_END, st)

    def _reserve(self, st: _SState, t: float) -> bool:
        node = self._best_fit(st.s.gpus)
        if node is None:
            return False
        lease = node.book.grant(st.s.gpus, st.sid, t)
        self._rebucket(node)
        st.hold, st.hold_node, st.hold_since, st.placed = lease, node, t, True
        self._held(st.s.gpus, t)
        self._waited(st, t)
        return True

    def _place(self, st: _SState, t: float) -> bool:
        cfg = self.cfg
        views = [self._view(n) for n in self.nodes if n.active]
        try:
            chosen = place_replicas(
                views, st.s.gpus, cfg.replicas, cfg.max_subscription_ratio, pack=cfg.elastic
            )
        except PlacementError:
            if not (cfg.autoscale and self._scale_out_for_placement(st, t)):
                return False
            views = [self._view(n) for n in self.nodes if n.active]
            try:
                chosen = place_replicas(
                    views, st.s.gpus, cfg.replicas, cfg.max_subscription_ratio
                )
            except PlacementError:
                return False
        by_name = {n.name: n for n in self.nodes if n.active}
        reps = []
        for i, v in enumerate(chosen):
            node = by_name[v.name]
            key = f"{st.sid}/{i}"
            node.book.place(key, st.s.gpus)
            node.residents[key] = (st, i)
            node.view = None
            reps.append(node)
        st.replicas = reps
        st.placed = True
        self.pool_version += 1
        self._waited(st, t)
        return True

    def _waited(self, st: _SState, t: float) -> None:
        w = t - st.arrived
        if w > 0:
            self.sessions_waited += 1
            self.session_wait_max = max(self.session_wait_max, w)

    def _finish(self, st: _SState, t: float) -> None:
        if st.finished:
            return
        st.finished = True
        self.live_sessions -= 1
        pol = self.cfg.policy
        if pol == "reservation":
            if st.hold is not None:
                node = st.hold_node
                node.book.release(st.hold.lease_id)
                self.committed_gs += st.s.gpus * (t - st.hold_since)
                self._held(-st.s.gpus, t)
                st.hold = None
                self._rebucket(node)
                self._drain_res_queue(t)
            elif not st.placed:  # never got its GPUs (only possible with no cells)
                self.res_queue.remove(st)
                self.waiting_gpus -= st.s.gpus
        elif pol == "gpuhub":
            if st.placed:
                for i, node in enumerate(st.replicas):
                    key = f"{st.sid}/{i}"
                    node.book.unplace(key)
                    node.residents.pop(key, None)
                    node.view = None
                st.replicas = []
                self.pool_version += 1
                self._drain_place_queue(t)
            else:
                self.place_queue.remove(st)

    def _drain_res_queue(self, t: float) -> None:
        q = self.res_queue
        if not q:
            return
        keep = deque()
        while q:
            st = q.popleft()
            if self._reserve(st, t):
                self.waiting_gpus -= st.s.gpus
                if st.queue and not st.running:
                    self._try_head(st, t)
            else:
                keep.append(st)
        self.res_queue = keep

    def _drain_place_queue(self, t: float) -> None:
        q = self.place_queue
        while q:
            st = q[0]
            if not self._place(st, t):
                break
            q.popleft()
            if st.queue and not st.running:
                self._try_head(st, t)

    # ------------------------------------------------------------------ cells
    def _submit(self, st: _SState, t: float) -> None:
        k = st.done + len(st.queue) + (1 if st.running else 0)
        st.queue.append((k, t))
        if not st.running and len(st.queue) == 1:
            self._try_head(st, t)
        if not self.cfg.closed_loop and k + 1 < st.ncells:
            self._push(st.s.cells[k + 1][0], _CELL_SUBMIT, st)

    def _try_head(self, st: _SState, t: float) -> None:
        """Start the session's oldest submitted cell if the policy allows it now."""
        if not st.placed:
            return  # waits for its reservation or placement; retried from the drain functions
        k, _submit = st.queue[0]
        _, _dur, g = st.s.cells[k]
        pol = self.cfg.policy
        if pol == "reservation" or g == 0:
            if pol == "gpuhub":
                st.cpu_node = self._cpu_executor(st)
            self._start(st, t, None, None)
            return
        if pol == "batch":
            if not self.batch_queue:
                node = self._best_fit(g)
                if node is not None:
                    lease = node.book.grant(g, st.sid, t)
                    self._rebucket(node)
                    self._start(st, t, node, lease)
                    return
            self.batch_queue.append(st)
            self.waiting_gpus += g
            return
        # gpuhub: the kernel's own election rule (gpuhub/replication/election.py). Every replica
        # asks its server and proposes LEAD if it can grant (in placement order); a draining
        # server grants nothing new, its replicas being about to move.
        reps = st.replicas
        ex = st.executor
        e = Election("", 0, reps.index(ex) if ex is not None and ex in reps else None, len(reps))
        for i, node in enumerate(reps):
            e.add_proposal(i, not node.cordoned and node.book.free >= g)
        choice = local_choice(e, timed_out=False)
        if choice is not None and choice != FAILED:
            node = reps[choice]
            node.view = None
            self._start(st, t, node, node.book.grant(g, st.sid, t))
            return
        if self._migrate(st, t):
            return
        st.waiting = True
        self.waiting_gpus += g
        if self.pool is not None:
            self.pool.recent.note(g, t)
        entry = (st, st.token)
        for node in st.replicas:
            node.waiters.append(entry)
        if self.cfg.migration:
            self._push(t + self.cfg.migration_retry_s, _MIGRATE_RETRY, entry)

    @staticmethod
    def _cpu_executor(st: _SState) -> _Node | None:
        """The replica's node a CPU cell runs on: the last executor's, unless it is draining (a
        replica being moved leaves the cell to another, gpuhub/platform/move_fence.py)."""
        ex = st.executor
        if ex is not None and not ex.cordoned and ex in st.replicas:
            return ex
        return next((n for n in st.replicas if not n.cordoned), None)

    def _migrate(self, st: _SState, t: float) -> bool:
        """None of the cell's replicas' nodes can grant: move one replica where the product's
        policy would, and start the cell there after the move. False when no node can take it."""
        cfg = self.cfg
        if not cfg.migration:
            return False
        g = st.s.cells[st.queue[0][0]][2]
        placed = [(i, self._view(node)) for i, node in enumerate(st.replicas)]
        views = [self._view(n) for n in self.nodes if n.active]
        try:
            move = plan_move(views, placed, g, cfg.max_subscription_ratio, limit=1)[0]
        except NoMigrationTarget:
            return False
        i, target = move.replica, self.nodes[int(move.target.name[1:])]
        self._move(st, i, target)
        self.migrations += 1
        self._start(st, t, target, target.book.grant(g, st.sid, t), delay=cfg.migration_s)
        target.view = None
        return True

    def _move(self, st: _SState, i: int, target: _Node) -> None:
        """Replica ``i`` of the session leaves its node for ``target`` (a migration or a drain)."""
        source = st.replicas[i]
        key = f"{st.sid}/{i}"
        source.book.unplace(key)
        source.residents.pop(key, None)
        target.book.place(key, st.s.gpus)
        target.residents[key] = (st, i)
        source.view = target.view = None
        self.pool_version += 1
        st.replicas[i] = target
        if st.executor is source:
            st.executor = None

    def _retry_migration(self, entry: tuple, t: float) -> None:
        st, token = entry
        if st.token != token or not st.waiting:
            return  # it started meanwhile
        g = st.s.cells[st.queue[0][0]][2]
        st.waiting = False
        if self._migrate(st, t):
            st.token += 1  # its entries in the old nodes' waiter lists are stale now
            self.waiting_gpus -= g
            return
        st.waiting = True
        self._push(t + self.cfg.migration_retry_s, _MIGRATE_RETRY, entry)

    def _start(self, st: _SState, t: float, node: _Node | None, lease, delay: float = 0.0) -> None:
        k, submit = st.queue.popleft()
        _, dur, g = st.s.cells[k]
        begin = t + delay
        if self.cfg.policy == "batch":
            begin = t + self.cfg.batch_start_cost_s
        self.delays.append(begin - submit)
        if self.pool is not None:
            self.pool.recent.note(g, t)
        end = begin + dur
        st.running = True
        if lease is not None:
            st.lease, st.lease_node = lease, node
            st.executor = node
            self.committed_gs += g * (end - t)
            if g:
                self._held(g, t)
        self._push(end, _CELL_END, st)

    def _cell_end(self, st: _SState, t: float) -> None:
        st.running = False
        st.done += 1
        k = st.done - 1
        cpu_node, st.cpu_node = st.cpu_node, None
        if cpu_node is not None and cpu_node.pool == "draining":
            self._drain_node(cpu_node, t)  # its replica moves now that the CPU cell ended
        lease = st.lease
        if lease is not None:
            node = st.lease_node
            node.book.release(lease.lease_id)
            st.lease = st.lease_node = None
            g = len(lease.gpus)
            if g:
                self._held(-g, t)
            pol = self.cfg.policy
            if pol == "gpuhub":
                node.view = None
                if node.cordoned:  # draining: its replicas move now that the cell ended (heal does)
                    if node.pool == "draining":
                        self._drain_node(node, t)
                elif node.waiters:
                    self._wake(node, t)
            else:
                self._rebucket(node)
                if self.batch_queue:
                    self._drain_batch(t)
        if self.cfg.closed_loop and k + 1 < st.ncells:
            cells = st.s.cells
            think = cells[k + 1][0] - (cells[k][0] + cells[k][1])
            self._push(t + (think if think > 0 else 0.0), _CELL_SUBMIT, st)
        if st.queue:
            self._try_head(st, t)
        elif st.done == st.ncells and st.trace_ended:
            self._finish(st, t)

    def _wake(self, node: _Node, t: float) -> None:
        book = node.book
        free = book.free
        keep = deque()
        for entry in node.waiters:
            st, token = entry
            if st.token != token or not st.waiting:
                continue  # started elsewhere
            if free <= 0:
                keep.append(entry)
                continue
            g = st.s.cells[st.queue[0][0]][2]
            if g <= free:
                lease = book.grant(g, st.sid, t)
                st.waiting = False
                st.token += 1
                self.waiting_gpus -= g
                node.view = None
                self._start(st, t, node, lease)
                free -= g
            else:
                keep.append(entry)
        node.waiters = keep

    def _drain_batch(self, t: float) -> None:
        q = self.batch_queue
        while q:
            st = q[0]
            g = st.s.cells[st.queue[0][0]][2]
            node = self._best_fit(g)
            if node is None:
                return
            q.popleft()
            self.waiting_gpus -= g
            lease = node.book.grant(g, st.sid, t)
            self._rebucket(node)
            self._start(st, t, node, lease)

    # ------------------------------------------------------------------ elastic pool (--elastic)
    def _pool_tick(self, t: float) -> None:
        """One decision of the product's pool rule (gpuhub/scheduler/pool.py), then the drains' moves.
        Skipped when nothing it looks at changed since an empty decision (no surplus being timed):
        the rule would decide the same."""
        pool = self.pool
        demand = self.committed_now + self.waiting_gpus + sum(st.s.gpus for st in self.place_queue)
        largest = pool.recent.largest(t)
        seen = (self.pool_version, demand, largest)
        if seen == self.pool_seen and pool.surplus_since is None:
            if self.live_sessions > 0:
                self._push(t + self.cfg.pool_interval_s, _POOL, None)
            return
        servers = []
        for n in self.pooled.values():
            v = n.view or self._view(n)  # cached until the node's GPUs or replicas change
            cached = n.pool_server
            if cached is None or cached[0] is not v or cached[1] != n.pool:
                ps = (PoolServer(n.name, v.gpu_count, n.pool) if n.pool == "acquiring" else
                      PoolServer(n.name, v.gpu_count, n.pool, v.committed, v.pending, len(n.residents)))
                cached = n.pool_server = (v, n.pool, ps)
            servers.append(cached[2])
        plan = pool.plan(servers, demand, t, largest_request=largest, lent=self.lent,
                         min_servers=self.cfg.replicas)
        self.pool_seen = None if plan else seen
        if plan:
            self.pool_version += 1
        for name in plan.release:
            node = self.nodes[int(name[1:])]
            node.pool = "lent"
            del self.pooled[node.idx]
            self.lent.nodes[node.idx] = node
            self._set_active(node, False, t)
            self.servers_released += 1
        for name in plan.undrain:
            node = self.nodes[int(name[1:])]
            node.pool, node.cordoned, node.view = "active", False, None
            self._rebucket(node)
            if node.waiters:
                self._wake(node, t)
        for name in plan.acquire:
            node = self.nodes[int(name[1:])]
            self._account_prov(t)
            node.pool = "acquiring"
            del self.lent.nodes[node.idx]
            self.pooled[node.idx] = node
            self.acquiring_count += 1
            self._held(0, t)  # a timeline point: provisioned rose
            self.servers_acquired += 1
            self._push(t + self.cfg.acquire_s, _ACQUIRED, node)
        for name in plan.drain:
            node = self.nodes[int(name[1:])]
            node.pool, node.cordoned, node.view = "draining", True, None
            self._rebucket(node)
        for node in list(self.pooled.values()):
            if node.pool == "draining" and node.residents:
                self._drain_node(node, t)
        if plan.undrain:
            self._drain_place_queue(t)
        if self.live_sessions > 0:
            self._push(t + self.cfg.pool_interval_s, _POOL, None)

    def _acquired(self, node: _Node, t: float) -> None:
        self.pool_version += 1
        self._account_prov(t)
        self.acquiring_count -= 1
        node.pool = "active"
        self._set_active(node, True, t)
        self._drain_place_queue(t)

    def _drain_node(self, node: _Node, t: float) -> None:
        """Move the idle replicas of a draining node where placement puts them (the servers that
        stay active); a replica whose cell runs there stays until the cell ends."""
        cfg = self.cfg
        for st, i in list(node.residents.values()):
            if st.lease_node is node or st.cpu_node is node:
                continue
            views = [self._view(n) for n in self.nodes if n.active]
            others = [n.name for j, n in enumerate(st.replicas) if j != i]
            try:
                v = place_replicas(views, st.s.gpus, cfg.replicas, cfg.max_subscription_ratio,
                                   exclude=others, count=1, pack=True)[0]
            except PlacementError:
                continue  # nowhere to go now; the next tick tries again
            target = self.nodes[int(v.name[1:])]
            self._move(st, i, target)
            self.replica_moves += 1
            if st.waiting:  # its cell now waits on its new set of nodes (the old entries go stale)
                st.token += 1
                entry = (st, st.token)
                for node_ in st.replicas:
                    node_.waiters.append(entry)
                if self.cfg.migration:
                    self._push(t + self.cfg.migration_retry_s, _MIGRATE_RETRY, entry)
                if target.book.free:
                    self._wake(target, t)

    # ------------------------------------------------------------------ autoscaling
    def _autoscale(self, t: float) -> None:
        cfg = self.cfg
        demand = self.committed_now + self.waiting_gpus
        out_target = min(
            self.N,
            max(
                cfg.replicas,
                math.ceil(demand * cfg.scale_out_factor / self.G)
                + cfg.scale_buffer_hosts,
            ),
        )
        in_target = max(
            cfg.replicas,
            math.ceil(demand * cfg.scale_in_factor / self.G) + cfg.scale_buffer_hosts,
        )
        # cordoned nodes count as leaving: they take no new work
        serving = sum(1 for n in self.nodes if n.active and not n.cordoned)
        changed = 0
        if serving < out_target:
            changed = self._add_nodes(min(cfg.scale_max_step, out_target - serving), t)
        elif serving > in_target:
            step = min(cfg.scale_max_step, serving - in_target)
            # take idle nodes first, otherwise cordon the emptiest ones so that they drain
            cands = sorted(
                (n for n in self.nodes if n.active and not n.cordoned),
                key=lambda n: (not n.idle(), n.book.pending, n.book.committed, -n.idx),
            )[:step]
            for n in cands:
                n.cordoned = True
                n.view = None
                self._rebucket(n)
        removed = 0
        for n in self.nodes:
            if n.active and n.cordoned and n.idle() and removed < cfg.scale_max_step:
                self._set_active(n, False, t)
                self.scale_ins += 1
                removed += 1
        # stop ticking when nothing else can happen (a stuck session is reported by run())
        if self.live_sessions > 0 and (self.heap or changed or removed):
            self._push(t + cfg.autoscale_interval_s, _AUTOSCALE, None)

    def _add_nodes(self, count: int, t: float) -> int:
        added = 0
        for n in self.nodes:  # uncordon first: free and instant
            if added >= count:
                break
            if n.active and n.cordoned:
                n.cordoned = False
                n.view = None
                self._rebucket(n)
                added += 1
        for n in self.nodes:
            if added >= count:
                break
            if not n.active:
                self._set_active(n, True, t)
                self.scale_outs += 1
                added += 1
        if added:
            if self.cfg.policy == "reservation":
                self._drain_res_queue(t)
            elif self.cfg.policy == "batch":
                self._drain_batch(t)
            else:
                self._drain_place_queue(t)
        return added

    def _scale_out_for_placement(self, st: _SState, t: float) -> bool:
        """On-demand scale-out when a session cannot be placed: add hosts until it fits (or the cap)."""
        for _ in range(self.N):
            if self._add_nodes_raw(1, t) == 0:
                return False
            views = [self._view(n) for n in self.nodes if n.active]
            try:
                place_replicas(
                    views, st.s.gpus, self.cfg.replicas, self.cfg.max_subscription_ratio
                )
                return True
            except PlacementError:
                continue
        return False

    def _add_nodes_raw(self, count: int, t: float) -> int:
        for n in self.nodes:
            if n.active and n.cordoned:
                n.cordoned = False
                n.view = None
                self._rebucket(n)
                return 1
        for n in self.nodes:
            if not n.active:
                self._set_active(n, True, t)
                self.scale_outs += 1
                return 1
        return 0

    # ------------------------------------------------------------------ results
    def _result(self, t0: float, t1: float, total_cells: int) -> SimResult:
        cfg = self.cfg
        self._account_prov(t1)
        horizon = max(0.0, t1 - t0)
        reserved = self.trace.reserved_gpu_seconds() / 3600.0
        busy = self.trace.busy_gpu_seconds() / 3600.0
        committed = self.committed_gs / 3600.0
        prov = self.prov_node_s * self.G / 3600.0
        delays = sorted(self.delays)
        n = len(delays)
        within1 = _count_le(delays, 1.0)
        within10 = _count_le(delays, 10.0)
        saved = reserved - committed
        if abs(saved) < 1e-9 * max(1.0, reserved):
            saved = 0.0  # no float dust (-0.0) in reports
        bound = reserved - busy
        return SimResult(
            policy=cfg.policy,
            sessions=len(self.trace.sessions),
            cells=n,
            nodes=self.N,
            gpus_per_node=self.G,
            replicas=cfg.replicas,
            max_subscription_ratio=cfg.max_subscription_ratio,
            autoscale=cfg.autoscale,
            elastic=cfg.elastic,
            closed_loop=cfg.closed_loop,
            horizon_s=horizon,
            gpu_hours_reserved=reserved,
            gpu_hours_busy=busy,
            gpu_hours_committed=committed,
            gpu_hours_provisioned=prov,
            gpu_hours_physical_limit=physical_limit_gpu_seconds(self.trace, self.G) / 3600.0,
            gpu_hours_saved_provisioned=reserved - prov,
            gpu_hours_saved_vs_reservation=saved,
            gpu_hours_saved_bound=bound,
            saved_frac_of_bound=(saved / bound) if bound > 0 else 1.0,
            delay_mean_s=(sum(delays) / n) if n else 0.0,
            delay_p50_s=percentile(delays, 50),
            delay_p95_s=percentile(delays, 95),
            delay_p99_s=percentile(delays, 99),
            delay_max_s=delays[-1] if n else 0.0,
            frac_started_within_1s=(within1 / n) if n else 1.0,
            frac_started_within_10s=(within10 / n) if n else 1.0,
            cells_over_grant_timeout=n - _count_le(delays, cfg.grant_timeout_s),
            migrations=self.migrations,
            replica_moves=self.replica_moves,
            sessions_waited=self.sessions_waited,
            session_wait_max_s=self.session_wait_max,
            peak_committed_gpus=self.peak_committed,
            peak_active_nodes=self.peak_active,
            mean_active_nodes=(self.prov_node_s / horizon)
            if horizon > 0
            else float(self.active_count),
            scale_outs=self.scale_outs,
            scale_ins=self.scale_ins,
            servers_released=self.servers_released,
            servers_acquired=self.servers_acquired,
            events=self.events,
            delays=array("d", delays),
            timeline=self.timeline,
        )


def _count_le(sorted_values, x: float) -> int:
    import bisect

    return bisect.bisect_right(sorted_values, x)


def simulate(
    trace: Trace, config: SimConfig, progress: Callable[[int, int], None] | None = None
) -> SimResult:
    return Simulator(trace, config, progress).run()
