"""The scheduler's books of servers: what a heartbeat may say, liveness on a monotonic clock, and
servers gone for good forgotten."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from gpuhub.platform.http_server import LogLimiter
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.node_info import parse_node_info
from gpuhub.scheduler.placement import PlacementError
from gpuhub.scheduler.service import KernelRecord, ReplicaRecord, Scheduler
from tests.unit.test_scheduler_heal import stub_agents


def beat(node: str = "gpu1", **fields) -> dict:
    return {"node": node, "url": f"http://{node}.invalid:8601", "gpu_count": 2, **fields}


def test_a_heartbeat_keeps_only_the_fields_it_knows_and_checks_each():
    info = parse_node_info(beat(extra="ignored", leases=[{"lease_id": "a1", "holder": "gpuhub-kernel-k-r0",
                                                            "gpus": [0], "granted_at": 1.5, "holder_pid": None,
                                                            "expires_at": None, "user": "u", "kernel_id": "k"}]))
    assert "extra" not in info and info["gpu_count"] == 2 and info["leases"][0]["gpus"] == [0]
    for bad, field in ((beat(gpu_count="x"), "gpu_count"), (beat(gpu_count=True), "gpu_count"),
                       (beat(pending=-1), "pending"), (beat(gpus="all"), "gpus"),
                       (beat(leases=[{"holder": "h"}]), "lease_id"), (beat(url="ftp://x"), "url"),
                       (beat(node="a b"), "node"), (beat(units=10**9), "units")):
        with pytest.raises(ValueError, match=field):
            parse_node_info(bad)


def test_liveness_does_not_move_with_the_wall_clock(tmp_path, monkeypatch):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=30), agent_token="t")
    s.heartbeat(beat())
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 45)  # NTP steps the clock forward
    assert s.nodes_view()[0]["live"]
    monkeypatch.setattr(time, "time", lambda: wall() - 3600)  # or back
    assert s.nodes_view()[0]["live"]


def test_books_from_before_the_heartbeat_check_lose_only_the_poisoned_server(tmp_path, caplog):
    books = {"nodes": {"good": {"url": "http://good.invalid:1", "info": {"gpu_count": 2}, "last_seen": time.time()},
                       "evil": {"url": "http://evil.invalid:1", "info": {"gpu_count": "x"}, "last_seen": time.time()}},
             "kernels": {}}
    (tmp_path / "books.json").write_text(json.dumps(books))
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    with caplog.at_level(logging.ERROR):
        s.load()
    assert list(s.nodes) == ["good"] and s.nodes["good"].info["gpu_count"] == 2
    assert "node evil dropped" in caplog.text and "gpu_count" in caplog.text
    assert [v.name for v in s.node_views()] == ["good"]  # and the views work


def test_a_server_silent_for_long_is_forgotten_unless_something_is_there(tmp_path):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_forget_after_s=600), agent_token="t")
    for name in ("gone", "holds", "lent", "recent"):
        s.heartbeat(beat(name))
    for name in ("gone", "holds", "lent"):
        s.nodes[name].seen -= 700
    s.nodes["lent"].pool = "lent"  # the elastic pool takes it back by its name
    s.kernels["k1"] = KernelRecord("k1", "alice", 1, [ReplicaRecord("holds", "gpuhub-kernel-k1-r0")])
    s.forget_gone_nodes()
    assert sorted(s.nodes) == ["holds", "lent", "recent"]
    s.heartbeat(beat("gone"))  # it comes back with its next heartbeat
    assert "gone" in s.nodes


def test_the_log_limiter_holds_back_a_flood_and_says_how_much(monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    limiter, log = LogLimiter(burst=3, window_s=10), logging.getLogger("test.limiter")
    assert [limiter.allow(401, log, logging.WARNING) for _ in range(5)] == [True] * 3 + [False] * 2
    assert limiter.allow(400, log, logging.WARNING)  # each key has its own budget
    clock[0] += 10
    with caplog.at_level(logging.WARNING):
        assert limiter.allow(401, log, logging.WARNING)
    assert "2 more such line(s) (401) held back" in caplog.text


async def test_a_kernel_id_is_taken_from_the_first_request_on(tmp_path, monkeypatch):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    for name in ("a", "b", "c"):
        s.heartbeat(beat(name))
    hold, placing = asyncio.Event(), asyncio.Event()

    async def held(node):
        placing.set()
        await hold.wait()

    started, _ = stub_agents(s, monkeypatch, before_start=held)
    alice = asyncio.create_task(s.create_kernel("alice", "k1", "key", 1, 3, ""))
    await placing.wait()  # Alice's placement is under way, nothing in the books yet
    assert "k1" not in s.kernels
    with pytest.raises(PermissionError, match="another user"):
        # (without the reservation Bob's request would start placing too: it would wait on the hold)
        await asyncio.wait_for(s.create_kernel("bob", "k1", "bobs-key", 1, 3, ""), timeout=30)
    retry = asyncio.create_task(s.create_kernel("alice", "k1", "key", 1, 3, ""))  # her client tries again
    hold.set()
    first, again = await asyncio.gather(alice, retry)
    assert first is again and first.user == "alice" and len(started) == 3  # placed once
    assert s.kernels["k1"].key == "key"


def test_a_users_kernels_and_their_gpus_are_limited_kernels_being_created_included(tmp_path):
    from gpuhub.scheduler.service import UserLimitExceeded

    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), kernel_max_gpus=4, user_max_kernels=3,
                                  user_max_placed_gpus=5), agent_token="t")
    s.check_user_limits("alice", 4)
    with pytest.raises(ValueError, match="at most 4 GPU"):
        s.check_user_limits("alice", 8)
    s.kernels["k1"] = KernelRecord(kernel_id="k1", user="alice", gpus=2)
    s.kernels["b1"] = KernelRecord(kernel_id="b1", user="bob", gpus=4)  # bob's count for bob only
    s._creating["k2"] = ("alice", 2, None)  # still being placed: counts already
    s.check_user_limits("alice", 1)
    with pytest.raises(UserLimitExceeded, match=r"alice's kernels have 4 GPU\(s\); 2 more would pass the 5"):
        s.check_user_limits("alice", 2)
    s.kernels["k3"] = KernelRecord(kernel_id="k3", user="alice", gpus=0)
    with pytest.raises(UserLimitExceeded, match=r"alice has 3 kernel\(s\), the most one user may have"):
        s.check_user_limits("alice", 0)
    s.check_user_limits("bob", 1)


def test_no_user_limit_by_default(tmp_path):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    for i in range(50):
        s.kernels[f"k{i}"] = KernelRecord(kernel_id=f"k{i}", user="alice", gpus=8)
    s.check_user_limits("alice", 64)


def restored_books(tmp_path, names: list[str], age_s: float) -> None:
    """Books as a restore brings them back: every server last heard from ``age_s`` ago."""
    nodes = {n: {"url": f"http://{n}.invalid:8601", "info": {"gpu_count": 2}, "last_seen": time.time() - age_s}
             for n in names}
    (tmp_path / "books.json").write_text(json.dumps({"nodes": nodes, "kernels": {}}))


async def test_a_kernel_asked_for_right_after_a_restore_waits_for_the_servers_first_heartbeats(tmp_path, monkeypatch):
    """After a restore (books minutes old) no server is live until its first heartbeat, up to one
    heartbeat period after the scheduler starts: a kernel asked for meanwhile is placed once they
    report, instead of failing."""
    restored_books(tmp_path, ["a", "b", "c"], age_s=240)
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=30), agent_token="t")
    s.load()
    started, _ = stub_agents(s, monkeypatch)
    creating = asyncio.create_task(s.create_kernel("alice", "k1", "key", 1, 3, ""))
    await asyncio.sleep(0)  # it is waiting now, not failed
    assert not creating.done()
    for name in ("a", "b", "c"):
        s.heartbeat(beat(name))
    record = await asyncio.wait_for(creating, timeout=10)
    assert sorted(r.node for r in record.replicas) == sorted(started) == ["a", "b", "c"]


async def test_a_kernel_that_does_not_fit_fails_once_the_start_up_grace_is_over(tmp_path, monkeypatch):
    restored_books(tmp_path, ["a", "b", "c"], age_s=240)
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=0.5), agent_token="t")
    s.load()
    stub_agents(s, monkeypatch)
    s.heartbeat(beat("a"))  # b and c never report: their servers are gone
    with pytest.raises(PlacementError):
        await asyncio.wait_for(s.create_kernel("alice", "k1", "key", 1, 3, ""), timeout=10)
    s.started -= 60  # long after the start: no wait at all
    began = time.monotonic()
    with pytest.raises(PlacementError):
        await s.create_kernel("alice", "k2", "key", 1, 3, "")
    assert time.monotonic() - began < 0.5


async def test_no_wait_after_a_restart_for_servers_no_replica_may_go_to(tmp_path, monkeypatch):
    """A lent server sends no heartbeat: a kernel that does not fit without it fails at once (and
    so the elastic pool hears of it at once), start-up grace or not."""
    restored_books(tmp_path, ["a", "b", "c"], age_s=240)
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=30), agent_token="t")
    s.load()
    stub_agents(s, monkeypatch)
    s.nodes["c"].pool = "lent"
    s.heartbeat(beat("a"))
    s.heartbeat(beat("b"))
    with pytest.raises(PlacementError):  # not a TimeoutError: it did not wait the 30 s grace
        await asyncio.wait_for(s.create_kernel("alice", "k1", "key", 1, 3, ""), timeout=10)


def test_metrics_name_each_lost_server_and_a_lent_one_is_not_lost(tmp_path, monkeypatch):
    from prometheus_client import generate_latest

    from gpuhub.scheduler.metrics import scheduler_registry

    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=30), agent_token="t")
    for name in ("gpu1", "gpu2", "gpu3"):
        s.heartbeat(beat(name))
    s.nodes["gpu3"].pool = "lent"  # the elastic pool powered it off: it is silent too
    now = time.monotonic()
    s.nodes["gpu1"].seen = s.nodes["gpu3"].seen = now - 60
    text = generate_latest(scheduler_registry(s)).decode()
    assert 'gpuhub_scheduler_nodes{state="lost"} 1.0' in text, text
    assert 'gpuhub_scheduler_nodes{state="live"} 1.0' in text, text
    for server, state in (("gpu1", "lost"), ("gpu2", "active"), ("gpu3", "lent")):
        assert f'gpuhub_scheduler_server_state{{server="{server}",state="{state}"}} 1.0' in text, text
