"""The agent's Prometheus metrics, read from its live state at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


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
        ):
            g = GaugeMetricFamily(name, help_, labels=["node"])
            g.add_metric([node], value)
            yield g
        units = GaugeMetricFamily("gpuhub_agent_units", "Units this agent runs", labels=["node", "kind"])
        for kind in ("kernel", "server"):
            units.add_metric([node, kind], sum(1 for u in a.units.values() if u.kind == kind))
        yield units
        oldest = GaugeMetricFamily("gpuhub_agent_lease_oldest_seconds",
                                   "How long the oldest GPU lease held now has been held (0: none)", labels=["node"])
        now = time.time()
        oldest.add_metric([node], max((now - lease.granted_at for lease in a.book.leases.values()), default=0.0))
        yield oldest
        for key in ("granted", "refused", "expired", "released"):
            c = CounterMetricFamily(f"gpuhub_agent_leases_{key}", f"GPU lease requests {key}", labels=["node"])
            c.add_metric([node], a.counters[key])
            yield c
        busy = a.book.busy
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
