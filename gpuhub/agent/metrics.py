"""The agent's Prometheus metrics, read from its live state at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: from a grant taken at once (a few ms) to a cell that waited minutes for a busy server.
CELL_GPU_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def cell_gpu_wait_histogram() -> Histogram:
    """What users feel of oversubscription: how long a GPU cell waited, from its arrival at the
    kernel until its replica held the GPUs (reported by the kernel when it gives the lease back)."""
    return Histogram("gpuhub_agent_cell_gpu_wait_seconds",
                     "GPU cells: seconds from the cell's arrival at the kernel until it held its GPUs",
                     labelnames=["node"], buckets=CELL_GPU_WAIT_BUCKETS, registry=None)


class AgentCollector:
    def __init__(self, agent) -> None:
        self.agent = agent

    def collect(self):
        a = self.agent
        node = a.config.node_name
        for name, help_, value in (
            ("gpuhub_agent_gpus", "GPUs on this node", a.book.gpu_count),
            ("gpuhub_agent_gpus_pending", "GPUs of the kernel replicas placed on this node", a.book.pending),
            ("gpuhub_agent_gpus_committed", "GPUs granted to executing cells right now", a.book.committed),
            ("gpuhub_agent_gpus_lingering", "GPUs kept warm between a kernel's cells, taken back on demand",
             len(a.book.lingering)),
        ):
            g = GaugeMetricFamily(name, help_, labels=["node"])
            g.add_metric([node], value)
            yield g
        units = GaugeMetricFamily("gpuhub_agent_units", "Units this agent runs", labels=["node", "kind"])
        for kind in ("kernel", "server"):
            units.add_metric([node, kind], sum(1 for u in a.units.values() if u.kind == kind))
        yield units
        oldest = GaugeMetricFamily("gpuhub_agent_lease_oldest_seconds",
                                   "How long the oldest GPU lease a cell runs under now has been held (0: none)",
                                   labels=["node"])
        now = time.time()
        oldest.add_metric([node], max((now - lease.granted_at for lease in a.book.leases.values()
                                       if lease.lingering_pid is None), default=0.0))
        yield oldest
        for key in ("granted", "refused", "expired", "released", "reclaimed"):
            c = CounterMetricFamily(f"gpuhub_agent_leases_{key}", f"GPU lease requests {key}", labels=["node"])
            c.add_metric([node], a.counters[key])
            yield c
        c = CounterMetricFamily("gpuhub_agent_quota_refusals", "GPU lease requests refused by a quota",
                                labels=["node", "limit"])
        for limit, n in a.quota_refusals.items():
            c.add_metric([node, limit], n)
        yield c
        yield from a.cell_gpu_wait.collect()
        busy = a.book.busy - a.book.lingering
        label_names = ["node", "gpu", "uuid"]
        fams = {
            "mem_used": GaugeMetricFamily("gpuhub_gpu_memory_used_bytes", "GPU memory in use", labels=label_names),
            "mem_total": GaugeMetricFamily("gpuhub_gpu_memory_total_bytes", "GPU memory", labels=label_names),
            "util": GaugeMetricFamily("gpuhub_gpu_utilization_ratio", "GPU utilisation (0-1)", labels=label_names),
            "committed": GaugeMetricFamily("gpuhub_gpu_committed", "1 while the GPU is granted to a cell",
                                           labels=label_names),
        }
        for g in a.gpus():
            labels = [node, str(g.index), g.uuid]
            fams["mem_used"].add_metric(labels, g.memory_used_bytes)
            fams["mem_total"].add_metric(labels, g.memory_total_bytes)
            fams["util"].add_metric(labels, g.utilization_percent / 100.0)
            fams["committed"].add_metric(labels, 1 if g.index in busy else 0)
        yield from fams.values()


def agent_registry(agent) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    return reg
