"""The agent API refuses what it must, with clear messages; it recovers after a restart."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import current_user
from gpuhub.dev.portblocks import reserve_block
from gpuhub.platform import move_fence
from tests.helpers import wait_for
from tests.integration.test_gpu_cells import connect, process_alive, run


def start_unit(agent, name="gpuhub-kernel-t1", gpus=1):
    """A kernel unit, without waiting for the kernel (these tests are about the agent)."""
    key = secrets.token_hex(16)
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": gpus,
        "kernel": {"key": key, "kernel_id": name}})
    assert status == 201, unit
    return key, unit


def start_kernel(agent, name="gpuhub-kernel-t1", gpus=1):
    """A working kernel: a group of one replica (its peers.json names only itself), and a client."""
    key, unit = start_unit(agent, name, gpus)
    conn = unit["connection"]
    status, body = agent.call("PUT", f"/api/v1/units/{name}/peers", {"replicas": [{
        "id": 0, "node": agent.name, "raft": f"{conn['ip']}:{conn['raft_port']}",
        "blob": f"{conn['ip']}:{conn['blob_port']}"}]})
    assert status == 200, body
    return connect(conn, key), unit


def test_token_required(make_agent):
    a = make_agent(gpus=1)
    for path in ("/api/v1/node", "/api/v1/units", "/metrics"):
        assert a.call("GET", path, token=None)[0] == 401
        assert a.call("GET", path, token="not-the-token")[0] == 401
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 1}, token="bogus")
    assert status == 401 and "lease token" in body["error"]


def test_an_agent_that_keeps_only_the_tokens_hash_takes_the_token_and_not_the_hash(tmp_path):
    """The roles give every server ``sha256:<digest>`` of the agent token: what root there can read
    is no token any agent takes."""
    import hashlib

    from gpuhub.dev.cluster import AgentProcess

    a = AgentProcess(tmp_path, "node1", 0)
    stored = "sha256:" + hashlib.sha256(a.token.encode()).hexdigest()
    (a.dir / "secrets" / "agent.token").write_text(stored + "\n")
    a.start()  # waits for an answer to a request with the token itself
    try:
        assert a.call("GET", "/api/v1/node")[0] == 200
        for wrong in (stored, stored.removeprefix("sha256:"), a.token + "x"):
            assert a.call("GET", "/api/v1/node", token=wrong)[0] == 401
    finally:
        a.close()


def test_admin_token_is_not_a_lease_token(make_agent):
    a = make_agent(gpus=1)
    assert a.call("POST", "/api/v1/leases", {"gpus": 1})[0] == 401


@pytest.mark.parametrize("raw,message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"kind": "kernel"}', "missing field 'name'"),
    (b'{"kind": "daemon", "name": "x", "user": "u"}', "'kernel' or 'server'"),
    (b'{"kind": "server", "name": "gpuhub-server-x", "user": "root", "argv": ["/bin/true"], "gpus": "two"}',
     "'gpus' must be"),
    (b'{"kind": "server", "name": "evil; rm -rf /", "user": "u", "argv": ["/bin/true"]}', "unit name"),
    (b'{"kind": "server", "name": "gpuhub-server-x", "user": "u", "env": {"A": 1}}', "map strings to strings"),
    (b'{"kind": "kernel", "name": "gpuhub-kernel-x", "user": "u", "kernel": "k"}',
     "field 'kernel' must be of type dict"),
    (b'{"kind": "server", "name": "gpuhub-server-x", "user": "u", "argv": null}', "field 'argv' must be of type list"),
    (b'{"kind": "kernel", "name": "gpuhub-kernel-x", "user": "u", "gpus": 9, "kernel": {"key": "k"}}', "has 1"),
])
def test_malformed_unit_requests(make_agent, raw, message):
    a = make_agent(gpus=1)
    status, body = a.call("POST", "/api/v1/units", raw=raw)
    assert status == 400 and message in body["error"], body


def test_systemd_backend_refuses_root(tmp_path):
    import asyncio

    from gpuhub.agent.units import SystemdRunner, UnitError, UnitSpec

    runner = SystemdRunner(str(tmp_path), min_uid=1000)
    with pytest.raises(UnitError, match="refusing to run as 'root'"):
        asyncio.run(runner.start(UnitSpec("gpuhub-kernel-x", "kernel", "root", ["/bin/true"], {}, "")))
    with pytest.raises(UnitError, match="does not exist"):
        asyncio.run(runner.start(UnitSpec("gpuhub-kernel-x", "kernel", "no-such-user-xyz", ["/bin/true"], {}, "")))


def test_systemd_status_says_how_often_systemd_restarted_a_unit(tmp_path, monkeypatch):
    """A replica that cannot join its group exits every 2 minutes and is started again: "active"
    most of the time, so the restart count is what tells the scheduler (REPLICA_RESTARTS_LOST)."""
    import asyncio

    from gpuhub.agent.units import SystemdRunner

    runner = SystemdRunner(str(tmp_path), min_uid=1000)
    shown = "ActiveState=active\nMainPID=4321\nUser=alice\nLoadState=loaded\nNRestarts=5\n"

    async def show(*argv, check=True):
        assert any("NRestarts" in a for a in argv)
        return shown

    monkeypatch.setattr(runner, "_run", show)
    st = asyncio.run(runner.status("gpuhub-kernel-k1-r0"))
    assert (st.active, st.state, st.main_pid, st.user, st.restarts) == (True, "active", 4321, "alice", 5)
    shown = "ActiveState=active\nMainPID=4321\nUser=alice\nLoadState=loaded\nNRestarts=[not set]\n"
    assert asyncio.run(runner.status("gpuhub-kernel-k1-r0")).restarts == 0


def test_lease_limited_to_placed_gpus(make_agent):
    a = make_agent(gpus=2)
    start_unit(a, gpus=1)
    token = _lease_token(a, "gpuhub-kernel-t1")
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 2}, token=token)
    assert status == 400 and "placed with 1" in body["error"]
    for bad, message in (({}, "missing field 'gpus'"), ({"gpus": True}, "field 'gpus' must be a number"),
                         ({"gpus": -1}, "must not be negative"),
                         ({"gpus": 1, "holder_pid": "1"}, "field 'holder_pid' must be of type int")):
        status, body = a.call("POST", "/api/v1/leases", bad, token=token)
        assert status == 400 and message in body["error"], body
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
    assert status == 200
    assert a.call("DELETE", f"/api/v1/leases/{body['lease_id']}", token=token)[1]["released"] is True
    assert a.call("DELETE", f"/api/v1/leases/{body['lease_id']}", token=token)[1]["released"] is False


def test_a_unit_holds_one_lease_however_often_it_asks(make_agent):
    """The lease token is in the kernel's environment, so user code can call the agent itself:
    asking again replaces the unit's lease instead of taking the node's other GPUs."""
    a = make_agent(gpus=2)
    start_unit(a, gpus=1)
    token = _lease_token(a, "gpuhub-kernel-t1")
    first = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[1]
    second = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[1]
    assert first["lease_id"] != second["lease_id"]
    node = a.call("GET", "/api/v1/node")[1]
    assert node["committed"] == 1 and [le["lease_id"] for le in node["leases"]] == [second["lease_id"]]
    assert a.call("DELETE", f"/api/v1/leases/{first['lease_id']}", token=token)[1]["released"] is False
    assert a.call("DELETE", f"/api/v1/leases/{second['lease_id']}", token=token)[1]["released"] is True


def test_a_fenced_replica_gets_no_gpu_and_the_fence_says_what_it_holds(make_agent):
    """A migration fences the replica it moves away (docs/architecture.md, "Migration"): the answer
    lists the leases it holds (then the scheduler calls the move off), and until the fence is
    lifted it gets no new ones, so it can never become the executor of the waiting cell."""
    a = make_agent(gpus=2)
    start_unit(a, gpus=1)
    token = _lease_token(a, "gpuhub-kernel-t1")
    held = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[1]["lease_id"]
    status, fence = a.call("POST", "/api/v1/units/gpuhub-kernel-t1/fence")
    assert status == 200 and fence == {"unit": "gpuhub-kernel-t1", "fenced": True, "leases": [held],
                                       "executing": False}
    assert a.call("DELETE", f"/api/v1/leases/{held}", token=token)[1]["released"] is True
    assert a.call("POST", "/api/v1/units/gpuhub-kernel-t1/fence")[1]["leases"] == []
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
    assert status == 409, body  # a GPU is free, but not for a replica on its way out
    # A CPU kernel's replica learns of the fence from its unit directory, and says there that a
    # cell runs (gpuhub/platform/move_fence.py): the fence's answer says so too.
    unit_dir = a.dir / "run" / "units" / "gpuhub-kernel-t1"
    assert move_fence.fenced(unit_dir)
    (unit_dir / move_fence.EXECUTING_FILE).write_bytes(b"1")
    assert a.call("POST", "/api/v1/units/gpuhub-kernel-t1/fence")[1]["executing"] is True
    (unit_dir / move_fence.EXECUTING_FILE).write_bytes(b"0")
    assert a.call("DELETE", "/api/v1/units/gpuhub-kernel-t1/fence")[1]["fenced"] is False
    assert not move_fence.fenced(unit_dir)
    assert a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[0] == 200
    # A fence its replica could not see is no fence: the move must wait (a full /run, or here a
    # directory where the fence file goes).
    (unit_dir / move_fence.FENCE_FILE / "x").mkdir(parents=True)
    status, body = a.call("POST", "/api/v1/units/gpuhub-kernel-t1/fence")
    assert status == 503 and "could not write the fence of gpuhub-kernel-t1" in body["error"], body
    # The scheduler's call: the kernel's own lease token cannot fence or unfence.
    assert a.call("POST", "/api/v1/units/gpuhub-kernel-t1/fence", token=token)[0] == 401
    assert a.call("POST", "/api/v1/units/gpuhub-kernel-nosuch/fence")[0] == 404


def test_a_lease_lingers_only_on_a_process_of_the_units_own_replica(make_agent):
    """The agent kills a lingering lease's process when another grant needs its GPUs, and it runs
    as root: user code holding the lease token must not be able to name any other process. Here the
    unit's main process is `start_unit`'s (not a kernel): no process qualifies but its children."""
    a = make_agent(gpus=1)
    start_unit(a, gpus=1)
    token = _lease_token(a, "gpuhub-kernel-t1")
    lease = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)[1]["lease_id"]
    stranger = subprocess.Popen(["sleep", "60"])  # another process of the same user: not the unit's child
    try:
        for pid in (stranger.pid, os.getpid(), 1):
            status, body = a.call("POST", f"/api/v1/leases/{lease}/linger", {"pid": pid}, token=token)
            assert status == 400 and "is not a running cell process of this kernel" in body["error"], body
        assert process_alive(stranger.pid)
        for bad, message in (({}, "missing field 'pid'"), ({"pid": "1"}, "field 'pid' must be of type int"),
                             ({"pid": 5, "waited_s": -1}, "waited_s must be seconds")):
            status, body = a.call("POST", f"/api/v1/leases/{lease}/linger", bad, token=token)
            assert status == 400 and message in body["error"], body
        node = a.call("GET", "/api/v1/node")[1]
        assert node["committed"] == 1 and node["lingering"] == 0  # refused: the lease stays as it was
        assert a.call("POST", f"/api/v1/leases/{lease}/resume", {}, token=token)[0] == 409  # not lingering
        assert a.call("POST", "/api/v1/leases/nosuch/linger", {"pid": stranger.pid}, token=token)[0] == 404
        assert a.call("POST", f"/api/v1/leases/{lease}/linger", {"pid": stranger.pid})[0] == 401
    finally:
        stranger.kill()
        stranger.wait()


def _lease_token(agent, unit):
    """From the unit's environment file (the process backend writes one like systemd's)."""
    return ProcessRunner(str(agent.dir / "run"), 0).read_env(unit)["GPUHUB_LEASE_TOKEN"]


def test_dead_holder_lease_expires(make_agent):
    a = make_agent(gpus=1)
    start_unit(a, gpus=1)
    token = _lease_token(a, "gpuhub-kernel-t1")
    holder = subprocess.Popen(["sleep", "60"])  # stands for the forked cell child holding the GPU
    assert a.call("POST", "/api/v1/leases", {"gpus": 1, "holder_pid": holder.pid}, token=token)[0] == 200
    assert a.call("GET", "/api/v1/node")[1]["committed"] == 1
    holder.kill()
    holder.wait()
    wait_for(lambda: a.call("GET", "/api/v1/node")[1]["committed"] == 0, 10, "the dead holder's lease to expire")
    assert "gpuhub_agent_leases_expired_total" in a.call("GET", "/metrics")[1]


def test_agent_restart_keeps_units_and_leases(make_agent):
    a = make_agent(gpus=2)
    kc, _ = start_kernel(a, gpus=1)
    run(kc, "x = 41")
    token = _lease_token(a, "gpuhub-kernel-t1")
    status, _ = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
    assert status == 200
    a.stop(kill=True)
    a.start()
    _, node = a.call("GET", "/api/v1/node")
    assert node["units"] == 1 and node["committed"] == 1 and node["pending"] == 1
    _, out = run(kc, "print(x + 1)")
    assert out["stdout"].strip() == "42"
    kc.stop_channels()


def test_kernel_ports_come_from_the_configured_range_and_are_not_handed_out_twice(make_agent):
    # The range lies in a port block this test holds (gpuhub/dev/portblocks.py): a fixed range
    # (28000-28013 once) met ports that other agents' replicas on this machine still held.
    with reserve_block() as block:
        lo, hi = block.first, block.first + 13  # room for exactly two kernel units
        agent = make_agent(extra={"kernel_ports": [lo, hi]})
        names = [f"gpuhub-kernel-k{i}-r0" for i in range(3)]
        body = {"kind": "kernel", "user": current_user(), "gpus": 0, "kernel": {"key": "k", "kernel_id": "k"}}
        ports = []
        for name in names[:2]:
            status, unit = agent.call("POST", "/api/v1/units", {"name": name, **body})
            assert status == 201, unit
            ports += [v for k, v in unit["connection"].items() if k.endswith("_port")]
        assert sorted(ports) == list(range(lo, hi + 1))
        status, err = agent.call("POST", "/api/v1/units", {"name": names[2], **body})
        assert status >= 400 and f"no 7 free kernel ports left in {lo}-{hi}" in err["error"]


def test_a_dead_unit_shows_the_end_of_its_log_without_its_secrets(make_agent):
    a = make_agent(gpus=0)
    secret = secrets.token_urlsafe(16)
    script = ("import os, sys\n"
              "for i in range(40): print('line', i)\n"
              "print('the token is', os.environ['GPUHUB_API_TOKEN'])\n"
              "raise ImportError('No module named cryptography')\n")
    status, unit = a.call("POST", "/api/v1/units", {
        "name": "gpuhub-server-broken", "kind": "server", "user": current_user(),
        "argv": [sys.executable, "-u", "-c", script], "env": {"GPUHUB_API_TOKEN": secret}})
    assert status == 201, unit
    unit = wait_for(lambda: (u := a.call("GET", "/api/v1/units/gpuhub-server-broken")[1])["state"] == "failed" and u,
                    timeout=30, what="the unit to fail")
    error = unit["error"]
    assert error.endswith("ImportError: No module named cryptography")
    assert "the token is [secret]" in error and secret not in error
    assert len(error.splitlines()) <= 20 and "line 39" in error and "line 10" not in error
    # a running unit has no error; the list leaves errors to the single-unit view
    start_unit(a, gpus=0)
    assert a.call("GET", "/api/v1/units/gpuhub-kernel-t1")[1]["error"] is None
    assert all("error" not in u for u in a.call("GET", "/api/v1/units")[1]["units"])


def unit_environ(pid: int) -> dict[str, str]:
    """The environment the unit's process started with. Popen returns once exec closed its pipe,
    a moment before the kernel has placed the new environment: until then the file reads empty."""
    def read() -> dict[str, str]:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)
    return wait_for(read, 10, f"process {pid}'s environment")


def test_only_a_grant_shows_a_gpu_to_cuda(make_agent):
    """A CPU kernel and a user's server see no GPU through CUDA (CUDA_VISIBLE_DEVICES empty, whatever
    the request's env says); a GPU kernel's replica leaves it to each cell's grant."""
    a = make_agent(gpus=1)
    _, cpu = start_unit(a, "gpuhub-kernel-cpu1", gpus=0)
    _, gpu = start_unit(a, "gpuhub-kernel-gpu1", gpus=1)
    status, server = a.call("POST", "/api/v1/units", {
        "name": "gpuhub-server-env1", "kind": "server", "user": current_user(),
        "argv": [sys.executable, "-c", "import time; time.sleep(600)"], "env": {"CUDA_VISIBLE_DEVICES": "0"}})
    assert status == 201, server
    assert unit_environ(cpu["main_pid"])["CUDA_VISIBLE_DEVICES"] == ""
    assert unit_environ(server["main_pid"])["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in unit_environ(gpu["main_pid"])
