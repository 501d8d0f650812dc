"""The scheduler's Prometheus metrics, read from its live state at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

KERNEL_START_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120)


def kernel_start_histogram() -> Histogram:
    """How long a new kernel took to place: its replicas chosen, started on their servers and told
    of each other (what a user waits for after choosing a kernel, before it starts up)."""
    return Histogram("gpuhub_scheduler_kernel_start_seconds",
                     "Seconds to place a new kernel: choose its servers, start its replicas, send them their peers",
                     buckets=KERNEL_START_BUCKETS, registry=None)


MIGRATION_BUCKETS = (0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120)


def migration_histogram() -> Histogram:
    """How long moving a replica for a waiting cell took: its replacement started on the target and
    the group told (the cell starts once the replacement has caught up and won the election)."""
    return Histogram("gpuhub_scheduler_migration_seconds",
                     "Seconds to move a replica of a kernel whose cell waits for a GPU to a server that can grant",
                     buckets=MIGRATION_BUCKETS, registry=None)


class SchedulerCollector:
    def __init__(self, scheduler) -> None:
        self.s = scheduler

    def collect(self):
        s = self.s
        states = s.node_states()
        g = GaugeMetricFamily("gpuhub_scheduler_nodes", "Servers by whether they heartbeat (GPU servers and "
                              "notebook hosts); a silent server the elastic pool lent or acquires is not lost",
                              labels=["state"])
        g.add_metric(["live"], sum(1 for r in s.nodes.values() if s.live(r)))
        g.add_metric(["lost"], sum(1 for state in states.values() if state == "lost"))
        yield g
        # One series per server, its state now: alerts and panels can name the server.
        g = GaugeMetricFamily("gpuhub_scheduler_server_state", "1 for each server's state: active, draining, "
                              "drained, lent, acquiring or lost", labels=["server", "state"])
        for name, state in sorted(states.items()):
            g.add_metric([name, state], 1)
        yield g
        yield from s.kernel_start.collect()
        yield from s.migration_time.collect()
        g = GaugeMetricFamily("gpuhub_scheduler_kernels", "Kernels placed")
        g.add_metric([], len(s.kernels))
        yield g
        for key in ("placements", "placement_failures", "replacements", "migrations", "migration_failures"):
            c = CounterMetricFamily(f"gpuhub_scheduler_{key}", f"Kernel {key.replace('_', ' ')}")
            c.add_metric([], s.counters[key])
            yield c
        views = [v for v in s.node_views() if v.schedulable]  # the GPU servers that can take kernels
        total = sum(v.gpu_count for v in views)
        pending = sum(v.pending for v in views)
        # Each kernel's GPUs once, whatever its replica count: what a reservation system would hold.
        reserved = sum(k.gpus for k in s.kernels.values())
        g = GaugeMetricFamily("gpuhub_cluster_gpus", "GPUs in the cluster", labels=["state"])
        g.add_metric(["total"], total)
        g.add_metric(["pending"], pending)
        g.add_metric(["committed"], sum(v.committed for v in views))
        g.add_metric(["reserved"], reserved)
        yield g
        yield from quota_metrics(s)
        if s.pool is not None:
            yield from pool_metrics(s.pool)
        g = GaugeMetricFamily("gpuhub_cluster_subscription_ratio",
                              "Each kernel's GPUs once over all GPUs (= pending / (GPUs x R) with R replicas each)")
        g.add_metric([], reserved / total if total else 0.0)
        yield g


def pool_metrics(pool):
    """The elastic pool: its servers by state, the GPUs it wants, its hooks and actions."""
    g = GaugeMetricFamily("gpuhub_pool_servers", "GPU servers by elastic-pool state", labels=["state"])
    counts = pool.counts()
    for state in ("active", "draining", "lent", "acquiring", "lost"):
        g.add_metric([state], counts.get(state, 0))
    yield g
    g = GaugeMetricFamily("gpuhub_pool_demand_gpus", "GPUs granted now plus those of cells waiting for a server")
    g.add_metric([], pool.demand)
    yield g
    g = GaugeMetricFamily("gpuhub_pool_wanted_gpus", "GPUs the pool keeps active: the demand, its headroom and "
                          "the replicas' room")
    g.add_metric([], pool.last_plan.wanted_gpus)
    yield g
    runs = CounterMetricFamily("gpuhub_pool_hook_runs", "Pool hook runs by outcome (ok, failed, timeout)",
                               labels=["hook", "outcome"])
    fails = CounterMetricFamily("gpuhub_pool_hook_failures", "Pool hooks that failed, timed out, or whose "
                                "server did not come back", labels=["hook"])
    for hook in ("release", "acquire"):
        for outcome in ("ok", "failed", "timeout"):
            runs.add_metric([hook, outcome], pool.hook_runs[hook, outcome])
        fails.add_metric([hook], pool.hook_runs[hook, "failed"] + pool.hook_runs[hook, "timeout"])
    yield runs
    yield fails
    c = CounterMetricFamily("gpuhub_pool_actions", "Servers the pool drained, put back, released and acquired",
                            labels=["action"])
    for action in ("drained", "undrained", "released", "acquired"):
        c.add_metric([action], pool.events[action])
    yield c


def quota_metrics(s):
    """Each user's GPU-hours this week (ended leases and live ones so far) and their own limit."""
    used = GaugeMetricFamily("gpuhub_user_gpu_hours_week", "GPU-hours a user's cells held this week "
                             "(Monday 00:00 UTC on)", labels=["user"])
    limit = GaugeMetricFamily("gpuhub_user_gpu_hours_limit", "A user's own weekly GPU-hour limit, extra hours "
                              "included (users without one: absent)", labels=["user"])
    for st in s.quota_statuses():
        used.add_metric([st["user"]], st["gpu_hours_used"])
        own = next((lim for lim in st["limits"] if lim["kind"] == "user"), None)
        if own and own["gpu_hours"] is not None:
            limit.add_metric([st["user"]], own["gpu_hours"])
    yield used
    yield limit


def scheduler_registry(scheduler) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SchedulerCollector(scheduler))
    return reg
