"""Agent pieces that need no running daemon: its state file on recovery, and kernel port allocation."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import stat

import pytest

from gpuhub.agent.config import AgentConfig
from gpuhub.agent.ports import (
    KERNEL_PORT_COUNT,
    free_ports,
    kernel_connection,
    ports_taken,
)
from gpuhub.agent.service import Agent
from gpuhub.agent.units import UnitError
from gpuhub.dev.cluster import current_user
from gpuhub.dev.portblocks import reserve_block


def agent(tmp_path) -> Agent:
    return Agent(AgentConfig(node_name="n1", state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run"),
                             unit_backend="process",
                             gpus={"backend": "fake", "fake": [{"name": "Fake", "memory_mib": 1024}]}))


async def test_a_corrupt_state_file_is_kept_aside_and_rebuilt(tmp_path, caplog):
    a = agent(tmp_path)
    a.state_path.parent.mkdir(parents=True)
    a.state_path.write_text('{"units": {"gpuhub-kernel-')
    with caplog.at_level(logging.ERROR):
        await a.recover()
    kept = list(a.state_path.parent.glob("state.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text() == '{"units": {"gpuhub-kernel-'
    assert any("state file was corrupt" in r.message for r in caplog.records)
    fresh = a.store.load()  # a fresh one, still private
    assert (fresh["node"], fresh["units"], fresh["leases"]) == ("n1", {}, [])
    assert stat.S_IMODE(a.state_path.stat().st_mode) == 0o600


async def test_recovery_without_a_state_file(tmp_path):
    a = agent(tmp_path)
    await a.recover()
    assert a.units == {} and a.store.load()["units"] == {}


def test_kernel_ports_never_hand_out_a_taken_port():
    with reserve_block() as block:  # a range no other agent or test on this host hands out now
        # its last ports: a block is handed out from its first, so those of an earlier holder
        # may still be in TIME_WAIT
        hi = block.last
        lo = hi - KERNEL_PORT_COUNT + 1
        conn = kernel_connection("127.0.0.1", (lo, hi), set())
        ports = ports_taken([conn, None])
        assert sorted(ports) == list(range(lo, hi + 1))
        assert conn["raft_port"] != conn["blob_port"] and conn["ip"] == "127.0.0.1"
        with pytest.raises(UnitError, match=f"no 7 free kernel ports left in {lo}-{hi}"):
            kernel_connection("127.0.0.1", (lo, hi), ports)
        assert free_ports("127.0.0.1", 1, lo, lo + 1, {lo}) == [lo + 1]


def _listening_next_to_a_free_port() -> tuple[socket.socket, int]:
    """A socket listening on port p where p + 1 is free, both below Linux's ephemeral range (as
    the agent's kernel_ports are), so no outgoing connection takes p + 1 meanwhile."""
    for p in random.sample(range(20000, 29998), 200):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", p + 1))
        except OSError:
            s.close()
            continue
        s.listen()
        return s, p
    raise AssertionError("no two adjacent free ports in 20000-29999")


def test_a_port_something_listens_on_is_skipped():
    s, busy = _listening_next_to_a_free_port()
    with s:
        assert free_ports("127.0.0.1", 1, busy, busy + 1, set()) == [busy + 1]


def test_a_port_a_stopped_kernel_left_in_time_wait_is_free():
    """A kernel that stops closes its connections first, which leaves them in TIME_WAIT on its
    ports for a minute. Its replacement binds them anyway (ZeroMQ, pysyncobj and the blob server
    set SO_REUSEADDR), so the agent may hand them out again: a test of the port that refused them
    ran out of ports in CI after an earlier test's kernels had used the same port block."""
    with reserve_block() as block:
        port = block.take(1)[0]
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
            with socket.create_connection(("127.0.0.1", port)) as client:
                served, _ = listener.accept()
                served.close()  # the kernel's side closes first: TIME_WAIT is on its port
                assert client.recv(1) == b""
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))  # the connection is in TIME_WAIT: without SO_REUSEADDR no bind
        assert free_ports("127.0.0.1", 1, port, port, set()) == [port]


async def test_a_lease_lost_with_the_server_counts_its_gpu_hours_up_to_the_last_save(tmp_path):
    """A reboot ends every cell: the leases in the state file that did not survive count towards
    their users' weekly GPU-hours until the file was last written (docs/quotas.md)."""
    import json
    import time

    a = agent(tmp_path)
    a.state_path.parent.mkdir(parents=True)
    granted = time.time() - 3600
    a.state_path.write_text(json.dumps({
        "node": "n1", "units": {}, "saved_at": granted + 600,
        "leases": [{"lease_id": "l1", "holder": "gpuhub-kernel-k1-r0", "gpus": [0], "granted_at": granted,
                    "user": "alice", "kernel_id": "k1"}],
    }))
    a.state_path.chmod(0o600)
    await a.recover()
    assert not a.book.leases
    batch = a.meter.batch()
    assert sum(per_user["alice"] for per_user in batch["weeks"].values()) == pytest.approx(600)


def test_a_usage_batch_the_scheduler_cannot_count_is_dropped_and_the_next_one_goes_out(tmp_path):
    a = agent(tmp_path)
    a.meter.record("alice", 1, 100.0, 110.0)
    first = a.heartbeat_body()["usage"]
    a.heartbeat_answered({"ok": True, "usage_error": "field 'usage.weeks' …"})
    a.meter.record("alice", 1, 200.0, 205.0)
    second = a.heartbeat_body()["usage"]
    assert second["seq"] == first["seq"] + 1 and list(second["weeks"].values()) == [{"alice": 5.0}]
    assert a.store.load()["usage"]["inflight"] == second  # on disk before the scheduler can count it


async def test_a_start_of_a_unit_name_waits_for_its_stop_to_end(tmp_path, monkeypatch):
    """A restarted kernel is deleted and created again under its name at once. A stop still
    running when the start comes would otherwise remove the new replica's journal after it."""
    a = agent(tmp_path)
    await a.recover()
    monkeypatch.setattr(a, "kernel_command", lambda conn: ["sleep", "60"])
    name = "gpuhub-kernel-k1-r0"
    user = current_user()
    await a.start_unit(name, "kernel", user, 0, {}, "", None, key="k", kernel_id="k1", incarnation="first")
    stopping, go, contended = asyncio.Event(), asyncio.Event(), asyncio.Event()
    stop = a.runner.stop

    async def first_stop_held(unit):
        if not stopping.is_set():  # the delete's; the start's own stop goes through
            stopping.set()
            await go.wait()
        await stop(unit)

    class NoticedLock(asyncio.Lock):
        async def acquire(self):
            if self.locked():
                contended.set()
            return await super().acquire()

    monkeypatch.setattr(a.runner, "stop", first_stop_held)
    a._unit_locks[name] = [NoticedLock(), 0]  # the agent's turn-taking for this name, noticing a wait
    deleting = asyncio.create_task(a.stop_unit(name))
    await stopping.wait()
    starting = asyncio.create_task(
        a.start_unit(name, "kernel", user, 0, {}, "", None, key="k", kernel_id="k1", incarnation="second"))
    # the delete's stop ends once the start waits for it, or (were it not to wait) has started its unit
    await asyncio.wait({starting, asyncio.create_task(contended.wait())}, return_when=asyncio.FIRST_COMPLETED)
    go.set()
    assert await deleting
    unit = await starting
    assert unit["incarnation"] == "second"
    # the new replica runs, in the books, with its journal: the earlier stop touched none of them
    assert (await a.unit_status(name))["state"] == "active" and a.journals.dir(name).is_dir()
    await a.stop_unit(name)
    assert a._unit_locks == {}


async def test_the_state_file_keeps_incarnations_beside_the_records_and_loads_fields_it_does_not_know(tmp_path,
                                                                                                      monkeypatch):
    """A rollback runs the previous release's agent on this release's state file, and the other way
    round: neither may stop an agent, nor lose which kernel a unit belongs to."""
    import json

    a = agent(tmp_path)
    await a.recover()
    monkeypatch.setattr(a, "kernel_command", lambda conn: ["sleep", "60"])
    name = "gpuhub-kernel-k1-r0"
    await a.start_unit(name, "kernel", current_user(), 0, {}, "", None, key="k", kernel_id="k1", incarnation="first")
    try:
        state = json.loads(a.state_path.read_text())
        assert "incarnation" not in state["units"][name] and state["incarnations"] == {name: "first"}
        state["units"][name]["added_later"] = 1
        a.state_path.write_text(json.dumps(state))
        again = agent(tmp_path)
        await again.recover()
        assert again.units[name].incarnation == "first" and again.units[name].kernel_id == "k1"
    finally:
        await a.stop_unit(name)
