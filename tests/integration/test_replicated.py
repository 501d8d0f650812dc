"""Replicated kernels on one machine: three replicas, three agents with fake GPUs, the scheduler,
the router and a real jupyter_client client (issue: Raft-replicated kernels)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from functools import partial
from pathlib import Path
from queue import Empty

import numpy as np
import pytest
from jupyter_client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel

from gpuhub.dev.cluster import DevCluster, DevKernel
from gpuhub.kernel.wait_notice import notice_text
from gpuhub.platform.curve import with_keys
from gpuhub.replication import blobclient
from gpuhub.replication.digest import digest
from tests.helpers import wait_for
from tests.integration.test_gpu_cells import SLOW_EXIT, run, wait_for_output


def string_form(inspected: str) -> str:
    """The value's "String form" from IPython's inspect output (colours stripped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", inspected)
    match = re.search(r"String form:\s*(.*?)\n(?:\S|$)", text + "\n", re.S)
    return match.group(1).strip() if match else text


class ReplicatedKernel(DevKernel):
    """A DevKernel whose replicas' namespaces the test can look at one by one."""

    def direct_client(self, rid: int) -> BlockingKernelClient:
        """A client of one replica only: for looking at its namespace (inspect needs no election)."""
        kc = BlockingKernelClient()
        kc.load_connection_info(with_keys(self.replica(rid)["connection"], self.key.encode()))
        kc.start_channels()
        return kc

    def namespace(self, rid: int, names: list[str]) -> dict[str, str | None]:
        kc = self.direct_client(rid)
        try:
            out = {}
            for name in names:
                reply = kc.inspect(name, detail_level=0, reply=True, timeout=20)["content"]
                out[name] = string_form(reply["data"].get("text/plain", "")) if reply.get("found") else None
            return out
        finally:
            kc.stop_channels()


@pytest.fixture
def dev_cluster(tmp_path):
    c = DevCluster(tmp_path, nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


@pytest.fixture
def cpu_kernel(dev_cluster):
    k = ReplicatedKernel(dev_cluster, gpus=0)
    yield k
    k.close()


@pytest.fixture
def gpu_kernel(dev_cluster):
    k = ReplicatedKernel(dev_cluster, gpus=1)
    yield k
    k.close()


def ok(kernel, code, **kw):
    reply, out = run(kernel.kc, code, **kw)
    assert reply["status"] == "ok", (reply, out)
    return out


def executor_id(kernel) -> int:
    """The replica that runs this kernel's cells now (executors are sticky)."""
    node = executor_node(kernel)
    return next(r["id"] for r in kernel.record["replicas"] if r["node"] == node)


def plain_outputs(cells: list[str], timeout: float = 30) -> list[str]:
    """What a plain ipykernel prints for ``cells``, in order: the anchor of a side-by-side test."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        outs = []
        for code in cells:
            reply, out = run(kc, code, timeout=timeout)
            assert reply["status"] == "ok", out
            outs.append(out["stdout"])
        return outs
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def serving_replicas(kernel) -> list[int]:
    """The replicas the kernel's router sends cells to now (asked on the router's loop): live
    (answering heartbeats) and ready (connected, iopub welcomed). A replica back from a pause
    answers heartbeats a moment before its iopub is welcomed again; a cell sent in that moment
    skips it, and it loads that cell's image only with a later one."""
    async def ask():
        return kernel.router.ready_replicas()
    return kernel.loop.run(ask())


def kill_replica(kernel, rid: int) -> None:
    """SIGKILL a replica between cells and wait until its router counts it dead. Until then the
    router may still hand it the next cell, and if it was the executor (the lease holder), the
    others cannot know whether it started that cell: they end it with ExecutorLost rather than
    risk running it twice (docs/architecture.md, "One commit per cell")."""
    os.kill(kernel.pid(rid), signal.SIGKILL)
    wait_for(lambda: rid not in serving_replicas(kernel), 30, f"the router to count replica {rid} dead")


def assert_equal_namespaces(kernel, names, rids=(0, 1, 2)):
    views = {rid: kernel.namespace(rid, names) for rid in rids}
    first = views[rids[0]]
    for rid in rids[1:]:
        assert views[rid] == first, f"replica {rid} differs: {views[rid]} vs {first}"
    return first


def test_every_cell_leaves_three_equal_namespaces(cpu_kernel):
    cells = [
        ("x = 41", ["x"]),
        ("items = [1, 2]\nitems.append(3)", ["x", "items"]),
        ("import math\ndef inc(a):\n    return a + 1\nclass Point:\n    def __init__(self, v): self.v = v",
         ["inc", "Point", "math"]),
        ("x = inc(x); p = Point(math.floor(2.5))", ["x", "p.v"]),
        ("import numpy as np\nbig = np.arange(3_000_000)  # 24 MB: travels beside the log", ["big"]),
        ("big[:10] = 7\ndel items", ["items", "big"]),
    ]
    for code, names in cells:
        ok(cpu_kernel, code)
        view = assert_equal_namespaces(cpu_kernel, names)
    assert view["items"] is None
    out = ok(cpu_kernel, "print(x, p.v, big[:3].tolist(), inc(1))")
    assert out["stdout"].strip() == "42 2 [7, 7, 7] 2"


def test_a_replicas_journal_says_it_is_ready_and_no_note_for_terminal_users(cpu_kernel, dev_cluster):
    """ipykernel prints "Ctrl-C will not work … --existing FILE" for whoever started it in a terminal."""
    ok(cpu_kernel, "x = 1")
    for rep in cpu_kernel.record["replicas"]:
        agent = dev_cluster.agent(rep["node"])
        # A cell needs only a majority: the third replica may still be joining (a busy machine).
        def ready_log(agent=agent, unit=rep["unit"]):
            text = agent.unit_log_tail(unit, 200)
            return text if "ready:" in text else ""
        log = wait_for(ready_log, 60, f"replica {rep['id']} to log that it is ready")
        assert "Ctrl-C" not in log and "--existing" not in log, log


def test_outputs_and_replies_come_once(cpu_kernel):
    out = ok(cpu_kernel, "print('hello')\n6 * 7")
    assert out["stdout"] == "hello\n"
    assert out["results"] == ["42"]
    reply, out = run(cpu_kernel.kc, "1/0")
    assert reply["status"] == "error" and out["errors"] == ["ZeroDivisionError"]


def test_unpicklable_value_warns_and_the_kernel_goes_on(cpu_kernel):
    out = ok(cpu_kernel, "import threading\nlock = threading.Lock()\nn = 5")
    assert "lock" in out["stderr"] and "cannot be replicated" in out["stderr"]
    assert assert_equal_namespaces(cpu_kernel, ["n"])["n"].endswith("5")


def take_the_gpu(agent, kernel_id: str) -> tuple[str, str]:
    """Another kernel on ``agent`` holds its GPU: returns (lease token, lease id)."""
    return agent.hold_gpu(kernel_id)


def executor_node(kernel) -> str:
    out = ok(kernel, "import os; print(os.environ['GPUHUB_NODE'])")
    return out["stdout"].strip()


def test_busy_gpu_moves_the_next_cell_to_another_replica(gpu_kernel, dev_cluster):
    first = executor_node(gpu_kernel)
    assert executor_node(gpu_kernel) == first  # sticky while its GPU is free
    take_the_gpu(dev_cluster.agent(first), "hog")
    ok(gpu_kernel, "v = 'ran elsewhere'")
    second = executor_node(gpu_kernel)
    assert second != first
    assert_equal_namespaces(gpu_kernel, ["v"])


def test_next_cell_waits_for_its_own_last_lease_not_for_another_node(gpu_kernel):
    first = executor_node(gpu_kernel)
    for _ in range(3):  # each cell's process lingers after its reply, holding the node's only GPU
        ok(gpu_kernel, SLOW_EXIT.format(s=0.3))
        assert executor_node(gpu_kernel) == first


def test_all_busy_says_so_and_waits(gpu_kernel, dev_cluster):
    ok(gpu_kernel, "a = 1")
    hogs = [(agent, *take_the_gpu(agent, f"hog{agent.name[-1]}")) for agent in dev_cluster.agents]
    notices: list[tuple[str, str]] = []
    stderr: list[str] = []

    def on_output(msg):  # the GPUs are given back once the kernel has said that it waits for one
        if (text := notice_text(msg["msg_type"], msg["content"])) is not None:
            notices.append((msg["msg_type"], text))
            if "waiting for 1 GPU(s)" in text and hogs:
                while hogs:
                    agent, token, lease_id = hogs.pop()
                    agent.call("DELETE", f"/api/v1/leases/{lease_id}", token=token)
        elif msg["msg_type"] == "stream" and msg["content"]["name"] == "stderr":
            stderr.append(msg["content"]["text"])

    reply = gpu_kernel.kc.execute_interactive("a += 1", timeout=60, output_hook=on_output)
    assert reply["content"]["status"] == "ok", (reply["content"], notices)
    assert not hogs and not stderr, (notices, stderr)
    # One line, shown once and changed in place: its last form says how long the cell waited.
    kinds = [kind for kind, _ in notices]
    assert kinds[0] == "display_data" and set(kinds[1:]) <= {"update_display_data"}, notices
    assert "waiting for 1 GPU(s)" in notices[0][1], notices
    assert re.fullmatch(r"\[gpuhub\] waited \d+ s for 1 GPU\(s\); running on gpu\d", notices[-1][1]), notices
    assert not any("moving this kernel" in text for _, text in notices)  # no other server: no migration
    assert assert_equal_namespaces(gpu_kernel, ["a"])["a"].endswith("2")


def _restartable(pid: int) -> tuple[list[str], dict, str]:
    proc = Path(f"/proc/{pid}")
    cmd = (proc / "cmdline").read_bytes().split(b"\0")[:-1]
    env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
    return ([c.decode() for c in cmd], {k.decode(): v.decode() for k, v in env.items()},
            os.readlink(f"/proc/{pid}/cwd"))


def test_killed_idle_replica_restarts_from_journal_and_peers(cpu_kernel):
    ok(cpu_kernel, "import numpy as np\nbig = np.ones(2_000_000)\nx = 1")
    node = executor_node(cpu_kernel)
    idle = next(r["id"] for r in cpu_kernel.record["replicas"] if r["node"] != node)
    pid = cpu_kernel.pid(idle)
    cmd, env, cwd = _restartable(pid)
    os.kill(pid, signal.SIGKILL)
    ok(cpu_kernel, "x += 1; big *= 3", timeout=30)  # two replicas are a majority
    ok(cpu_kernel, "y = x * 10")
    # systemd would restart the unit: same command, ports, journal
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        view = eventually(lambda: assert_equal_namespaces(cpu_kernel, ["x", "y", "big"]), 60,
                          "the restarted replica's namespace equal to the others'")
        assert view["x"].endswith("2") and view["y"].endswith("20") and view["big"].startswith("[3. 3. 3.")
        # the router sends cells to a replica again once it answers its heartbeats
        wait_for(lambda: idle in serving_replicas(cpu_kernel), 30, "the router to count the replica live again")
        ok(cpu_kernel, "z = y + 1")
        assert_equal_namespaces(cpu_kernel, ["z"])
    finally:
        proc.kill()
        proc.wait(10)


def test_a_replicas_iopub_welcomes_a_second_subscription_to_the_same_topic(cpu_kernel):
    """The router's SUB reconnects after a pause past the ZeroMQ heartbeat timeout (a replica
    stopped, or starved on a busy server); when the new connection subscribes before the replica
    has dropped the old one, its subscription is the topic's second. It must be welcomed all the
    same: the router sends cells only to replicas that welcomed it (before, that replica never got
    a cell again; CI, 2026-11-29). Here the second subscriber is a client beside the router's."""
    ok(cpu_kernel, "x = 1")  # the router's subscription to every replica is welcomed
    kc = cpu_kernel.direct_client(0)  # subscribes to every topic, as the router's SUB does
    try:
        deadline = time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "no iopub_welcome for the second subscription"
            with contextlib.suppress(Empty):
                if kc.get_iopub_msg(timeout=left)["msg_type"] == "iopub_welcome":
                    break
    finally:
        kc.stop_channels()


def test_killed_executor_mid_cell_gives_an_error_and_keeps_state(cpu_kernel):
    ok(cpu_kernel, "x = 1")
    executor = executor_id(cpu_kernel)
    pid = cpu_kernel.pid(executor)
    msg_id = cpu_kernel.kc.execute("x = 100\nprint('running', flush=True)\nimport time; time.sleep(60)")
    wait_for_output(cpu_kernel.kc, msg_id, "running")  # killed mid-cell, not before it started
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    reply = cpu_kernel.kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "ExecutorLost"
    assert time.monotonic() - started < 15
    out = ok(cpu_kernel, "print(x)")
    assert out["stdout"].strip() == "1"


def when_sending(condition: str, action: str) -> str:
    """A cell that makes its replica's kernel ``action`` (instead of sending) when it sends a
    message that meets ``condition``, then counts itself in ``n``: only the executor runs it."""
    return f"""
import os
def _arm(kernel):
    send = kernel.session.send
    def hooked(stream, msg_or_type, *args, **kwargs):
        if {condition}:
            {action}
        return send(stream, msg_or_type, *args, **kwargs)
    kernel.session.send = hooked
_arm(get_ipython().kernel)
del _arm
n += 1
"""


# The executor's process exits at the moment it would send its reply: after the cell ran and its
# result committed, before any client could hear that the cell ended.
EXIT_AT_REPLY = when_sending('msg_or_type == "execute_reply"', "os._exit(9)")
# The executor sends its reply but not its idle (it is killed before it does, below).
NO_IDLE = when_sending('args[:1] == ({"execution_state": "idle"},)', "return None")


def test_an_executor_killed_after_its_cell_committed_still_gets_the_client_its_reply(cpu_kernel):
    """Killed between committing a cell and sending its reply, the executor took the reply with
    it: the client waited for good, and every later cell behind it. A follower's reply stands in
    (gpuhub/server/router.py), and the cell ran once."""
    ok(cpu_kernel, "n = 0")
    reply, _ = run(cpu_kernel.kc, EXIT_AT_REPLY)  # the reply and the idle
    assert reply["status"] == "ok", reply
    assert reply["execution_count"] == 2
    assert ok(cpu_kernel, "print(n)")["stdout"].strip() == "1"


def test_an_executor_killed_after_its_reply_still_gets_the_client_an_idle(cpu_kernel):
    """Killed after its reply, before its idle: the client took the cell as running for good
    (Jupyter clients wait for both). Another replica's idle stands in."""
    ok(cpu_kernel, "n = 0")
    msg_id = cpu_kernel.kc.execute(NO_IDLE)
    reply = cpu_kernel.kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok", reply
    os.kill(cpu_kernel.pid(reply["metadata"]["gpuhub"]["replica"]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            msg = cpu_kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except Empty:
            pytest.fail("no idle for the cell within 30 s of its executor's death")
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status" \
                and msg["content"]["execution_state"] == "idle":
            break
    assert ok(cpu_kernel, "print(n)")["stdout"].strip() == "1"


def eventually(check, timeout_s: float, what: str):
    """:func:`tests.helpers.wait_for`, where a failed assertion or a timed-out client counts as "not yet"."""
    return wait_for(check, timeout_s, what, interval=0.5, ignore=(AssertionError, TimeoutError, RuntimeError))


@contextlib.contextmanager
def one_gpu_kernel_on_four_nodes(tmp_path, gpus: int = 1, **settings):
    """A 1-GPU kernel (``gpus=0``: a CPU one) whose three replicas leave one of four single-GPU
    nodes spare: (cluster, kernel)."""
    cluster = DevCluster(tmp_path, nodes=4, gpus_per_node=1, **settings).start()
    kernel = None
    try:
        kernel = ReplicatedKernel(cluster, gpus=gpus)
        yield cluster, kernel
    finally:
        if kernel is not None:
            kernel.close()
        cluster.stop()


def spare_node(cluster, kernel) -> str:
    placed = {r["node"] for r in kernel.record["replicas"]}
    return next(a.name for a in cluster.agents if a.name not in placed)


def test_lost_node_gets_a_replacement_replica_that_catches_up_and_executes(tmp_path):
    with one_gpu_kernel_on_four_nodes(tmp_path, node_timeout_s=3) as (cluster, kernel):
        ok(kernel, "import numpy as np\nbig = np.arange(1_000_000)\nx = 1")
        first = executor_node(kernel)
        spare = spare_node(cluster, kernel)
        lost = next(r for r in kernel.record["replicas"] if r["node"] != first)
        # The lost node's power goes: its agent and its replica die at once.
        pid = kernel.pid(lost["id"])
        cluster.agent(lost["node"]).stop(kill=True)
        os.kill(pid, signal.SIGKILL)
        ok(kernel, "x += 1; big[:5] = 9", timeout=30)  # two replicas are a majority

        def replaced():
            record = kernel.refresh()
            nodes = {r["node"]: r for r in record["replicas"]}
            return nodes.get(spare) if lost["node"] not in nodes else None
        new = eventually(replaced, 60, f"a replacement replica on {spare}")
        assert new["id"] not in {r["id"] for r in kernel.record["replicas"] if r is not new}
        rids = tuple(r["id"] for r in kernel.record["replicas"])
        view = eventually(lambda: assert_equal_namespaces(kernel, ["x", "big"], rids), 60,
                          "the replacement holding the group's namespace")
        assert view["x"].endswith("2") and " ".join(view["big"].split()).startswith("[ 9 9 9")
        # It takes part in elections: with the other replicas' GPUs taken, it runs the next cell.
        for node in {r["node"] for r in kernel.record["replicas"]} - {spare}:
            take_the_gpu(cluster.agent(node), f"hog{node[-1]}")
        assert executor_node(kernel) == spare
        ok(kernel, "x *= 10")
        view = assert_equal_namespaces(kernel, ["x"], rids)
        assert view["x"].endswith("20"), view


def test_replica_dead_on_a_live_node_is_replaced(tmp_path):
    """A replica process dies while its node stays up (under systemd: a crash loop past its
    restarts, or a reboot within the node timeout drops the transient unit). The scheduler sees the
    unit dead when the provisioner polls, waits out the grace, then places a replacement."""
    with one_gpu_kernel_on_four_nodes(tmp_path, replica_dead_grace_s=1) as (cluster, kernel):
        ok(kernel, "x = 1")
        first = executor_node(kernel)
        dead = next(r for r in kernel.record["replicas"] if r["node"] != first)
        os.kill(kernel.pid(dead["id"]), signal.SIGKILL)  # the process backend restarts nothing
        ok(kernel, "x += 1", timeout=30)  # two replicas are a majority

        def replaced():
            record = kernel.refresh()  # as the provisioner's poll does: the scheduler asks the agents
            ids = {r["id"] for r in record["replicas"]}
            return record if dead["id"] not in ids and len(ids) == 3 else None
        record = eventually(replaced, 60, "a replacement for the dead replica")
        rids = tuple(r["id"] for r in record["replicas"])
        view = eventually(lambda: assert_equal_namespaces(kernel, ["x"], rids), 60,
                          "the replacement holding the group's namespace")
        assert view["x"].endswith("2"), view
        ok(kernel, "x *= 10")
        assert assert_equal_namespaces(kernel, ["x"], rids)["x"].endswith("20")
        # The dead unit's leftovers (files, journal, placed GPUs) are gone from its node.
        status, _ = cluster.agent(dead["node"]).call("GET", f"/api/v1/units/{dead['unit']}")
        assert status == 404


def test_a_cell_waiting_for_a_gpu_runs_on_a_replacement_that_joins_meanwhile(tmp_path):
    """A replica's server is lost and, before the router hears of its replacement, the user runs
    a cell that every remaining replica's server is too busy to run: the cell waits for a GPU. The
    replacement, on a server with a free GPU, joins the group meanwhile: the router hands it the
    waiting cell, and it runs it (it does not wait for the others' GPUs until the grant timeout)."""
    with one_gpu_kernel_on_four_nodes(tmp_path, replica_dead_grace_s=1) as (cluster, kernel):
        ok(kernel, "x = 1")
        first = executor_node(kernel)
        placed = {r["node"] for r in kernel.record["replicas"]}
        spare = spare_node(cluster, kernel)
        dead = next(r for r in kernel.record["replicas"] if r["node"] != first)
        os.kill(kernel.pid(dead["id"]), signal.SIGKILL)
        ok(kernel, "x += 1", timeout=30)  # two replicas are a majority
        for node in placed - {dead["node"]}:
            take_the_gpu(cluster.agent(node), f"hog{node[-1]}")

        msg_id = kernel.kc.execute("x += 1\nimport os; print(os.environ['GPUHUB_NODE'], x)")
        streams = {"stdout": "", "stderr": "", "notice": ""}

        def next_of_cell() -> dict:
            while True:
                msg = kernel.kc.get_iopub_msg(timeout=60)
                if msg["parent_header"].get("msg_id") == msg_id:
                    if (text := notice_text(msg["msg_type"], msg["content"])) is not None:
                        streams["notice"] += text + "\n"
                    elif msg["msg_type"] == "stream":
                        streams[msg["content"]["name"]] += msg["content"]["text"]
                    return msg
        # It waits for the replacement, or (when it asks before the scheduler has counted the
        # dead replica lost) the scheduler moves a busy server's replica to the spare server.
        wait_for(lambda: next_of_cell() and re.search("waiting for 1 GPU|moving this kernel", streams["notice"]),
                 60, "the cell to say that it waits for a GPU")

        def replaced():
            record = kernel.refresh()  # the provisioner's poll: the router meets the replacement
            return spare in {r["node"] for r in record["replicas"]}
        eventually(replaced, 60, f"a replacement replica on {spare}")
        reply = kernel.kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok", reply["content"]
        wait_for(lambda: next_of_cell()["content"].get("execution_state") == "idle", 30, "the cell's idle")
        assert streams["stdout"].split() == [spare, "3"], streams


def _blob_addrs(pid: int) -> dict[int, str]:
    _, env, _ = _restartable(pid)
    doc = json.loads(Path(env["GPUHUB_PEERS_FILE"]).read_text())
    return {int(r["id"]): r["blob"] for r in doc["replicas"]}


def _memfd_maps_at_least(pid: int, nbytes: int) -> bool:
    """Whether ``pid`` maps at least ``nbytes`` of blob-store memfds (shared or private)."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "memfd:gpuhub-blob" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total >= nbytes


def _as_array(blob) -> np.ndarray:
    """A float64 array's out-of-band buffer, as the blob store holds it (raw bytes)."""
    return np.frombuffer(bytes(blob), dtype=np.float64)


def test_cpu_cells_writing_loaded_arrays_in_place_never_change_stored_blobs(cpu_kernel):
    """Followers load a large array copy-on-write from their blob store's memfd (no copy under
    the GIL). Whoever writes such an array in place — the executor its own value, or a follower
    that became the executor — the blob stored under its old digest keeps its bytes: a peer
    fetching that digest gets them, verified. (``twin`` and ``triplet`` start with the same bytes
    as ``big``, so that digest stays in the group's namespace after ``big`` changes.)"""
    n = 4_000_000  # 32 MB of float64: out of band
    ok(cpu_kernel, f"import numpy as np\nbig = np.arange({n}, dtype=np.float64)\n"
                   "twin = big.copy()\ntriplet = big.copy()")
    executor = executor_id(cpu_kernel)
    followers = [r["id"] for r in cpu_kernel.record["replicas"] if r["id"] != executor]
    for rid in followers:  # the store's shared mapping and the values' private ones, same memfd
        eventually(partial(_memfd_maps_at_least, cpu_kernel.pid(rid), 4 * n * 8), 20,
                   f"replica {rid} mapping the arrays")
    key = cpu_kernel.key.encode()
    addrs = _blob_addrs(cpu_kernel.pid(executor))
    original = np.arange(n, dtype=np.float64)
    d0 = digest(original)

    ok(cpu_kernel, "big += 1")  # the executor writes its own value in place
    assert np.array_equal(_as_array(blobclient.fetch([addrs[executor]], key, d0)), original)

    # The executor is lost: a follower that loaded `twin` copy-on-write runs the next cells.
    pid = cpu_kernel.pid(executor)
    cmd, env, cwd = _restartable(pid)
    kill_replica(cpu_kernel, executor)
    ok(cpu_kernel, "twin += 1", timeout=30)
    second = executor_id(cpu_kernel)
    assert second in followers
    got = blobclient.fetch([addrs[second]], key, d0)  # verified: the in-place write left it intact
    assert np.array_equal(_as_array(got), original)

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # the restarted replica fetches the current values from its peers
        eventually(lambda: assert_equal_namespaces(cpu_kernel, ["big", "twin", "triplet"]), 60,
                   "the restarted replica holding the group's arrays")
        out = ok(cpu_kernel, "print(float(big[0]), float(twin[-1]), float(triplet[1]), "
                             "big.flags.writeable)")
        assert out["stdout"].split() == ["1.0", str(float(n)), "1.0", "True"]
    finally:
        proc.kill()
        proc.wait(10)


def test_run_all_after_an_error_runs_nothing_after_it_on_any_replica(cpu_kernel):
    """"Run All" with an error in the second cell: the later cells are reported aborted, and no
    replica ran them (the router decides stop-on-error once, for all of them)."""
    kc = cpu_kernel.kc
    ids = [kc.execute("a = 1"), kc.execute("1/0"), kc.execute("b = 2"), kc.execute("c = 3")]
    replies: dict[str, dict] = {}

    def all_replies():
        msg = kc.get_shell_msg(timeout=1)
        replies[msg["parent_header"]["msg_id"]] = msg
        return set(ids) <= set(replies)

    wait_for(all_replies, timeout=120, what="the four replies", ignore=(Empty,))
    assert [replies[i]["content"]["status"] for i in ids] == ["ok", "error", "aborted", "aborted"]
    view = assert_equal_namespaces(cpu_kernel, ["a", "b", "c"])
    assert view["a"].endswith("1") and view["b"] is None and view["c"] is None
    assert ok(cpu_kernel, "print(a)")["stdout"] == "1\n"  # the kernel goes on


@pytest.mark.parametrize("gpus", [0, 1], ids=["cpu", "gpu"])
def test_what_an_import_prints_is_shown_once_as_by_a_plain_ipykernel(dev_cluster, gpus):
    """`import this` prints the Zen of Python once. Every replica that loads the image imports
    `this` again (the namespace refers to it), and a GPU kernel's replica imports what the cell's
    process imported: none of that may reach the notebook (gpuhub/kernel/quiet.py)."""
    zen = "Beautiful is better than ugly."
    plain = plain_outputs(["import this", "x = 1"])
    k = ReplicatedKernel(dev_cluster, gpus=gpus)
    try:
        first = ok(k, "import this")
        assert first["stdout"] == plain[0] and first["stdout"].count(zen) == 1 and first["stderr"] == ""
        assert ok(k, "x = 1") == {"stdout": plain[1], "stderr": "", "results": [], "errors": [], "displays": [],
                                  "notices": []}
    finally:
        k.close()
