"""The scheduler's healing rules that need no agent: when it must not replace, and what it never shows."""

from __future__ import annotations

import logging
import time

from gpuhub.config import SchedulerConfig
from gpuhub.scheduler.service import KernelRecord, NodeRecord, ReplicaRecord, Scheduler


def scheduler_with(tmp_path, live: list[str], lost: list[str]) -> Scheduler:
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=5), agent_token="t")
    s.started -= 60  # past the start-up grace
    now = time.time()
    for name in live:
        s.nodes[name] = NodeRecord(name, f"http://{name}.invalid", {"gpu_count": 1}, now)
    for name in lost:
        s.nodes[name] = NodeRecord(name, f"http://{name}.invalid", {"gpu_count": 1}, now - 60)
    return s


def kernel(nodes: list[str], key: str = "secret-key") -> KernelRecord:
    return KernelRecord("k1", "alice", 1, [ReplicaRecord(n, f"gpuhub-kernel-k1-r{i}", {}, id=i)
                                           for i, n in enumerate(nodes)], key=key)


async def test_without_a_majority_nothing_is_replaced(tmp_path, caplog):
    s = scheduler_with(tmp_path, live=["a", "d", "e"], lost=["b", "c"])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    with caplog.at_level(logging.WARNING):
        await s.heal()
        await s.heal()
    assert [r.node for r in record.replicas] == ["a", "b", "c"]
    assert s.counters["replacements"] == 0
    notes = [r.message for r in caplog.records if "without a majority" in r.message]
    assert len(notes) == 1  # said once, not every round


async def test_no_replacement_during_the_start_up_grace(tmp_path):
    s = scheduler_with(tmp_path, live=["a", "b", "d"], lost=["c"])
    s.started = time.time()  # just restarted: c may only not have heartbeated yet
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    await s.heal()
    assert [r.node for r in record.replicas] == ["a", "b", "c"]


async def test_no_spare_node_is_reported_and_the_kernel_keeps_its_survivors(tmp_path, caplog):
    s = scheduler_with(tmp_path, live=["a", "b"], lost=["c"])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    with caplog.at_level(logging.WARNING):
        await s.heal()
    assert [r.node for r in record.replicas] == ["a", "b", "c"]
    assert any("cannot be replaced yet" in r.message for r in caplog.records)


def test_the_key_is_in_the_books_but_never_in_a_view(tmp_path):
    s = scheduler_with(tmp_path, live=["a"], lost=[])
    s.kernels["k1"] = kernel(["a"], key="very-secret")
    assert "very-secret" not in str(s.kernels["k1"].view())
    s.save()
    assert (tmp_path / "books.json").stat().st_mode & 0o077 == 0
    again = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    again.load()
    assert again.kernels["k1"].key == "very-secret"
