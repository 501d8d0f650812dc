"""Placing a kernel: its replicas start at once, and a kernel is placed whole or not at all."""

from __future__ import annotations

import asyncio

import pytest

from gpuhub.platform.http_client import ApiClientError
from tests.unit.test_scheduler_heal import scheduler_with, stub_agents


def starting(s, monkeypatch, fail_on: str | None = None) -> list[str]:
    """Stub the agents: each start waits until all three began (so only concurrent starts finish),
    the one on ``fail_on`` fails. Returns the list of stopped replicas' nodes."""
    began = []
    all_began = asyncio.Event()

    async def hold(node):
        began.append(node)
        if len(began) == 3:
            all_began.set()
        await asyncio.wait_for(all_began.wait(), 5)
        if node == fail_on:
            raise ApiClientError(0, f"cannot reach {node}", node)

    return stub_agents(s, monkeypatch, before_start=hold)[1]


async def test_the_replicas_start_at_once(tmp_path, monkeypatch):
    s = scheduler_with(tmp_path, live=["a", "b", "c"], lost=[])
    starting(s, monkeypatch)
    record = await s.create_kernel("alice", "k1", "key", gpus=1, replicas=3, cwd="/home/alice")
    assert [r.id for r in record.replicas] == [0, 1, 2] and {r.node for r in record.replicas} == {"a", "b", "c"}
    assert s.kernels["k1"] is record and s.counters["placements"] == 1


async def test_a_kernel_is_placed_whole_or_not_at_all(tmp_path, monkeypatch):
    s = scheduler_with(tmp_path, live=["a", "b", "c"], lost=[])
    stopped = starting(s, monkeypatch, fail_on="b")
    with pytest.raises(ApiClientError, match="cannot reach b"):
        await s.create_kernel("alice", "k1", "key", gpus=1, replicas=3, cwd="/home/alice")
    assert sorted(stopped) == ["a", "c"]  # the two that did start are stopped again
    assert "k1" not in s.kernels and s.counters["placement_failures"] == 1 and s.counters["placements"] == 0
