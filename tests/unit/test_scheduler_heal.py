"""The scheduler's healing rules that need no agent: when it must not replace, and what it never shows."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gpuhub.platform.http_client import ApiClientError
from gpuhub.scheduler.config import SchedulerConfig
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


def stub_agents(s: Scheduler, monkeypatch, before_start=None, fence=True) -> tuple[list[str], list[str]]:
    """The agents' side of starting and stopping replicas, recorded: (started nodes, stopped nodes).
    ``before_start(node)``, awaited first, may hold or fail a start. With ``fence``, every agent
    fences a replica before a move and finds no cell running there (else the test answers)."""
    started, stopped = [], []

    async def call_unit(rep, method, suffix, what):
        assert suffix == "/fence", suffix
        return {"unit": rep.unit, "fenced": method == "POST", "leases": [], "executing": False}

    async def start(rec, replica_id, node, key, cwd):
        if before_start is not None:
            await before_start(node)
        started.append(node)
        return ReplicaRecord(node, f"gpuhub-kernel-{rec.kernel_id}-r{replica_id}", {}, id=replica_id)

    async def stop(rep):
        stopped.append(rep.node)
        return True

    async def peers(rec):
        return None

    monkeypatch.setattr(s, "_start_replica", start)
    monkeypatch.setattr(s, "_stop_replica", stop)
    monkeypatch.setattr(s, "_send_peers", peers)
    if fence:
        monkeypatch.setattr(s, "_call_unit", call_unit)
    return started, stopped


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
    s.started = time.monotonic()  # just restarted: c may only not have heartbeated yet
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


def test_a_dead_unit_starts_its_clock_and_unreachable_says_nothing():
    rep = ReplicaRecord("a", "gpuhub-kernel-k1-r0", {}, id=0)
    rep.note_state("failed", 100.0)
    rep.note_state("unreachable", 105.0)  # the agent did not answer: the unit may still be dead
    rep.note_state("gone", 107.0)
    assert rep.dead_since == 100.0
    rep.note_state("activating", 108.0)  # systemd restarted it
    assert rep.dead_since == 0.0


async def test_a_dead_unit_on_a_live_node_is_lost_only_after_the_grace(tmp_path):
    s = scheduler_with(tmp_path, live=["a", "b", "c"], lost=[])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    dead = record.replicas[2]
    now = time.time()
    dead.note_state("failed", now - 1)  # e.g. a kernel shutting down: its replicas exit first
    assert s.why_lost(dead, now) is None
    await s.heal()
    assert [r.node for r in record.replicas] == ["a", "b", "c"] and s.counters["replacements"] == 0
    dead.dead_since = now - s.config.replica_dead_grace_s - 1
    assert s.why_lost(dead, now) == "its unit on c is failed"
    assert s.why_lost(record.replicas[0], now) is None


async def test_dead_units_count_against_the_majority(tmp_path, caplog):
    s = scheduler_with(tmp_path, live=["a", "b", "c", "d"], lost=[])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    for rep in record.replicas[1:]:
        rep.note_state("gone", time.time() - 60)
    with caplog.at_level(logging.WARNING):
        await s.heal()
    assert [r.node for r in record.replicas] == ["a", "b", "c"] and s.counters["replacements"] == 0
    assert any("only 1 of 3 replicas are running" in r.message for r in caplog.records)


def test_the_key_is_in_the_books_but_never_in_a_view(tmp_path):
    s = scheduler_with(tmp_path, live=["a"], lost=[])
    s.kernels["k1"] = kernel(["a"], key="very-secret")
    assert "very-secret" not in str(s.kernels["k1"].view())
    s.save()
    assert (tmp_path / "books.json").stat().st_mode & 0o077 == 0
    again = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    again.load()
    assert again.kernels["k1"].key == "very-secret"


def test_corrupt_books_are_rebuilt_from_the_agents(tmp_path, caplog):
    (tmp_path / "books.json").write_text('{"kernels": {"k1": ')  # cut off by a crash of an older version
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    with caplog.at_level(logging.ERROR):
        s.load()
    assert s.kernels == {} and s.nodes == {}
    assert any("are corrupt" in r.message for r in caplog.records)
    Scheduler(SchedulerConfig(state_dir=str(tmp_path / "none")), agent_token="t").load()  # no books yet: fine


class AgentBooks:
    """What agents answer to the scheduler's reconcile (GET /api/v1/units, DELETE of a unit): their
    unit records, as a real agent keeps them. Stands in for the HTTP hop only."""

    def __init__(self, units: dict[str, list[dict]]) -> None:
        self.units = units  # node -> unit views
        self.deleted: list[tuple[str, str]] = []
        self.down: set[str] = set()  # nodes whose agent does not answer

    async def __call__(self, method: str, url: str, token: str, body=None, timeout: float = 20.0):
        node = url.split("//", 1)[1].split(".invalid", 1)[0]
        if node in self.down:
            raise ApiClientError(0, "connection refused", url)
        if method == "GET" and url.endswith("/api/v1/units"):
            return 200, {"units": self.units[node]}
        if method == "DELETE":
            name = url.rsplit("/", 1)[1]
            self.deleted.append((node, name))
            self.units[node] = [u for u in self.units[node] if u["name"] != name]
            return 200, {"stopped": name}
        raise AssertionError(f"unexpected {method} {url}")


async def test_a_kernel_whose_units_exited_cleanly_is_forgotten_and_its_units_dropped(tmp_path, monkeypatch):
    """Under systemd a unit that exited cleanly is forgotten by systemd ("gone"), while its agent
    keeps the record and the replica's journal until told. The kernel must go from the books and
    from every agent, not be adopted again at the next reconcile."""
    import gpuhub.scheduler.service as service

    s = scheduler_with(tmp_path, live=["a", "b", "c"], lost=[])
    names = [f"gpuhub-kernel-k1-r{i}" for i in range(3)]
    books = AgentBooks({n: [{"name": names[i], "kind": "kernel", "kernel_id": "k1", "user": "alice",
                             "replica_id": i, "state": "gone"}] for i, n in enumerate("abc")})
    monkeypatch.setattr(service, "call_json", books)
    s.kernels["k1"] = kernel(["a", "b", "c"])
    await s.reconcile()
    assert "k1" not in s.kernels
    assert sorted(books.deleted) == [("a", names[0]), ("b", names[1]), ("c", names[2])]
    await s.reconcile()  # nothing left to adopt
    assert "k1" not in s.kernels and len(books.deleted) == 3


def running_kernel_k1(tmp_path, live=("a", "b", "c")) -> tuple[Scheduler, AgentBooks]:
    """A scheduler with kernel k1's three replicas running on a, b and c (of the servers ``live``),
    and those agents' books."""
    s = scheduler_with(tmp_path, live=list(live), lost=[])
    s.kernels["k1"] = kernel(["a", "b", "c"])
    s.kernels["k1"].incarnation = "first"
    books = AgentBooks({n: [] for n in live})
    for i, n in enumerate("abc"):
        books.units[n] = [unit_view(i, "first")]
    return s, books


def unit_view(replica_id: int, incarnation: str) -> dict:
    """A replica unit of k1 as its agent lists it."""
    return {"name": f"gpuhub-kernel-k1-r{replica_id}", "kind": "kernel", "kernel_id": "k1", "user": "alice",
            "gpus": 1, "replica_id": replica_id, "state": "active", "incarnation": incarnation}


async def test_a_kernel_deleted_while_a_reconcile_lists_its_units_is_not_adopted_again(tmp_path, monkeypatch):
    """JupyterLab's restart deletes the kernel and creates it again under the same id at once. A
    reconcile whose listing was taken before the delete still shows the old units: adopting them
    would hand the new kernel's creation the exited replicas' record."""
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path)
    listed, go = asyncio.Event(), asyncio.Event()

    async def first_listing_held(method, url, token, body=None, timeout=20.0):
        status, answer = await books(method, url, token, body, timeout)
        if method == "GET" and not listed.is_set():
            answer = {"units": list(answer["units"])}  # as of now
            listed.set()
            await go.wait()
        return status, answer

    monkeypatch.setattr(service, "call_json", first_listing_held)
    reconciling = asyncio.create_task(s.reconcile())
    await listed.wait()
    assert await s.delete_kernel("k1")
    go.set()
    await reconciling
    assert "k1" not in s.kernels
    assert sorted(books.deleted) == [(n, f"gpuhub-kernel-k1-r{i}") for i, n in enumerate("abc")]


async def test_a_kernel_whose_delete_is_stopping_its_units_is_not_adopted_by_a_reconcile(tmp_path, monkeypatch):
    """The same while the delete waits for an agent to stop a unit: the listing shows the others."""
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path)
    stopping, go = asyncio.Event(), asyncio.Event()

    async def first_stop_held(method, url, token, body=None, timeout=20.0):
        if method == "DELETE" and not stopping.is_set():
            stopping.set()
            await go.wait()
        return await books(method, url, token, body, timeout)

    monkeypatch.setattr(service, "call_json", first_stop_held)
    deleting = asyncio.create_task(s.delete_kernel("k1"))
    await stopping.wait()
    await s.reconcile()
    go.set()
    assert await deleting
    assert "k1" not in s.kernels
    assert sorted(books.deleted) == [(n, f"gpuhub-kernel-k1-r{i}") for i, n in enumerate("abc")]


async def test_a_deleted_kernels_replica_whose_server_did_not_answer_is_stopped_when_it_is_back(
        tmp_path, monkeypatch):
    """Without this the next reconcile adopts the kernel back from that replica, key and all."""
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path)
    monkeypatch.setattr(service, "call_json", books)
    books.down.add("a")
    assert await s.delete_kernel("k1")
    assert sorted(books.deleted) == [("b", "gpuhub-kernel-k1-r1"), ("c", "gpuhub-kernel-k1-r2")]
    again = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=5), agent_token="t")
    again.load()  # a scheduler restarted meanwhile remembers it too
    again.nodes = s.nodes
    await again.reconcile()  # "a" still down: nothing to do
    books.down.clear()
    await again.reconcile()
    assert "k1" not in again.kernels
    assert ("a", "gpuhub-kernel-k1-r0") in books.deleted and books.units["a"] == []
    assert again._unstopped == {}


async def test_a_replica_of_an_earlier_kernel_under_the_id_is_stopped_and_the_new_ones_kept(tmp_path, monkeypatch):
    """A restart creates the kernel anew under its id; a replica of the earlier one whose server did
    not answer the delete has the same unit name as one of the new kernel's on another server."""
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path, live=("a", "b", "c", "d"))
    books.units["d"] = [unit_view(0, "earlier")]  # replica 0 of the earlier kernel, on d
    monkeypatch.setattr(service, "call_json", books)
    await s.reconcile()
    assert books.deleted == [("d", "gpuhub-kernel-k1-r0")]
    record = s.kernels["k1"]
    assert [(r.node, r.unit, r.state) for r in record.replicas] == [
        (n, f"gpuhub-kernel-k1-r{i}", "active") for i, n in enumerate("abc")]


# What the release before incarnations and restart counts reads with ReplicaRecord(**entry).
PREVIOUS_REPLICA_FIELDS = {"node", "unit", "connection", "id", "state", "dead_since", "error"}


async def test_a_replica_whose_unit_keeps_failing_and_restarting_is_replaced(tmp_path, monkeypatch):
    """A replica that cannot join its group exits after its ready timeout (2 minutes) and systemd
    starts it again, too slowly for systemd's start limit: "active" between tries, never of use.
    Its agent says how often systemd restarted it; from the third time on it is replaced."""
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path, live=("a", "b", "c", "d"))
    books.units["c"][0]["restarts"] = 2
    monkeypatch.setattr(service, "call_json", books)
    await s.reconcile()
    record = s.kernels["k1"]
    now = time.time()
    assert [s.why_lost(r, now) for r in record.replicas] == [None, None, None]
    books.units["c"][0]["restarts"] = 3
    await s.reconcile()
    assert [s.why_lost(r, now) for r in record.replicas] == [
        None, None, "its unit on c failed and was restarted 3 times"]
    started, stopped = stub_agents(s, monkeypatch)
    await s.heal()
    assert started == ["d"] and stopped == ["c"]  # not on c again, where it kept failing


async def test_a_replica_that_kept_failing_is_replaced_on_its_own_server_when_no_other_can_take_it(
        tmp_path, monkeypatch):
    import gpuhub.scheduler.service as service

    s, books = running_kernel_k1(tmp_path)
    books.units["c"][0]["restarts"] = 3
    monkeypatch.setattr(service, "call_json", books)
    await s.reconcile()
    started, stopped = stub_agents(s, monkeypatch)
    await s.heal()
    assert started == ["c"] and stopped == ["c"]


def test_the_books_keep_incarnations_beside_the_records_and_load_records_with_fields_they_do_not_know(tmp_path):
    """A rollback runs the previous release on this release's books, and the other way round."""
    import json

    s, _ = running_kernel_k1(tmp_path)
    s._unstopped[("d", "gpuhub-kernel-k2-r0")] = "gone-kernel"
    s.save()
    books = json.loads((tmp_path / "books.json").read_text())
    assert "incarnation" not in books["kernels"]["k1"] and books["incarnations"] == {"k1": "first"}
    assert all(set(r) <= PREVIOUS_REPLICA_FIELDS for r in books["kernels"]["k1"]["replicas"])
    books["kernels"]["k1"]["added_later"] = 1
    books["kernels"]["k1"]["replicas"][0]["added_later"] = 2
    (tmp_path / "books.json").write_text(json.dumps(books))
    again = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=5), agent_token="t")
    again.load()
    assert again.kernels["k1"].incarnation == "first" and len(again.kernels["k1"].replicas) == 3
    assert again._unstopped == {("d", "gpuhub-kernel-k2-r0"): "gone-kernel"}


async def test_a_drain_is_kept_across_heartbeats_and_restarts_and_moves_one_replica_at_a_time(tmp_path, monkeypatch):
    s = scheduler_with(tmp_path, live=["a", "b", "c", "d", "e"], lost=[])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    s.set_drained("a", True)
    s.set_drained("b", True)
    s.heartbeat({"node": "a", "url": "http://a.invalid", "gpu_count": 1})  # a heartbeat keeps the drain
    assert {v.name for v in s.node_views() if v.schedulable} == {"c", "d", "e"}
    started, stopped = stub_agents(s, monkeypatch)
    await s.heal()
    # One replica per pass: each move is one membership change of a full group.
    assert len(started) == 1 and stopped == ["a"] and started[0] in {"d", "e"}
    await s.heal()
    assert stopped == ["a", "b"] and set(started) == {"d", "e"}
    assert {r.node for r in record.replicas} == {"c", "d", "e"}
    await s.heal()
    assert len(started) == 2  # nothing left to move

    again = Scheduler(SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=5), agent_token="t")
    again.load()
    assert again.nodes["a"].drained and again.nodes["b"].drained and not again.nodes["c"].drained
    again.set_drained("a", False)
    assert not again.nodes["a"].drained


def test_a_heartbeat_with_a_usage_batch_that_cannot_be_counted_keeps_the_server_live(tmp_path):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path)), agent_token="t")
    answer = s.heartbeat({"node": "gpu1", "url": "http://gpu1:8601", "usage": {"seq": 3, "weeks": []}})
    assert "usage_ack" not in answer and "usage.weeks" in answer["usage_error"]
    assert s.live(s.nodes["gpu1"])
    assert s.heartbeat({"node": "gpu1", "url": "http://gpu1:8601",
                        "usage": {"seq": 4, "weeks": {"2026-11-23": {"alice": 5}}}})["usage_ack"] == 4


def test_a_lease_reported_without_its_user_is_counted_for_its_kernels_user(tmp_path):
    """An agent from before quotas reports leases by holder unit only: the books name the user."""
    s = scheduler_with(tmp_path, live=["gpu1"], lost=[])
    s.kernels["k1"] = KernelRecord("k1", "alice", 1, [ReplicaRecord("gpu1", "gpuhub-kernel-k1-r0", {}, id=0)])
    s.nodes["gpu1"].info["leases"] = [
        {"holder": "gpuhub-kernel-k1-r0", "gpus": [0], "granted_at": 100.0},
        {"holder": "gpuhub-kernel-gone-r0", "gpus": [1], "granted_at": 100.0},
        {"user": "bob", "kernel_id": "k2", "holder": "x", "gpus": [2], "granted_at": 100.0},
        "not a lease",
    ]
    assert [(le.user, le.kernel_id, le.gpus) for le in s.live_leases()] == [
        ("alice", "k1", 1), ("", "", 1), ("bob", "k2", 1)]


def test_a_lingering_lease_counts_for_no_quota_and_reaches_the_books_as_lingering(tmp_path):
    """A lingering lease holds a GPU no cell runs on (taken back when needed): the GPU quota and
    GPU-hours count cells only, and `gpuhub leases` shows it lingering."""
    s = scheduler_with(tmp_path, live=["gpu1"], lost=[])
    lease = {"lease_id": "a1", "holder": "gpuhub-kernel-k1-r0", "gpus": [0], "granted_at": 100.0,
             "user": "alice", "kernel_id": "k1"}
    s.heartbeat({"node": "gpu1", "url": "http://gpu1:8601", "committed": 0, "lingering": 1,
                 "leases": [{**lease, "lingering_pid": 4321, "lingering_since": 150.0},
                            {**lease, "lease_id": "b1", "gpus": [1], "user": "bob", "kernel_id": "k2"}]})
    assert s.nodes["gpu1"].info["leases"][0]["lingering_pid"] == 4321
    assert [(le.user, le.kernel_id) for le in s.live_leases()] == [("bob", "k2")]


@pytest.mark.parametrize("running", [{"leases": ["l1"]}, {"leases": [], "executing": True}],
                         ids=["a GPU cell", "a CPU cell"])
async def test_a_drain_lets_a_running_cell_finish_before_its_replica_moves(tmp_path, monkeypatch, running, caplog):
    import gpuhub.scheduler.service as service

    s = scheduler_with(tmp_path, live=["a", "b", "c", "d"], lost=[])
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    s.set_drained("a", True)
    started, stopped = stub_agents(s, monkeypatch, fence=False)
    answer, calls = dict(running), []

    async def agent(method, url, token, body=None, timeout=20.0):  # a's agent: the fence and its lifting
        calls.append((method, url))
        assert url == "http://a.invalid/api/v1/units/gpuhub-kernel-k1-r0/fence"
        return 200, {"unit": "gpuhub-kernel-k1-r0", "fenced": method == "POST", **answer}

    monkeypatch.setattr(service, "call_json", agent)
    with caplog.at_level(logging.INFO, logger="gpuhub.scheduler.service"):
        await s.heal()
        await s.heal()
    assert started == [] and stopped == []  # its cell runs: it stays
    # ...fenced all the while, so that the kernel's next cell runs on another replica
    assert [m for m, _ in calls] == ["POST", "POST"]
    kind = "GPU" if running["leases"] else "CPU"
    said = [r.getMessage() for r in caplog.records if "k1" in r.getMessage()]
    assert said == [f"kernel k1: its replica on a runs a {kind} cell: it moves once the cell has ended"], said
    [view] = [v for v in s.nodes_view() if v["node"] == "a"]
    waits = [(w["kernel_id"], w["user"], w["why"]) for w in view["drain_waits"]]
    assert waits == [("k1", "alice", f"runs a {kind} cell")], waits
    answer = {"leases": [], "executing": False}
    await s.heal()
    assert started == ["d"] and stopped == ["a"]
    assert [m for m, _ in calls] == ["POST", "POST", "POST"]  # fenced until it is stopped
    assert {r.node for r in record.replicas} == {"b", "c", "d"}
    assert all(v["drain_waits"] == [] for v in s.nodes_view())


async def test_a_drain_fence_held_for_a_running_cell_is_lifted_when_the_server_is_put_back(tmp_path, monkeypatch):
    import gpuhub.scheduler.service as service

    s = scheduler_with(tmp_path, live=["a", "b", "c", "d"], lost=[])
    s.kernels["k1"] = kernel(["a", "b", "c"])
    s.set_drained("a", True)
    stub_agents(s, monkeypatch, fence=False)
    calls = []

    async def agent(method, url, token, body=None, timeout=20.0):
        calls.append(method)
        return 200, {"leases": [], "executing": True}

    monkeypatch.setattr(service, "call_json", agent)
    await s.heal()
    s.set_drained("a", False)
    await s.heal()
    await s.heal()
    assert calls == ["POST", "DELETE"]  # it may run cells again at once, not when the fence lapses


async def test_a_drain_waits_while_the_agent_cannot_be_asked_and_says_so_after_long(tmp_path, monkeypatch, caplog):
    """A CPU cell needs no agent to run: an agent that does not answer (restarting, say) could not
    have seen one, so the replica stays. A drain that waits long says so at WARNING, naming the user."""
    import gpuhub.scheduler.service as service

    s = scheduler_with(tmp_path, live=["a", "b", "c", "d"], lost=[])
    s.kernels["k1"] = kernel(["a", "b", "c"])
    s.set_drained("a", True)
    started, stopped = stub_agents(s, monkeypatch, fence=False)

    async def agent(method, url, token, body=None, timeout=20.0):
        raise ApiClientError(0, "cannot reach: connection refused", url)

    monkeypatch.setattr(service, "call_json", agent)
    with caplog.at_level(logging.INFO, logger="gpuhub.scheduler.service"):
        await s.heal()
        assert started == [] and stopped == []
        monkeypatch.setattr(service, "DRAIN_WAIT_WARN_S", 0.0)
        await s.heal()
    assert started == [] and stopped == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "kernel k1" in r.getMessage()]
    assert warned == ["kernel k1: the drain of a has waited over 0 min for this kernel of alice: its replica there "
                      "could not be fenced (its agent did not answer) (the user can interrupt the cell; deleting "
                      "the kernel ends the wait)"], warned


def test_draining_a_server_that_would_leave_a_kernel_nowhere_to_move_is_refused(tmp_path):
    s = scheduler_with(tmp_path, live=["a", "b", "c"], lost=["d"])
    s.kernels["k1"] = kernel(["a", "b", "c"])
    try:
        s.set_drained("a", True)
    except ValueError as exc:
        assert "kernel k1 (alice) no server to move its replica to" in str(exc)
    else:
        raise AssertionError("a drain with nowhere to go was accepted")
    assert not s.nodes["a"].drained
    s.nodes["d"].seen = time.monotonic()  # a fourth server is back
    assert s.set_drained("a", True).drained
