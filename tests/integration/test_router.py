"""The kernel router (docs/architecture.md D3) in front of three real ipykernel processes, seen by a real client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from queue import Empty

import pytest
import zmq
import zmq.asyncio
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.connect import write_connection_file
from jupyter_client.session import Session

from gpuhub.dev.portblocks import reserve_block
from gpuhub.platform import curve
from gpuhub.platform.curve import kernel_curve_keys
from gpuhub.server.router import PORT_KEYS, KernelRouter
from tests import zmq_peers

# An ipykernel that marks its execute_reply the way gpuhub replicas do (a follower names the
# executor GPUHUB_TEST_EXECUTOR, if set), and (as the executor) answers late, so a router that took
# the first reply would pick a follower's (complete_request's too); with GPUHUB_TEST_EXIT_AT_REPLY,
# the executor's process exits instead of replying (after its cell, as one killed then would); with
# GPUHUB_TEST_HOLD_COMPLETE, the executor answers a completion only once that file exists (and then
# creates it + ".answered"). It notes every request it aborts itself in the file GPUHUB_TEST_ABORTS
# names.
MARKED_KERNEL = """
import os, time
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
RID, ROLE = int(os.environ["GPUHUB_TEST_REPLICA"]), os.environ["GPUHUB_TEST_ROLE"]
EXECUTOR = os.environ.get("GPUHUB_TEST_EXECUTOR")
class Marked(IPythonKernel):
    def finish_metadata(self, parent, metadata, reply_content):
        md = super().finish_metadata(parent, metadata, reply_content)
        md["gpuhub"] = {"replica": RID, "role": ROLE}
        if ROLE == "follower" and EXECUTOR:
            md["gpuhub"]["executor"] = int(EXECUTOR)
        if ROLE == "executor":
            if os.environ.get("GPUHUB_TEST_EXIT_AT_REPLY"):
                os._exit(9)
            time.sleep(0.3)
        return md
    def do_complete(self, code, cursor_pos):
        hold = os.environ.get("GPUHUB_TEST_HOLD_COMPLETE")
        if ROLE == "executor" and hold:  # answers only once the test has its reply
            deadline = time.monotonic() + 30
            while not os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.01)
            open(hold + ".answered", "w").close()
        elif ROLE == "executor":
            time.sleep(0.3)  # answers last here too
        return super().do_complete(code, cursor_pos)
    def _send_abort_reply(self, stream, msg, idents):
        with open(os.environ["GPUHUB_TEST_ABORTS"], "a") as f:
            f.write(msg["header"]["msg_id"] + "\\n")
        super()._send_abort_reply(stream, msg, idents)
IPKernelApp.launch_instance(kernel_class=Marked)
"""


class Replicas:
    """Plain ipykernel processes sharing one key, each on its own ports: ports of a block this
    process holds, never handed out twice (an ephemeral port from the OS could be taken by an
    outgoing connection before the kernel binds it: a soak run lost a replica so)."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.ports = reserve_block()
        self.key = uuid.uuid4().hex.encode()
        self.procs: dict[int, subprocess.Popen] = {}
        self.infos: dict[int, dict] = {}
        self._n = 0

    def start(self, rid: int, role: str | None = None, **env: str) -> dict:
        self._n += 1
        fname = str(self.tmp / f"replica-{rid}-{self._n}.json")
        ports = dict(zip(PORT_KEYS, self.ports.take(len(PORT_KEYS)), strict=True))
        curve = {k: v.encode() for k, v in kernel_curve_keys(self.key).items()}  # as the agent writes them
        write_connection_file(fname, ip="127.0.0.1", key=self.key, signature_scheme="hmac-sha256", **ports, **curve)
        with open(fname) as f:
            cfg = json.load(f)
        # A cache of jedi's of its own (XDG_CACHE_HOME): parso writes its cache files in place, so
        # a replica killed while it completes (these tests kill them) leaves one truncated, and
        # replicas completing at once read each other's half-written ones; completion then
        # answers nothing. (gpuhub's kernel writes them atomically: gpuhub/kernel/jedi_cache.py.)
        env = dict(os.environ, IPYTHONDIR=str(self.tmp / f"ipython-{self._n}"),
                   XDG_CACHE_HOME=str(self.tmp / f"cache-{self._n}"),
                   GPUHUB_TEST_REPLICA=str(rid), GPUHUB_TEST_ROLE=role or "",
                   GPUHUB_TEST_ABORTS=str(self.tmp / "aborts.txt"), **env)
        head = ["-c", MARKED_KERNEL] if role else ["-m", "ipykernel_launcher"]
        self.procs[rid] = subprocess.Popen(
            [sys.executable, *head, "-f", fname, "--HistoryManager.enabled=False"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"replica-{rid}-{self._n}.log", "wb"))  # noqa: SIM115
        self.infos[rid] = {"id": rid, "ip": "127.0.0.1",
                           **{k: cfg[k] for k in PORT_KEYS}}
        return self.infos[rid]

    def kill(self, rid: int) -> None:
        p = self.procs[rid]
        p.send_signal(signal.SIGKILL)
        p.wait(5)

    def restart(self, rid: int) -> None:
        """Kill the replica and start a new process on the same ports, as systemd's Restart= does."""
        self.kill(rid)
        old = self.procs[rid]
        self.procs[rid] = subprocess.Popen(old.args, env=dict(os.environ, IPYTHONDIR=str(self.tmp / "ipython-restart")),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def interrupt_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        self.ports.close()


@contextlib.asynccontextmanager
async def _routed(reps: Replicas, hb_timeout_s: float = 3.0, **settings):
    """A router in front of reps (with settings, e.g. bounds, set on it) and a real client
    connected to it, once every replica takes requests."""
    router = KernelRouter([reps.infos[i] for i in sorted(reps.infos)], reps.key,
                          hb_interval_s=0.2, hb_timeout_s=hb_timeout_s, name="k-routed")
    for name, value in settings.items():
        setattr(router, name, value)
    info = await router.start()
    kc = AsyncKernelClient()
    kc.load_connection_info(info)
    kc.hb_channel.time_to_dead = 3.0  # the default 1 s flakes on a loaded test machine
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=20)
        # Every replica must see every request: one still connecting when the first execute is
        # forwarded would miss it (the router waits only startup_straggler_s for the last one).
        assert await _wait_for(lambda: router.ready_replicas() == sorted(reps.infos), 30)
        yield router, info, kc
    finally:
        # unclosed client sockets would also hang the interpreter's exit
        kc.stop_channels()
        await router.stop()


@pytest.fixture
def replicas(tmp_path):
    reps = Replicas(tmp_path)
    yield reps
    reps.stop_all()


@pytest.fixture(scope="module")
def shared_replicas(tmp_path_factory):
    """Three replicas for the tests that leave them as they found them (saves a start)."""
    reps = Replicas(tmp_path_factory.mktemp("replicas"))
    for i in range(3):
        reps.start(i)
    yield reps
    reps.stop_all()


@pytest.fixture
async def routed(replicas):
    for i in range(3):
        replicas.start(i)
    # a short timeout, so that deaths show quickly; still well above a loaded machine's hiccups
    async with _routed(replicas, hb_timeout_s=2.0) as r:
        yield r


@pytest.fixture
async def shared_routed(shared_replicas):
    async with _routed(shared_replicas) as r:
        yield r


async def _drain_iopub(kc, parent_id: str, wait_s: float = 0.6) -> list[dict]:
    """Messages for parent_id still arriving after execute_interactive returned."""
    await asyncio.sleep(wait_s)  # waiting for messages that must not come: no event to wait on
    msgs = []
    while True:
        try:
            m = await kc.iopub_channel.get_msg(timeout=0.1)
        except Empty:
            return msgs
        if m["parent_header"].get("msg_id") == parent_id:
            msgs.append(m)


async def _no_more_shell(kc) -> bool:
    try:
        await kc.shell_channel.get_msg(timeout=0.3)
    except Empty:
        return True
    return False


async def _hb_answered(info: dict, timeout_s: float = 0.5) -> bool:
    # A fresh REQ per ping: a REQ that got no answer is stuck and must be thrown away.
    sock = peer(zmq.asyncio.Context.instance(), zmq.REQ, info, "hb_port")
    try:
        await sock.send(b"ping")
        return bool(await sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(linger=0)


def peer(ctx, kind: int, info: dict, port_key: str):
    """A socket of ``kind`` connected to the router's ``port_key`` as a client holding its keys."""
    sock = zmq_peers.peer(ctx, kind, info)
    sock.connect(f"tcp://127.0.0.1:{info[port_key]}")
    return sock


@contextlib.contextmanager
def _forger(info: dict):
    """A DEALER on the router's shell port (through CurveZMQ: it knows the kernel's public key)
    and a Session signing with the wrong key."""
    sock = peer(zmq.asyncio.Context.instance(), zmq.DEALER, info, "shell_port")
    try:
        yield Session(key=b"not-the-key", signature_scheme="hmac-sha256"), sock
    finally:
        sock.close(linger=0)


async def _wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond() if asyncio.iscoroutinefunction(cond) else cond():
            return True
        await asyncio.sleep(0.1)
    return False


async def _execute(kc, code: str, **kw) -> tuple[dict, list[dict]]:
    """execute_interactive, plus everything on iopub for that request (during and after)."""
    seen: list[dict] = []
    reply = await kc.execute_interactive(code, output_hook=seen.append, timeout=15, **kw)
    seen += await _drain_iopub(kc, reply["parent_header"]["msg_id"])
    return reply, seen


def _printed(msgs: list[dict]) -> dict[str, str]:
    """Each replica's stream text, joined: ipykernel may send one print in pieces (the text, then
    its newline, when its flush timer fires between the two writes on a busy machine)."""
    text: dict[str, str] = {}
    for m in msgs:
        if m["msg_type"] == "stream":
            session = m["header"]["session"]
            text[session] = text.get(session, "") + m["content"]["text"]
    return text


def _statuses(msgs: list[dict], state: str) -> list[dict]:
    return [m for m in msgs if m["msg_type"] == "status"
            and m["content"]["execution_state"] == state]


async def test_kernel_info_and_one_reply_per_execute(shared_routed):
    router, _, kc = shared_routed
    info = await kc.kernel_info(reply=True, timeout=5)
    assert info["content"]["status"] == "ok"
    assert await _no_more_shell(kc)

    reply, msgs = await _execute(kc, "print(1+1)")
    assert reply["content"]["status"] == "ok"
    assert await _no_more_shell(kc)  # the other two replicas' replies were dropped
    # every plain ipykernel executes, so "2" may come up to three times; status comes once
    assert _printed(msgs)[reply["header"]["session"]] == "2\n"
    assert len(_statuses(msgs, "busy")) == 1
    idles = _statuses(msgs, "idle")
    assert len(idles) == 1
    # the idle is that of the replica whose reply was forwarded
    assert idles[0]["header"]["session"] == reply["header"]["session"]
    assert len([m for m in msgs if m["msg_type"] == "execute_input"]) == 1
    assert router.live_replicas() == [0, 1, 2]
    assert router.majority_alive()


async def test_executor_reply_wins_over_earlier_followers(replicas):
    for i, role in enumerate(("follower", "follower", "executor")):
        replicas.start(i, role, GPUHUB_TEST_EXECUTOR="2")
    async with _routed(replicas) as (_, _, kc):
        reply, msgs = await _execute(kc, "x = 41 + 1")
        assert await _no_more_shell(kc)  # the followers' earlier replies were dropped
    assert reply["metadata"]["gpuhub"] == {"replica": 2, "role": "executor"}
    idles = _statuses(msgs, "idle")
    assert len(idles) == 1 and len(_statuses(msgs, "busy")) == 1
    assert idles[0]["header"]["session"] == reply["header"]["session"]


async def test_an_executor_gone_before_its_reply_is_answered_for_by_a_follower(replicas, caplog):
    """The executor committed its cell and died before its reply left (found by killing one at
    that moment): the followers' replies, which name it, were dropped, and the client waited for
    good, with every later request held behind. A follower's reply now stands in for it."""
    caplog.set_level(logging.WARNING, logger="gpuhub.server.router")
    for i, role in enumerate(("follower", "follower", "executor")):
        replicas.start(i, role, GPUHUB_TEST_EXECUTOR="2", GPUHUB_TEST_EXIT_AT_REPLY="1")
    async with _routed(replicas) as (_, _, kc):
        reply, msgs = await _execute(kc, "x = 41 + 1")
        assert reply["content"]["status"] == "ok"
        assert reply["metadata"]["gpuhub"]["role"] == "follower"
        assert reply["metadata"]["gpuhub"]["executor"] == 2
        stand_in = reply["metadata"]["gpuhub"]["replica"]
        idles = _statuses(msgs, "idle")
        assert len(idles) == 1 and idles[0]["header"]["session"] == reply["header"]["session"]
        assert await _no_more_shell(kc)  # the other follower's reply was dropped
        assert f"the executor of {reply['parent_header']['msg_id']} (replica 2) is gone without its reply; " \
               f"replica {stand_in}'s reply stands in for it" in caplog.text
        reply, _ = await _execute(kc, "y = 1")  # the next cell is not held behind the lost reply
        assert reply["content"]["status"] == "ok"


async def test_an_executor_restarted_after_its_cell_answers_for_itself(replicas):
    """A replica restarted after it ran a cell is handed that cell again (_hand_running) and
    follows it from the log, naming itself as the executor: its old process held the reply."""
    replicas.start(0, "follower", GPUHUB_TEST_EXECUTOR="0")
    for i in (1, 2):
        replicas.start(i, "follower", GPUHUB_TEST_EXECUTOR="0")
    async with _routed(replicas) as (_, _, kc):
        reply, _ = await _execute(kc, "x = 1")
        assert reply["metadata"]["gpuhub"] == {"replica": 0, "role": "follower", "executor": 0}
        assert await _no_more_shell(kc)


async def test_other_requests_are_answered_by_the_replica_that_ran_the_last_cell(replicas):
    """Only the executor holds what could not be replicated (a widget's comm, an open file): a
    follower's faster reply to comm_info gave JupyterLab no widgets to restore. Here each replica
    defines a name of its own, so completion tells who answered; once the executor is gone, a
    follower's reply stands in."""
    for i, role in enumerate(("follower", "follower", "executor")):
        replicas.start(i, role, GPUHUB_TEST_EXECUTOR="2")
    async with _routed(replicas) as (_, _, kc):
        reply, _ = await _execute(kc, "import os\nexec(f\"only_{os.environ['GPUHUB_TEST_ROLE']} = 1\")")
        assert reply["metadata"]["gpuhub"]["role"] == "executor"
        for _ in range(3):
            reply = await kc.complete("only_", reply=True, timeout=15)
            assert reply["content"]["matches"] == ["only_executor"]
        assert await _no_more_shell(kc)
        replicas.kill(2)
        reply = await kc.complete("only_", reply=True, timeout=15)
        assert reply["content"]["matches"] == ["only_follower"]


async def test_a_last_executor_slower_than_prefer_executor_s_is_not_waited_for(replicas, tmp_path):
    # The executor's completion is held until the client has its reply (a fixed delay lost to a
    # busy machine's slow followers in CI).
    hold = tmp_path / "release-executor"
    for i, role in enumerate(("follower", "follower", "executor")):
        replicas.start(i, role, GPUHUB_TEST_EXECUTOR="2", GPUHUB_TEST_HOLD_COMPLETE=str(hold))
    async with _routed(replicas, prefer_executor_s=0.0) as (_, _, kc):
        await _execute(kc, "import os\nexec(f\"only_{os.environ['GPUHUB_TEST_ROLE']} = 1\")")
        reply = await kc.complete("only_", reply=True, timeout=15)
        assert reply["content"]["matches"] == ["only_follower"]
        hold.touch()
        assert await _wait_for((tmp_path / "release-executor.answered").exists, timeout_s=30)
        assert await _no_more_shell(kc)  # the executor's late reply is dropped


async def test_input_round_trip(shared_routed, shared_replicas):
    _, _, kc = shared_routed
    prompts = []

    def answer(msg):
        prompts.append(msg["content"]["prompt"])
        kc.input("bob")

    # stop_on_error=False: the replicas interrupted below must not abort the next request
    reply, msgs = await _execute(kc, "x = input('name? ')\nprint('hi', x)",
                                 allow_stdin=True, stdin_hook=answer, stop_on_error=False)
    assert reply["content"]["status"] == "ok"
    assert prompts == ["name? "]  # only the first replica that asked talks to the user
    assert _printed(msgs)[reply["header"]["session"]] == "hi bob\n"

    # The two plain replicas whose input_request was dropped still wait for an answer (gpuhub
    # followers never ask). Interrupt them so the shared replicas are free again (an idle
    # ipykernel ignores SIGINT); their KeyboardInterrupt errors pass through the router like any
    # output.
    shared_replicas.interrupt_all()
    assert await _count_iopub(kc, reply["parent_header"]["msg_id"], "error", want=2) == 2
    msg_id = kc.execute("print('free')")
    assert await _count_iopub(kc, msg_id, "stream") == 3


async def _count_iopub(kc, parent_id: str, msg_type: str, want: int = 3, wait_s: float = 15):
    """How many replicas sent a msg_type for parent_id (one print may come in several pieces)."""
    senders: set[str] = set()
    deadline = time.monotonic() + wait_s
    while len(senders) < want and time.monotonic() < deadline:
        with contextlib.suppress(Empty):
            m = await kc.iopub_channel.get_msg(timeout=0.2)
            if m["parent_header"].get("msg_id") == parent_id and m["msg_type"] == msg_type:
                senders.add(m["header"]["session"])
    return len(senders)


async def test_bad_signature_is_dropped_and_logged(shared_routed, caplog):
    _, info, kc = shared_routed
    with _forger(info) as (forger, sock):
        with caplog.at_level(logging.WARNING, logger="gpuhub.server.router"):
            await sock.send_multipart(forger.serialize(forger.msg("kernel_info_request")))
            await sock.send_multipart([b"no delimiter at all"])
            assert not await sock.poll(700)  # nothing came back: it never reached a replica
        assert any("bad signature" in r.getMessage() and "client shell" in r.getMessage()
                   for r in caplog.records)
        assert any("malformed" in r.getMessage() for r in caplog.records)
    reply = await kc.kernel_info(reply=True, timeout=5)
    assert reply["content"]["status"] == "ok"


async def test_only_a_holder_of_the_kernels_key_gets_through_the_curve_handshake(shared_routed, shared_replicas):
    """Another user on the same host or network connects to the router's or a replica's iopub:
    without the kernel's CurveZMQ keys (derived from its key) the handshake fails, so not a byte
    of any output reaches them; the router's own client (``kc``) works meanwhile."""
    _, info, kc = shared_routed
    ctx = zmq.asyncio.Context.instance()
    replica = shared_replicas.infos[0]
    stranger_keys = dict(zip(curve.KEY_FIELDS, (k.decode() for k in zmq.curve_keypair()), strict=True))
    for where, port in (("router", info["iopub_port"]), ("replica", replica["iopub_port"])):
        url = f"tcp://127.0.0.1:{port}"
        for who, keys in (("keyless", None), ("own key pair", stranger_keys)):
            sub = zmq_peers.peer(ctx, zmq.SUB, keys)
            try:
                assert await zmq_peers.handshake_async(sub, url) == "failed", (where, who)
            finally:
                sub.close(linger=0)
        sub = zmq_peers.peer(ctx, zmq.SUB, kernel_curve_keys(shared_replicas.key))
        try:
            assert await zmq_peers.handshake_async(sub, url) == "ok", where
        finally:
            sub.close(linger=0)
    reply, msgs = await _execute(kc, "print('secret')")
    assert reply["content"]["status"] == "ok"
    printed = _printed(msgs)
    assert printed[reply["header"]["session"]] == "secret\n"
    assert all("secret\n".startswith(text) for text in printed.values()), printed  # the others: no more


async def test_heartbeat_follows_the_majority_and_a_replacement_restores_it(routed, replicas,
                                                                             caplog):
    router, info, kc = routed
    caplog.set_level(logging.INFO, logger="gpuhub.server.router")
    assert await _hb_answered(info)

    replicas.kill(0)
    assert await _wait_for(lambda: router.live_replicas() == [1, 2])
    assert router.majority_alive()
    assert await _hb_answered(info)
    reply, msgs = await _execute(kc, "print(1+1)")  # two of three still make a kernel
    assert reply["content"]["status"] == "ok" and len(_statuses(msgs, "idle")) == 1
    # a Jupyter server routes many kernels into one log: each line says which kernel it is about
    assert any(r.getMessage().startswith("kernel k-routed: replica 0") and "dead" in r.getMessage()
               for r in caplog.records)

    replicas.kill(1)
    assert await _wait_for(lambda: not router.majority_alive())
    assert not await _hb_answered(info)
    assert router.live_replicas() == [2]

    # replica 1 comes back elsewhere (new process, new ports): the majority and heartbeat return
    router.replace_replica(replicas.start(1))
    assert await _wait_for(lambda: router.live_replicas() == [1, 2], 10)
    assert await _hb_answered(info)
    # and it takes requests: every plain replica executes, so its pid shows up in the output
    pid, out = str(replicas.procs[1].pid), set()

    async def new_replica_ran() -> bool:
        # not execute_interactive: a request sent while the new replica still connects may reach
        # no one, and is then simply sent again
        msg_id = kc.execute("import os; print(os.getpid())")
        deadline = time.monotonic() + 2
        while pid not in out and time.monotonic() < deadline:
            with contextlib.suppress(Empty):
                m = await kc.iopub_channel.get_msg(timeout=0.2)
                if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "stream":
                    out.add(m["content"]["text"].strip())
        return pid in out

    assert await _wait_for(new_replica_ran, 10), out
    with pytest.raises(KeyError):
        router.replace_replica({**replicas.infos[1], "id": 7})
    await router.stop()
    await router.stop()  # idempotent


async def test_a_cell_sent_while_no_replica_takes_requests_runs_once_they_do(routed, replicas, caplog):
    """Every replica restarting at once (each killed for memory, say): a cell sent meanwhile was
    dropped, and the notebook waited for its reply for good. It is held, and runs once they are back."""
    router, _, kc = routed
    for rid in range(3):
        replicas.kill(rid)
    assert await _wait_for(lambda: router.live_replicas() == [], 10)
    caplog.set_level(logging.WARNING, logger="gpuhub.server.router")
    msg_id = kc.execute("print('after the restart')")
    assert await _wait_for(lambda: "held until one does" in caplog.text, 10)
    for rid in range(3):
        router.replace_replica(replicas.start(rid))
    reply = await kc.get_shell_msg(timeout=60)
    while reply["parent_header"]["msg_id"] != msg_id:  # the start's kernel_info replies come first
        reply = await kc.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "ok", reply
    # (plain ipykernel replicas each run it and print: which one's output counts is the gpuhub
    # kernel's business, tests/integration/test_replicated.py)
    printed = _printed(await _drain_iopub(kc, msg_id))
    assert printed[reply["header"]["session"]] == "after the restart\n", printed
    assert all("after the restart\n".startswith(text) for text in printed.values()), printed
    assert caplog.text.count(f"no ready replica took execute_request {msg_id}") == 1  # not at every retry


async def test_a_replica_restarted_while_a_cell_runs_gets_that_cell_again(routed, replicas, tmp_path, caplog):
    """A replica process killed and started again on its ports (systemd's Restart=) just as a cell
    was sent: the copy the router had sent died with the old process, and the others waited for it
    for good (found by tests/integration/test_durable_blobs.py failing once in a few runs). The
    router hands the running cell again to a replica whose connection broke after it was sent."""
    _, _, kc = routed
    caplog.set_level(logging.INFO, logger="gpuhub.server.router")
    gate = tmp_path / "gate"
    msg_id = kc.execute(f"import os, time\nopen({str(gate)!r} + '.' + str(os.getpid()), 'w').close()\n"
                        f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\nprint('done')")
    started = lambda: len(list(tmp_path.glob("gate.*")))  # noqa: E731 - the replicas that run the cell
    assert await _wait_for(lambda: started() == 3, 30)
    replicas.restart(1)
    assert await _wait_for(lambda: f"replica 1 came back while {msg_id} runs: it got that cell again" in caplog.text,
                           30), caplog.text[-2000:]
    assert await _wait_for(lambda: started() == 4, 30)  # the new process runs it too (plain ipykernel)
    gate.touch()
    reply = await _reply_to(kc, msg_id)
    assert reply["content"]["status"] == "ok", reply


async def test_a_replica_whose_outputs_cannot_reach_the_router_gets_no_cell(replicas, tmp_path, caplog):
    """A replica back from a restart answers heartbeats and takes requests on shell a moment before
    its iopub has welcomed the router's subscription: whatever it prints meanwhile is dropped by its
    PUB. Sent a cell then (and made its executor), it ran the cell and the client got an "ok" reply
    with no output (the cluster test of all replicas killed at once, once in a few runs). Here the
    last replica's outputs never reach the router: it gets no cell, the others run it."""
    caplog.set_level(logging.WARNING, logger="gpuhub.server.router")
    for rid in range(3):
        replicas.start(rid)
    silent = dict(replicas.infos[2], iopub_port=replicas.ports.take(1)[0])  # nothing listens there
    router = KernelRouter([replicas.infos[0], replicas.infos[1], silent], replicas.key,
                          hb_interval_s=0.2, hb_timeout_s=3.0, name="k-silent-iopub")
    router.startup_straggler_s = 0.5
    router.unready_warning_s = 1.0
    kc = AsyncKernelClient()
    kc.load_connection_info(await router.start())
    kc.hb_channel.time_to_dead = 3.0
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=20)
        assert await _wait_for(lambda: router.live_replicas() == [0, 1, 2], 20)
        assert router.ready_replicas() == [0, 1]
        code = f"import os\nopen({str(tmp_path)!r} + '/ran.' + os.environ['GPUHUB_TEST_REPLICA'], 'w').close()"
        reply, _ = await _execute(kc, code)
        assert reply["content"]["status"] == "ok", reply
        assert sorted(p.name for p in tmp_path.glob("ran.*")) == ["ran.0", "ran.1"]
        # the admin hears of it: that replica falls behind
        told = lambda: [r for r in caplog.records if "replica 2 " in r.getMessage()  # noqa: E731
                        and "has not been ready" in r.getMessage()]
        assert await _wait_for(told, 20)
        assert "not connected: iopub_port" in told()[0].getMessage()
    finally:
        kc.stop_channels()
        await router.stop()


async def test_a_welcomed_replica_that_never_echoes_a_heartbeat_is_dead_after_the_timeout(replicas):
    """The start-up grace covers a replica that has not shown it runs. Once its iopub welcomed the
    router, its heartbeat must answer within the timeout like any other's: a replica stopped
    before its first echo was otherwise counted live for the whole grace (30 s)."""
    for i in range(3):
        replicas.start(i)
    with socket.socket() as s:  # a port nothing listens on: replica 0's heartbeat stays silent
        s.bind(("127.0.0.1", 0))
        silent = s.getsockname()[1]
    infos = [{**replicas.infos[0], "hb_port": silent}, replicas.infos[1], replicas.infos[2]]
    router = KernelRouter(infos, replicas.key, hb_interval_s=0.2, hb_timeout_s=2.0)
    assert router.startup_grace_s >= 30
    await router.start()
    try:
        assert await _wait_for(lambda: router._replicas[0].welcomed, 30)
        assert await _wait_for(lambda: 0 not in router.live_replicas(), 10)
        assert router.live_replicas() == [1, 2]
    finally:
        await router.stop()


async def _replies(kc, msg_ids: list[str], timeout_s: float = 15) -> dict[str, dict]:
    """The shell replies to msg_ids, in whatever order they come (other replies are skipped)."""
    deadline, got = time.monotonic() + timeout_s, {}
    while len(got) < len(msg_ids):
        left = deadline - time.monotonic()
        assert left > 0, f"no reply to {set(msg_ids) - set(got)} within {timeout_s:g} s"
        with contextlib.suppress(Empty):
            m = await kc.shell_channel.get_msg(timeout=min(left, 0.5))
            if m["parent_header"].get("msg_id") in msg_ids:
                got[m["parent_header"]["msg_id"]] = m
    return got


async def _reply_to(kc, msg_id: str, timeout_s: float = 15) -> dict:
    return (await _replies(kc, [msg_id], timeout_s))[msg_id]


async def _iopub_until_idle(kc, msg_ids: list[str], timeout_s: float = 15) -> list[dict]:
    """iopub messages for msg_ids until each has had its idle."""
    waiting, seen = set(msg_ids), []
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        assert left > 0, f"no idle for {waiting} within {timeout_s:g} s"
        with contextlib.suppress(Empty):
            m = await kc.iopub_channel.get_msg(timeout=min(left, 0.5))
            parent = m["parent_header"].get("msg_id")
            if parent in msg_ids:
                seen.append(m)
                if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    waiting.discard(parent)
    return seen


async def test_run_all_after_an_error_aborts_the_rest_on_every_replica(replicas, tmp_path):
    """"Run All": cells sent at once, the second raises. The later cells are answered "aborted"
    by the router (as ipykernel 7 answers them) and never reach a replica; a kernel_info between
    them is still answered."""
    for i, role in enumerate(("follower", "follower", "executor")):
        replicas.start(i, role)
    marker = tmp_path / "ran.txt"
    async with _routed(replicas) as (router, _, kc):
        ids = [kc.execute("a = 1"), kc.execute("1/0"),
               kc.execute(f"open({str(marker)!r}, 'w').close()\nb = 2"),
               kc.kernel_info(), kc.execute("b = 3")]
        replies = await _replies(kc, ids)
        msgs = await _iopub_until_idle(kc, ids)
        assert [replies[i]["content"]["status"] for i in ids] == ["ok", "error", "aborted", "ok",
                                                                  "aborted"]
        for i in (ids[2], ids[4]):
            assert replies[i]["msg_type"] == "execute_reply"
            assert replies[i]["metadata"]["status"] == "aborted"
            assert replies[i]["parent_header"]["msg_id"] == i
            mine = [m["content"]["execution_state"] for m in msgs
                    if m["parent_header"]["msg_id"] == i]
            assert mine == ["busy", "idle"]  # no execute_input: it never ran anywhere
        assert not marker.exists()
        # no replica aborted (or even saw) a request itself: the decision was the router's
        assert not (tmp_path / "aborts.txt").exists()
        # every replica has a but not b; the next cell runs normally
        msg_id = kc.execute("print('a' in globals(), 'b' in globals())")
        assert (await _reply_to(kc, msg_id))["content"]["status"] == "ok"
        printed = _printed(await _iopub_until_idle(kc, [msg_id]) + await _drain_iopub(kc, msg_id))
        assert list(printed.values()) == ["True False\n"] * 3, printed
        assert router.held() == (0, 0)


async def test_silent_or_no_stop_on_error_aborts_nothing(shared_routed):
    _, _, kc = shared_routed
    for kw in ({"silent": True}, {"stop_on_error": False}):
        ids = [kc.execute("1/0", **kw), kc.execute("c = 5")]
        replies = [await _reply_to(kc, i) for i in ids]
        assert [r["content"]["status"] for r in replies] == ["error", "ok"], kw
        await _iopub_until_idle(kc, ids)


async def test_requests_wait_for_the_running_execute(shared_routed, tmp_path):
    """One execute at a time: a request sent during a cell is forwarded after its reply."""
    router, _, kc = shared_routed
    go = tmp_path / "go"
    running = kc.execute(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)")
    later = kc.kernel_info()
    assert await _wait_for(lambda: router.held()[0] == 1)
    go.touch()
    first = await kc.shell_channel.get_msg(timeout=15)
    assert first["parent_header"]["msg_id"] == running
    assert (await _reply_to(kc, later))["msg_type"] == "kernel_info_reply"
    assert router.held() == (0, 0)
    await _iopub_until_idle(kc, [running, later])


async def test_held_requests_are_bounded_and_only_signed_ones_held(shared_replicas, tmp_path,
                                                                   caplog):
    go = tmp_path / "go"
    async with _routed(shared_replicas, max_held_requests=3, max_held_bytes=8192) as (router, info,
                                                                                      kc):
        running = kc.execute(f"import os, time\nwhile not os.path.exists({str(go)!r}): "
                             "time.sleep(0.02)")
        with _forger(info) as (forger, sock):
            with caplog.at_level(logging.WARNING, logger="gpuhub.server.router"):
                for _ in range(50):  # a peer without the key makes the router hold nothing
                    await sock.send_multipart(forger.serialize(forger.msg(
                        "execute_request", {"code": "x" * 1000})))
                big = kc.execute("y = '" + "y" * 10_000 + "'")  # over the byte bound
                held = [kc.kernel_info() for _ in range(3)]
                dropped = kc.kernel_info()  # over the count bound
                assert await _wait_for(lambda: any("dropped kernel_info_request" in r.getMessage()
                                                   for r in caplog.records))
            assert router.held()[0] == 3 and router.held()[1] <= 8192
            assert any(f"dropped execute_request {big}" in r.getMessage() for r in caplog.records)
            assert sum("bad signature" in r.getMessage() for r in caplog.records) == 50
        go.touch()
        assert (await _reply_to(kc, running))["content"]["status"] == "ok"
        for i in held:
            assert (await _reply_to(kc, i))["msg_type"] == "kernel_info_reply"
        assert router.held() == (0, 0)
        assert dropped not in {m["parent_header"].get("msg_id")
                               for m in await _drain_iopub(kc, dropped)}


async def test_a_kernel_info_sent_at_start_is_answered(replicas):
    """A client that sends one kernel_info_request while the replicas still start gets its answer."""
    for i in range(3):
        replicas.start(i)
    router = KernelRouter([replicas.infos[i] for i in range(3)], replicas.key)
    info = await router.start()
    kc = AsyncKernelClient()
    kc.load_connection_info(info)
    kc.start_channels()
    try:
        msg_id = kc.kernel_info()  # once, at once: no retry
        reply = await _reply_to(kc, msg_id, timeout_s=60)
        assert reply["content"]["status"] == "ok"
        assert router.accepting
    finally:
        kc.stop_channels()
        await router.stop()


async def test_iopub_welcome_for_each_subscriber(shared_routed, shared_replicas):
    _, info, _ = shared_routed
    session = Session(key=shared_replicas.key, signature_scheme="hmac-sha256")
    ctx = zmq.asyncio.Context.instance()
    for topic in (b"", b"", b"kernel."):  # a second subscriber to a topic is welcomed too
        sub = zmq_peers.peer(ctx, zmq.SUB, info)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(f"tcp://127.0.0.1:{info['iopub_port']}")
        try:
            deadline = time.monotonic() + 15
            while True:
                assert await sub.poll(int(max(0, deadline - time.monotonic()) * 1000)), topic
                frames = await sub.recv_multipart()
                idents, parts = session.feed_identities(frames)
                msg = session.deserialize(parts)  # checks the signature
                if msg["msg_type"] == "iopub_welcome":
                    break
            assert msg["content"] == {"subscription": topic.decode()}
            assert idents == ([topic] if topic else [])
        finally:
            sub.close(linger=0)


async def test_a_reconnecting_client_takes_its_routing_id_over(shared_routed, shared_replicas):
    """ROUTER_HANDOVER: a second connection with the same routing id (a client reconnecting with
    its session id) gets the replies."""
    _, info, _ = shared_routed
    session = Session(key=shared_replicas.key, signature_scheme="hmac-sha256")
    ctx = zmq.asyncio.Context.instance()
    socks = []
    try:
        for _ in range(40):
            sock = zmq_peers.peer(ctx, zmq.DEALER, info)
            sock.setsockopt(zmq.ROUTING_ID, session.bsession)
            sock.connect(f"tcp://127.0.0.1:{info['shell_port']}")
            socks.append(sock)
            msg = session.msg("kernel_info_request")
            await sock.send_multipart(session.serialize(msg))
            assert await sock.poll(15_000), "the reply went elsewhere"
            reply = session.deserialize(session.feed_identities(await sock.recv_multipart())[1])
            assert reply["parent_header"]["msg_id"] == msg["header"]["msg_id"]
    finally:
        for sock in socks:
            sock.close(linger=0)


async def test_a_reconnect_while_old_monitor_endpoints_are_still_bound(shared_routed, shared_replicas):
    """Every replica socket's connection monitor has an endpoint of its own. pyzmq's default name
    comes from the socket's file descriptor, which a new socket reuses while libzmq still closes
    an old one (and its monitor endpoint) in the background: a reconnect failed with EADDRINUSE.
    Here every such default name is taken, as a slow background close would leave it."""
    router, _, kc = shared_routed
    holder = router._ctx.socket(zmq.PAIR)  # one socket, many endpoints: no socket limit reached
    try:
        # every number a new socket's descriptor can get: those in use now and the next ones
        for fd in range(max(int(f) for f in os.listdir("/proc/self/fd")) + 64):
            holder.bind(f"inproc://monitor.s-{fd}")
        router.replace_replica(shared_replicas.infos[0])  # the same address: sockets anew
    finally:
        holder.close(linger=0)
    assert await _wait_for(lambda: router.live_replicas() == [0, 1, 2], 15)
    reply, _ = await _execute(kc, "1 + 1")
    assert reply["content"]["status"] == "ok"
