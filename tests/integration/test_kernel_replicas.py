"""Kernel replicas that can find each other: ports, environment, journal and peers.json per replica,
and the scheduler starting R replicas and telling each the whole group.

Nothing here needs the kernel to work: the tests look at what the agent gives a unit (its env file,
its connection, its directories), never at what the kernel process does with it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import time
import uuid

import pytest

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import SchedulerProcess, current_user
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.service import KernelRecord, ReplicaRecord, Scheduler
from tests.helpers import wait_for

JUPYTER_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def start_unit(agent, name, replica_id=None, kernel_id="k1", gpus=0, key=None, incarnation=None):
    kernel = {"key": key or secrets.token_hex(16), "kernel_id": kernel_id}
    if replica_id is not None:
        kernel["replica_id"] = replica_id
    if incarnation is not None:
        kernel["incarnation"] = incarnation
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": gpus, "kernel": kernel})
    assert status == 201, unit
    return unit


def unit_env(agent, name) -> dict[str, str]:
    """The environment the agent gave the unit (its env file, as systemd would read it)."""
    return ProcessRunner(str(agent.dir / "run"), 0).read_env(name)


def unit_dir(agent, name):
    return agent.dir / "run" / "units" / name


def journal(agent, name):
    return agent.dir / "state" / "journals" / name


def peer(rid, conn, node="n"):
    return {"id": rid, "node": node, "raft": f"{conn['ip']}:{conn['raft_port']}",
            "blob": f"{conn['ip']}:{conn['blob_port']}", "connection": conn}


def wait_gone(path, timeout=10):
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


# --- agent: kernel units ---------------------------------------------------------------------------

def test_kernel_unit_gets_raft_and_blob_ports_env_and_journal(make_agent):
    a = make_agent(gpus=1)
    name = "gpuhub-kernel-k1-r2"
    unit = start_unit(a, name, replica_id=2)
    conn = unit["connection"]
    assert unit["replica_id"] == 2
    ports = [conn[p] for p in (*JUPYTER_PORTS, "raft_port", "blob_port")]
    assert all(isinstance(p, int) and 0 < p < 65536 for p in ports) and len(set(ports)) == 7, conn
    assert conn["ip"] == "127.0.0.1" and "key" not in conn

    env = unit_env(a, name)
    assert env["GPUHUB_REPLICA_ID"] == "2"
    assert env["GPUHUB_PEERS_FILE"] == str(unit_dir(a, name) / "peers.json")
    assert env["GPUHUB_JOURNAL_DIR"] == str(journal(a, name))
    assert env["GPUHUB_RAFT_ADDR"] == f"127.0.0.1:{conn['raft_port']}"
    assert env["GPUHUB_BLOB_ADDR"] == f"127.0.0.1:{conn['blob_port']}"

    # The connection file the kernel reads carries the two extra ports (Jupyter ignores them) and the key.
    on_disk = json.loads((unit_dir(a, name) / "connection.json").read_text())
    assert {k: on_disk[k] for k in conn} == conn and on_disk["key"]

    st = journal(a, name).stat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()

    # The unit list and a single unit show the same record.
    _, listed = a.call("GET", "/api/v1/units")
    assert [u["connection"] for u in listed["units"] if u["name"] == name] == [conn]

    assert a.call("DELETE", f"/api/v1/units/{name}")[0] == 200
    assert not journal(a, name).exists() and not unit_dir(a, name).exists()
    assert not (a.dir / "run" / "units" / f"{name}.env").exists()


def test_replica_id_defaults_to_zero(make_agent):
    a = make_agent(gpus=0)
    unit = start_unit(a, "gpuhub-kernel-k1-r0")
    assert unit["replica_id"] == 0
    assert unit_env(a, "gpuhub-kernel-k1-r0")["GPUHUB_REPLICA_ID"] == "0"


@pytest.mark.parametrize(("field", "bad"), [
    *(("replica_id", bad) for bad in (-1, "1", True, 1.5, None)),
    *(("incarnation", bad) for bad in (1, "a b", "../x", "x" * 65, None)),
])
def test_a_bad_replica_id_or_incarnation_is_refused(make_agent, field, bad):
    a = make_agent(gpus=0)
    status, body = a.call("POST", "/api/v1/units", {
        "name": "gpuhub-kernel-k1-r0", "kind": "kernel", "user": current_user(),
        "kernel": {"key": "k", "kernel_id": "k1", field: bad}})
    assert status == 400 and f"kernel.{field}" in body["error"], body
    assert not (a.dir / "state" / "journals" / "gpuhub-kernel-k1-r0").exists()


def test_a_kernel_created_anew_under_its_id_gets_neither_the_earlier_units_process_nor_its_journal(make_agent):
    """A restarted kernel keeps its id and key. If a replica of the earlier kernel was left running
    (its agent did not answer the delete), the new kernel's start under that name must not be
    answered with it, nor start from its journal: the earlier kernel's variables would come back."""
    a = make_agent(gpus=0)
    name, key = "gpuhub-kernel-k1-r0", secrets.token_hex(16)
    first = start_unit(a, name, key=key, incarnation="first")
    (journal(a, name) / "earlier-log").write_text("x = 1")
    assert start_unit(a, name, key=key, incarnation="first")["main_pid"] == first["main_pid"]  # a retry
    second = start_unit(a, name, key=key, incarnation="second")
    assert second["main_pid"] != first["main_pid"] and second["incarnation"] == "second"
    assert journal(a, name).is_dir() and list(journal(a, name).iterdir()) == []
    _, listed = a.call("GET", "/api/v1/units")
    assert [(u["name"], u["incarnation"]) for u in listed["units"]] == [(name, "second")]
    assert "earlier kernel" in (a.dir / "agent.log").read_text()


def test_a_journal_no_unit_owns_is_not_given_to_a_new_replica(make_agent):
    a = make_agent(gpus=0)
    name = "gpuhub-kernel-k1-r0"
    journal(a, name).mkdir(parents=True)
    (journal(a, name) / "left-over").write_text("x = 1")
    start_unit(a, name, incarnation="new")
    assert list(journal(a, name).iterdir()) == []


# --- agent: PUT /api/v1/units/{name}/peers -----------------------------------------------------------

@pytest.fixture
def replica(make_agent):
    """One kernel unit (replica 1 of a group) on an agent: (agent, unit name, its connection)."""
    a = make_agent(gpus=0)
    name = "gpuhub-kernel-k1-r1"
    return a, name, start_unit(a, name, replica_id=1)["connection"]


def test_peers_written_atomically_0600_and_overwritten(replica):
    a, name, conn = replica
    others = {"ip": "10.0.0.9", "raft_port": 41000, "blob_port": 41001}
    doc = {"replicas": [peer(2, others, "gpu3"), peer(1, conn, "gpu1"), peer(0, others, "gpu2")]}
    status, body = a.call("PUT", f"/api/v1/units/{name}/peers", doc)
    assert status == 200, body
    path = unit_dir(a, name) / "peers.json"
    assert body["peers_file"] == str(path) == unit_env(a, name)["GPUHUB_PEERS_FILE"]
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    written = json.loads(path.read_text())
    assert written["kernel_id"] == "k1"
    assert [r["id"] for r in written["replicas"]] == [0, 1, 2]  # sorted by id
    assert written["replicas"][1] == peer(1, conn, "gpu1")
    assert written["replicas"][2]["raft"] == "10.0.0.9:41000" and written["replicas"][2]["blob"] == "10.0.0.9:41001"
    # A replica replaced on a new node: the scheduler sends the group again; the file is replaced.
    doc["replicas"][0] = peer(2, {"ip": "10.0.0.7", "raft_port": 42000, "blob_port": 42001}, "gpu4")
    assert a.call("PUT", f"/api/v1/units/{name}/peers", doc)[0] == 200
    written = json.loads(path.read_text())
    assert written["replicas"][2] == peer(2, {"ip": "10.0.0.7", "raft_port": 42000, "blob_port": 42001}, "gpu4")
    assert sorted(p.name for p in unit_dir(a, name).iterdir() if "peers" in p.name) == ["peers.json"]  # no temp left


def test_peers_replaces_a_planted_symlink_without_following_it(replica, tmp_path):
    a, name, conn = replica
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (unit_dir(a, name) / "peers.json").symlink_to(victim)  # the unit's user owns its directory
    assert a.call("PUT", f"/api/v1/units/{name}/peers", {"replicas": [peer(1, conn)]})[0] == 200
    path = unit_dir(a, name) / "peers.json"
    assert not path.is_symlink() and json.loads(path.read_text())["replicas"][0]["id"] == 1
    assert victim.read_text() == "untouched"


def test_peers_needs_the_agent_token(replica):
    a, name, conn = replica
    doc = {"replicas": [peer(1, conn)]}
    for token in (None, "not-the-token"):
        status, body = a.call("PUT", f"/api/v1/units/{name}/peers", doc, token=token)
        assert status == 401 and "token" in body["error"]
    assert not (unit_dir(a, name) / "peers.json").exists()


def test_peers_of_unknown_unit_is_404(replica):
    a, _, conn = replica
    status, body = a.call("PUT", "/api/v1/units/gpuhub-kernel-nope-r0/peers", {"replicas": [peer(0, conn)]})
    assert status == 404 and "gpuhub-kernel-nope-r0" in body["error"]


def test_peers_only_for_kernel_units(make_agent):
    a = make_agent(gpus=0)
    status, unit = a.call("POST", "/api/v1/units", {
        "name": "gpuhub-server-alice", "kind": "server", "user": current_user(), "argv": ["sleep", "30"]})
    assert status == 201, unit
    status, body = a.call("PUT", "/api/v1/units/gpuhub-server-alice/peers",
                          {"replicas": [{"id": 0, "raft": "h:1", "blob": "h:2"}]})
    assert status == 400 and "kernel units" in body["error"], body


OWN = object()  # stands for this replica's own, correct entry


@pytest.mark.parametrize("body, message", [
    (b"{nope", "not valid JSON"),
    ({}, "missing field 'replicas'"),
    ({"replicas": {"0": {}}}, "field 'replicas' must be of type list"),
    ({"replicas": []}, "at least one replica"),
    ({"replicas": [OWN, "gpu2:1"]}, "replicas[1] must be an object"),
    ({"replicas": [OWN, {"id": 0, "blob": "h:2"}]}, "replicas[1]: missing field 'raft'"),
    ({"replicas": [OWN, {"id": "0", "raft": "h:1", "blob": "h:2"}]}, "replicas[1]: field 'id' must be of type int"),
    ({"replicas": [OWN, {"id": True, "raft": "h:1", "blob": "h:2"}]}, "replicas[1]: field 'id' must be a number"),
    ({"replicas": [OWN, {"id": -3, "raft": "h:1", "blob": "h:2"}]}, "replicas[1]: field 'id' must be >= 0"),
    ({"replicas": [OWN, {"id": 1, "raft": "h:1", "blob": "h:2"}]}, "replicas[1]: replica id 1 appears twice"),
    ({"replicas": [OWN, {"id": 0, "raft": "gpu2", "blob": "h:2"}]}, "replicas[1]: field 'raft' must be \"host:port\""),
    ({"replicas": [OWN, {"id": 0, "raft": "h:1", "blob": "h:99999"}]}, "field 'blob' must be \"host:port\""),
    ({"replicas": [OWN, {"id": 0, "raft": ":1", "blob": "h:2"}]}, "field 'raft' must be \"host:port\""),
    ({"replicas": [OWN, {"id": 0, "raft": 41000, "blob": "h:2"}]}, "field 'raft' must be of type str"),
    ({"replicas": [OWN, {"id": 0, "raft": "h:1", "blob": "h:2", "connection": "x"}]},
     "field 'connection' must be of type dict"),
    ({"replicas": [{"id": 0, "raft": "h:1", "blob": "h:2"}]}, "is replica 1; the replicas list must include it"),
    ({"replicas": [{"id": 1, "raft": "127.0.0.1:1", "blob": "h:2"}]}, "raft address is 127.0.0.1:"),
])
def test_bad_peers_bodies_are_400_with_a_clear_message(replica, body, message):
    a, name, conn = replica
    if isinstance(body, bytes):
        status, reply = a.call("PUT", f"/api/v1/units/{name}/peers", raw=body)
    else:
        if "replicas" in body and isinstance(body["replicas"], list):
            body = {"replicas": [peer(1, conn) if r is OWN else r for r in body["replicas"]]}
        status, reply = a.call("PUT", f"/api/v1/units/{name}/peers", body)
    assert status == 400 and message in reply["error"], reply
    assert not (unit_dir(a, name) / "peers.json").exists()


# --- agent restarts --------------------------------------------------------------------------------

def _hand_unit_to(agent, name, pid):
    """Make ``pid`` the unit's main process (the process backend's pid file), and end the kernel the
    agent started: the agent's recovery is under test here, not the kernel."""
    old = int((unit_dir(agent, name) / "pid").read_text())
    (unit_dir(agent, name) / "pid").write_text(str(pid))
    try:
        os.killpg(old, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("lose_state_file", [False, True])
def test_agent_restart_keeps_replica_id_connection_and_journal(make_agent, lose_state_file):
    a = make_agent(gpus=1)
    live, dead = "gpuhub-kernel-k1-r2", "gpuhub-kernel-k2-r0"
    unit = start_unit(a, live, replica_id=2, gpus=1, incarnation="first")
    start_unit(a, dead, kernel_id="k2")
    stand_in = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        _hand_unit_to(a, live, stand_in.pid)
        _hand_unit_to(a, dead, 999_999_999)  # no such process
        a.stop(kill=True)
        if lose_state_file:  # adopted from the unit's env file and connection.json instead
            (a.dir / "state" / "state.json").unlink()
        a.start()
        status, again = a.call("GET", f"/api/v1/units/{live}")
        assert status == 200 and again["state"] == "active", again
        assert again["replica_id"] == 2 and again["connection"] == unit["connection"]
        assert again["kernel_id"] == "k1" and again["gpus"] == 1 and again["incarnation"] == "first"
        assert journal(a, live).is_dir()
        # The dead replica is forgotten with its journal: nothing will ever start it again.
        assert a.call("GET", f"/api/v1/units/{dead}")[0] == 404
        assert not journal(a, dead).exists()
        # Peers can still be written after the restart (the agent knows the replica's addresses).
        assert a.call("PUT", f"/api/v1/units/{live}/peers", {"replicas": [peer(2, unit["connection"])]})[0] == 200
        assert a.call("DELETE", f"/api/v1/units/{live}")[0] == 200
        assert not journal(a, live).exists()
    finally:
        stand_in.kill()
        stand_in.wait()


# --- scheduler ------------------------------------------------------------------------------------

def test_scheduler_starts_three_replicas_that_know_each_other(cluster):
    dev = cluster["dev"]
    kid = uuid.uuid4().hex[:10]
    status, record = dev.scheduler_call("POST", "/api/v1/kernels", {
        "kernel_id": kid, "key": secrets.token_hex(16), "gpus": 1, "replicas": 3, "cwd": os.getcwd()})
    assert status == 201, record
    reps = record["replicas"]
    assert [r["id"] for r in reps] == [0, 1, 2]
    assert len({r["node"] for r in reps}) == 3
    assert [r["unit"] for r in reps] == [f"gpuhub-kernel-{kid}-r{i}" for i in range(3)]
    for r in reps:
        assert set(r) >= {"id", "node", "unit", "state", "connection"}
        assert set(r["connection"]) >= {"ip", *JUPYTER_PORTS, "raft_port", "blob_port"}
    expected = [{"id": r["id"], "node": r["node"],
                 "raft": f"{r['connection']['ip']}:{r['connection']['raft_port']}",
                 "blob": f"{r['connection']['ip']}:{r['connection']['blob_port']}"} for r in reps]
    for r in reps:
        agent = dev.agent(r["node"])
        env = unit_env(agent, r["unit"])
        assert env["GPUHUB_REPLICA_ID"] == str(r["id"])
        assert env["GPUHUB_RAFT_ADDR"] == expected[r["id"]]["raft"]
        assert env["GPUHUB_BLOB_ADDR"] == expected[r["id"]]["blob"]
        peers = json.loads((unit_dir(agent, r["unit"]) / "peers.json").read_text())
        assert peers["kernel_id"] == kid
        assert [{k: p[k] for k in ("id", "node", "raft", "blob")} for p in peers["replicas"]] == expected
        assert [p["connection"] for p in peers["replicas"]] == [x["connection"] for x in reps]
        assert journal(agent, r["unit"]).is_dir()
    # one creation of the kernel: every replica carries its nonce (a restart under the id gets another)
    incarnations = {unit_env(dev.agent(r["node"]), r["unit"])["GPUHUB_KERNEL_INCARNATION"] for r in reps}
    assert len(incarnations) == 1 and len(incarnations.pop()) == 16

    status, view = dev.scheduler_call("GET", f"/api/v1/kernels/{kid}")
    assert status == 200
    assert [(r["id"], r["node"], r["unit"], r["connection"]) for r in view["replicas"]] == \
        [(r["id"], r["node"], r["unit"], r["connection"]) for r in reps]
    assert all(r["state"] for r in view["replicas"])

    assert dev.scheduler_call("DELETE", f"/api/v1/kernels/{kid}")[0] == 200
    for r in reps:
        agent = dev.agent(r["node"])
        assert agent.call("GET", f"/api/v1/units/{r['unit']}")[0] == 404
        assert not journal(agent, r["unit"]).exists()


def test_scheduler_all_or_nothing_when_a_node_fails(cluster):
    dev = cluster["dev"]
    dev.agents[2].stop(kill=True)  # still "live" for the scheduler until its heartbeat times out
    kid = uuid.uuid4().hex[:10]
    status, body = dev.scheduler_call("POST", "/api/v1/kernels", {
        "kernel_id": kid, "key": "k", "gpus": 0, "replicas": 3})
    assert status == 502, body
    for agent in dev.agents[:2]:
        assert agent.call("GET", "/api/v1/units")[1]["units"] == []
        journals = agent.dir / "state" / "journals"
        assert not journals.exists() or list(journals.iterdir()) == []
    assert dev.scheduler_call("GET", f"/api/v1/kernels/{kid}")[0] == 404


async def test_reconcile_forgets_a_kernel_whose_replicas_all_died_and_stops_their_units(make_agent, tmp_path):
    a = make_agent("n1", gpus=0)
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path / "sched")), agent_token=a.token)
    s.heartbeat({"node": "n1", "url": a.url})
    units = [start_unit(a, f"gpuhub-kernel-k1-r{i}", replica_id=i) for i in range(3)]
    s.kernels["k1"] = KernelRecord("k1", current_user(), 0, key="k", replicas=[
        ReplicaRecord("n1", u["name"], u["connection"], id=i) for i, u in enumerate(units)])
    for u in units:  # the whole group dies (e.g. every node rebooted); the units stay listed, failed
        os.kill(a.call("GET", f"/api/v1/units/{u['name']}")[1]["main_pid"], signal.SIGKILL)
    wait_for(lambda: all(a.call("GET", f"/api/v1/units/{u['name']}")[1]["state"] == "failed" for u in units),
             10, "the agent to see the units fail")
    await s.reconcile()
    assert "k1" not in s.kernels
    for u in units:
        assert a.call("GET", f"/api/v1/units/{u['name']}")[0] == 404
    await s.reconcile()  # nothing left to adopt again
    assert s.kernels == {}


async def test_a_kernel_whose_server_stopped_asking_about_it_is_stopped_after_the_grace(make_agent, tmp_path):
    """A user's Jupyter server polls its kernels every few seconds. One that crashed (or whose
    host was lost) never stops them: after kernel_orphan_after_s without a word from their user,
    the scheduler stops them, units and all; a kernel still asked about stays."""
    a = make_agent("n1", gpus=0)
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path / "sched"), kernel_orphan_after_s=600),
                  agent_token=a.token)
    s.heartbeat({"node": "n1", "url": a.url})
    units = {}
    for kid in ("orphan", "polled"):
        u = start_unit(a, f"gpuhub-kernel-{kid}-r0", kernel_id=kid)
        units[kid] = u["name"]
        s.kernels[kid] = KernelRecord(kid, current_user(), 0, key="k", replicas=[
            ReplicaRecord("n1", u["name"], u["connection"], id=0)])
    await s.reconcile()  # kernels from the books get a whole grace from the scheduler's start
    assert set(s.kernels) == {"orphan", "polled"}
    s._owner_heard["orphan"] -= 601  # its server crashed ten minutes ago
    s._owner_heard["polled"] -= 601
    s.heard_from_owner("polled")  # this one's server just asked (GET /api/v1/kernels/polled)
    await s.reconcile()
    assert set(s.kernels) == {"polled"}
    assert a.call("GET", f"/api/v1/units/{units['orphan']}")[0] == 404
    assert a.call("GET", f"/api/v1/units/{units['polled']}")[1]["state"] == "active"


def test_books_written_before_replica_ids_still_load(tmp_path):
    sched = SchedulerProcess(tmp_path, secrets.token_urlsafe(24), {})
    (sched.dir / "state").mkdir(mode=0o700)
    old = {"nodes": {"gpu1": {"url": "http://127.0.0.1:9", "info": {"gpu_count": 1}, "last_seen": 0}},
           "kernels": {"abc": {"kernel_id": "abc", "user": "alice", "gpus": 1, "created_at": 1.0, "replicas": [
               {"node": f"gpu{i + 1}", "unit": f"gpuhub-kernel-abc-r{i}", "connection": {"ip": "10.0.0.1"}}
               for i in (0, 2, 1)]}}}
    (sched.dir / "state" / "books.json").write_text(json.dumps(old))
    sched.start()
    try:
        from gpuhub.platform.http_client import ApiClientError, call_json_sync

        def kernels():
            return call_json_sync("GET", sched.url + "/api/v1/kernels", sched.token, timeout=5)[1]["kernels"]

        (k,) = wait_for(kernels, 20, "the scheduler to answer", ignore=(ApiClientError,))
        assert [(r["id"], r["unit"]) for r in k["replicas"]] == [
            (0, "gpuhub-kernel-abc-r0"), (2, "gpuhub-kernel-abc-r2"), (1, "gpuhub-kernel-abc-r1")]
        assert all(r["state"] == "unknown" and r["connection"] == {"ip": "10.0.0.1"} for r in k["replicas"])
    finally:
        sched.stop()


async def test_a_scheduler_that_lost_its_books_gets_each_kernels_key_back_from_the_agents(make_agent, tmp_path):
    """Books lost: reconcile adopts the kernel's replicas, then asks an agent for its key (without it
    no replica of the kernel could ever be replaced), and adopts nothing as a replaced replica."""
    a = make_agent("n1", gpus=0)
    key = secrets.token_hex(16)
    for i in range(3):
        status, unit = a.call("POST", "/api/v1/units", {
            "name": f"gpuhub-kernel-k9-r{i}", "kind": "kernel", "user": current_user(), "gpus": 0,
            "kernel": {"key": key, "kernel_id": "k9", "replica_id": i}})
        assert status == 201, unit
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path / "sched")), agent_token=a.token)
    s.heartbeat({"node": "n1", "url": a.url})
    await s.reconcile()
    assert s.kernels["k9"].key == key and len(s.kernels["k9"].replicas) == 3
    assert json.loads((tmp_path / "sched" / "books.json").read_text())["kernels"]["k9"]["key"] == key
    await s.reconcile()  # with the key: the adopted replicas are the kernel's, none is stopped as replaced
    assert len(s.kernels["k9"].replicas) == 3
    assert len(a.call("GET", "/api/v1/units")[1]["units"]) == 3
    assert a.call("GET", "/api/v1/units/gpuhub-kernel-k9-r0/key", token="wrong")[0] == 401
    assert a.call("GET", "/api/v1/units/gpuhub-kernel-nope-r0/key")[0] == 404


def test_the_scheduler_holds_each_user_to_the_kernel_and_gpu_limits(tmp_path):
    """Limits a user's own server cannot lift by asking the API directly (the spawn form's profile is
    a client-side choice): the largest profile's GPUs per kernel, and kernels and placed GPUs per user."""
    from gpuhub.dev.cluster import DevCluster

    dev = DevCluster(tmp_path, nodes=1, gpus_per_node=2,
                     scheduler_settings={"kernel_max_gpus": 2, "user_max_kernels": 1}).start()
    try:
        def new_kernel(gpus: int):
            return dev.scheduler_call("POST", "/api/v1/kernels", {
                "kernel_id": uuid.uuid4().hex[:10], "key": "k", "gpus": gpus, "replicas": 1})

        status, body = new_kernel(8)
        assert status == 400 and "at most 2 GPU(s), not 8" in body["error"]
        status, first = new_kernel(1)
        assert status == 201, first
        status, body = new_kernel(0)
        assert status == 403 and "the most one user may have at once (user_max_kernels)" in body["error"]
        assert dev.scheduler_call("DELETE", f"/api/v1/kernels/{first['kernel_id']}")[0] == 200
        assert new_kernel(0)[0] == 201  # one shut down: room for the next
    finally:
        dev.stop()
