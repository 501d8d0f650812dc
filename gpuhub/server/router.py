"""The kernel router: N kernel replicas shown to a Jupyter server as one ordinary kernel (docs/architecture.md D3).

A gpuhub kernel runs as N replicas, each an ipykernel-based process with its own five ZeroMQ
ports, all sharing the kernel's one HMAC key. The router runs inside the user's Jupyter server (the
provisioner starts it; ``gpuhub`` can run one from the CLI), so there is no central gateway: it
scales with the users and dies with the server that owns it.

What it does, and why:

* shell/control requests go to every live replica, because every replica must see every request
  (the cell's msg_id is the key the replicas agree on; see gpuhub/kernel/replica.py);
* of the N replies, the client gets one: for ``execute_reply`` the executor's (replicas mark it in
  ``metadata["gpuhub"]``), or, once the executor can no longer send it (it died after committing
  the cell, its heartbeats stopped, or its shell connection broke since it got the cell), a
  follower's, which names that executor; for anything else on shell that of the replica that ran
  the last cell (only it holds what could not be replicated: a widget's comm for comm_info, an
  open file for completion), or the first once that one cannot answer or ``prefer_executor_s``
  passed; iopub
  ``status``/``execute_input`` are de-duplicated so the client sees one busy and one idle per
  request, the idle being that of the replica whose reply it got (another's if that replica is
  gone before its idle came); other outputs pass as they come (followers are silent by design);
* shell requests are forwarded in arrival order, one execute at a time: once an
  ``execute_request`` is forwarded, later shell requests wait in the router until its reply has
  reached the client, so every replica sees the same order and no replica has a local queue
  (control requests, such as interrupt and shutdown, are never held behind it);
* stop-on-error is decided here, once: when the forwarded ``execute_reply`` is an error (of a
  request that was not silent and had ``stop_on_error``), every ``execute_request`` held at that
  moment is answered "aborted" the way ipykernel 7 answers it and never reaches any replica;
* nothing is forwarded before the replicas can take it: until every replica (or, after
  ``startup_straggler_s``, a majority) is connected and has welcomed the router's iopub
  subscription, requests are held, so a client's first ``kernel_info_request`` is
  answered rather than lost;
* the held queue is bounded (``max_held_requests``, ``max_held_bytes``); only verified messages
  are ever held, and what does not fit is dropped with a warning;
* messages are forwarded as raw frames, never re-signed: the replicas already sign with the
  kernel's key. The router checks every signature, so a peer without the key cannot use it as a
  relay. It signs only what it says itself: the aborted replies above with their busy/idle, and
  the ``iopub_welcome`` (JEP 65) for each new subscription on its XPUB iopub socket. It holds the
  key anyway, as does the Jupyter server that runs it, so this grants no new power;
* the client-facing shell, control and stdin ROUTERs hand a routing id over to its newest peer
  (``ROUTER_HANDOVER``, as ipykernel), so a client that reconnects with its session id gets replies;
* every ZeroMQ socket on both sides, the client-facing ones and the replicas', is CurveZMQ with
  the kernel's key pair (derived from its key: gpuhub/platform/curve.py), so neither the Jupyter
  server's connection nor a replica's can be read, or even connected to, without the kernel's key;
* it answers the client's heartbeat itself while a majority of replicas answers its own pings,
  because that is exactly when the kernel can still commit (Raft): below a majority, the Jupyter
  server must see the kernel as dead.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import Session
from zmq.utils.monitor import parse_monitor_message

from gpuhub.platform import curve
from gpuhub.platform.curve import kernel_curve_keys
from gpuhub.platform.messages import DISPATCH_NOTE, GROUP_CHANGE

DELIM = b"<IDS|MSG>"
PORT_KEYS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
# Requests that get busy/idle on iopub but no reply: their idle cannot wait for a reply.
NO_REPLY_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})
_monitor_names = itertools.count()  # one inproc endpoint per replica socket's monitor, never reused


@dataclass
class _Msg:
    """A verified message: the raw frames (forwarded unchanged) and its decoded headers."""

    frames: list[bytes]
    idx: int  # index of DELIM; frames[:idx] are the routing identities
    header: dict[str, Any]
    parent: dict[str, Any]

    @property
    def idents(self) -> tuple[bytes, ...]:
        return tuple(self.frames[: self.idx])

    @property
    def msg_type(self) -> str:
        return str(self.header.get("msg_type", ""))

    @property
    def parent_id(self) -> str:
        return str(self.parent.get("msg_id", "") or "")

    def metadata(self) -> dict[str, Any]:
        return _loads(self.frames[self.idx + 4])

    def content(self) -> dict[str, Any]:
        return _loads(self.frames[self.idx + 5])

    @property
    def size(self) -> int:
        return sum(len(f) for f in self.frames)


class _Named(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"kernel {self.extra['kernel']}: {msg}", kwargs


@dataclass
class _Held:
    """A verified client request the router holds: not yet forwarded to any replica."""

    msg: _Msg
    channel: str


@dataclass
class _Running:
    """The forwarded execute_request whose reply the held shell requests wait for."""

    msg_id: str
    silent: bool
    stop_on_error: bool
    sent_to: set[int]
    frames: list[bytes]  # as the client sent it: a replica that joins while it runs gets it too


def _loads(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class _Request:
    """What the router must remember about one client request until its replicas are done."""

    msg_type: str  # "" when first seen as a parent on iopub (not sent through this router)
    created: float
    answered_by: int | None = None
    finished: bool = False
    busy_sent: bool = False
    input_sent: bool = False
    idle_sent: bool = False
    statuses_sent: set[str] = field(default_factory=set)
    # held until the answerer's came (another's stands in if the answerer is gone before it sent its own)
    idles: dict[int, list[bytes]] = field(default_factory=dict)
    # Another replica's reply, held while the one that should answer may still: (its sender, the
    # reply, its channel, the replica awaited). See _on_replica_reply.
    standby: tuple[int, _Msg, str, int] | None = None
    sent: dict[int, int] = field(default_factory=dict)  # replica -> its shell breaks when it got this
    answer_breaks: int = 0  # the answerer's iopub breaks when its reply came (its idle may be lost since)
    stdin_replica: int | None = None
    undelivered: bool = False  # no replica took it once: said in the log once, however often retried

    @property
    def expects_reply(self) -> bool:
        return bool(self.msg_type) and self.msg_type not in NO_REPLY_TYPES


@dataclass
class _Replica:
    id: int
    ip: str
    ports: dict[str, int]
    last_seen: float
    live: bool = True
    # Has shown it runs (answered a heartbeat, or welcomed our iopub subscription): from then on
    # only heartbeats keep it live, without the start-up grace.
    answered: bool = False
    grace_s: float = 0.0  # extra time to show it runs
    sockets: dict[str, zmq.asyncio.Socket] = field(default_factory=dict)
    monitors: list[zmq.asyncio.Socket] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    connected: set[str] = field(default_factory=set)  # channels whose ZMTP handshake succeeded
    welcomed: bool = False  # the replica's iopub welcomed our subscription: outputs will reach us
    last_execute: str | None = None  # the msg_id of the last execute_request it got from us
    # The running cell's msg_id when this replica's shell connection dropped after we sent it that
    # cell: the copy may have died with the connection (a process killed and restarted at that
    # moment), so it is handed the cell again once it is back (_hand_running).
    lost_running: str | None = None
    # How often each channel's connection broke: what the replica sent meanwhile was dropped.
    breaks: dict[str, int] = field(default_factory=dict)
    unready_since: float | None = None  # live and not ready since (it gets no cells meanwhile)
    told_unready: bool = False  # that was logged

    @property
    def ready(self) -> bool:
        """Can take requests: every message it sends from now on reaches the router. (Its iopub's
        welcome proves it runs: waiting for a heartbeat too would cost up to a ping interval.)"""
        return self.welcomed and {"shell_port", "control_port", "iopub_port"} <= self.connected

    def url(self, key: str) -> str:
        return f"tcp://{self.ip}:{self.ports[key]}"

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.ports.get('shell_port')}"


class KernelRouter:
    """One kernel's router. Run it on the asyncio loop; all methods must be called on that loop."""

    # Bounds on request state. An unanswered execute_request may legitimately wait for hours (a
    # long cell); finished ones are kept a while so a slow replica's late busy/idle/reply for the
    # same request is still recognised as a duplicate and dropped.
    request_ttl_s: float = 24 * 3600.0
    finished_ttl_s: float = 600.0
    max_requests: int = 10_000
    # A replica that has never answered a heartbeat is still starting (an ipykernel takes a second
    # or more): it counts as live for this long, so a router started together with its replicas
    # does not declare the kernel dead before it ever ran.
    startup_grace_s: float = 30.0
    # Requests wait until every replica is ready; once a majority is, the others get this long.
    startup_straggler_s: float = 5.0
    # A live replica unready this long is logged (_watch_unready).
    unready_warning_s: float = 10.0
    # Bounds on what the router holds (requests waiting for their turn or for the replicas).
    max_held_requests: int = 1000
    max_held_bytes: int = 64 << 20
    # How long a request other than an execute waits for the reply of the replica that ran the
    # last cell, when another replica answered first (_on_replica_reply).
    prefer_executor_s: float = 5.0

    def __init__(self, replicas: list[dict], key: bytes, *, ip: str = "127.0.0.1",
                 ports: dict | None = None, signature_scheme: str = "hmac-sha256",
                 log: logging.Logger | None = None, hb_interval_s: float = 1.0,
                 hb_timeout_s: float = 3.0, name: str = ""):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.key = key.encode() if isinstance(key, str) else bytes(key)
        self.ip = ip
        self.signature_scheme = signature_scheme
        self.log = log or logging.getLogger(__name__)
        if name:  # a Jupyter server routes many kernels into one log: say which one speaks
            self.log = _Named(self.log, {"kernel": name})
        self.hb_interval_s = hb_interval_s
        self.hb_timeout_s = hb_timeout_s
        self._want_ports = {k: int((ports or {}).get(k) or 0) for k in PORT_KEYS}
        scheme, _, digest = signature_scheme.partition("-")
        if scheme != "hmac" or not digest:
            raise ValueError(f"unsupported signature scheme {signature_scheme!r}")
        if digest not in hashlib.algorithms_available:
            raise ValueError(f"unsupported signature scheme {signature_scheme!r}")
        self._digest = digest
        self._curve = kernel_curve_keys(self.key)  # every socket, both sides (gpuhub/platform/curve.py)
        now = time.monotonic()
        self._replicas: dict[int, _Replica] = {}
        for r in replicas:
            rep = self._make_replica(r, now)
            if rep.id in self._replicas:
                raise ValueError(f"duplicate replica id {rep.id}")
            self._replicas[rep.id] = rep
        self._ctx: zmq.asyncio.Context | None = None
        self._client: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._stdin_owner: dict[tuple[bytes, ...], tuple[int, float]] = {}
        self._startup_status_sent: set[str] = set()
        self._info: dict | None = None
        self._stopped = False
        # What the router says itself is signed with the kernel's key (see the module docstring).
        self._session = Session(key=self.key, signature_scheme=signature_scheme,
                                username="gpuhub-router")
        self._held: deque[_Held] = deque()  # shell requests, in arrival order
        self._held_control: deque[_Held] = deque()  # control requests, only until the replicas are up
        self._held_bytes = 0
        self._running: _Running | None = None
        self._last_execute: str | None = None  # the last execute_request forwarded to any replica
        self._last_sent: set[int] = set()  # the replicas that got the last execute_request (its sent_to)
        self._notes: OrderedDict[str, None] = OrderedDict()  # msg_ids of our dispatch notes
        self._idle_owed: OrderedDict[str, None] = OrderedDict()  # answered requests whose idle has not come
        self._standing_by: OrderedDict[str, None] = OrderedDict()  # unanswered requests holding a standby
        self._last_executor: int | None = None  # the replica whose execute_reply the client got last
        self._open = False  # replicas are up: requests go through
        self._started_at = 0.0
        self._majority_ready_at: float | None = None
        self._order = asyncio.Lock()  # forwarding shell requests: one decision at a time
        # Called (on the loop) with the target server when a replica says the scheduler is moving
        # one of the replicas (GROUP_CHANGE): the provisioner then fetches the new group at once.
        self.on_group_change: Callable[[str], None] | None = None

    # ---------------------------------------------------------------- public API

    async def start(self) -> dict:
        """Bind the client-facing ports, connect to the replicas; return the connection info."""
        if self._info is not None:
            return dict(self._info)
        if self._stopped:
            raise RuntimeError("router was stopped")
        self._ctx = zmq.asyncio.Context()
        kinds = {"shell_port": zmq.ROUTER, "control_port": zmq.ROUTER, "stdin_port": zmq.ROUTER,
                 "iopub_port": zmq.XPUB, "hb_port": zmq.ROUTER}
        info: dict[str, Any] = {"ip": self.ip, "transport": "tcp"}
        try:
            for key, kind in kinds.items():
                sock = self._ctx.socket(kind)
                sock.linger = 0
                if key in ("shell_port", "control_port", "stdin_port"):
                    # as ipykernel: a client reconnecting with its routing id (its session) takes it over
                    sock.router_handover = 1
                elif kind == zmq.XPUB:
                    # report every subscription, not only a topic's first: each client gets a welcome
                    sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                curve.as_server(sock, self._curve)
                self._client[key] = sock
                if self._want_ports[key]:
                    sock.bind(f"tcp://{self.ip}:{self._want_ports[key]}")
                    info[key] = self._want_ports[key]
                else:
                    info[key] = sock.bind_to_random_port(f"tcp://{self.ip}")
        except zmq.ZMQError:
            await self.stop()
            raise
        info["signature_scheme"] = self.signature_scheme
        info["key"] = self.key
        info.update(self._curve)
        now = time.monotonic()
        self._started_at = now
        for rep in self._replicas.values():
            rep.last_seen = now  # all count as live until the first heartbeat round can tell
            rep.grace_s = self.startup_grace_s
            self._connect(rep)
        pumps = (("shell_port", self._on_client_request, "client shell"),
                 ("control_port", self._on_client_request, "client control"),
                 ("stdin_port", self._on_client_stdin, "client stdin"),
                 ("hb_port", self._on_client_hb, "client heartbeat"))
        for key, handler, what in pumps:
            self._tasks.append(asyncio.ensure_future(
                self._pump(self._client[key], handler, what, channel=key)))
        self._tasks.append(asyncio.ensure_future(self._subscriptions()))
        self._tasks.append(asyncio.ensure_future(self._heartbeat_loop()))
        self._info = info
        self.log.info("kernel router on %s for replicas %s", self.ip,
                      ", ".join(f"{r.id}@{r.address}" for r in self._replicas.values()))
        return dict(info)

    def replace_replica(self, replica: dict) -> None:
        """A replica with the same id now runs at a new address: reconnect its sockets there."""
        new = self._make_replica(replica, time.monotonic())
        old = self._replicas.get(new.id)
        if old is None:
            raise KeyError(f"no replica with id {new.id}")
        self._disconnect(old)
        new.live = False  # until it answers; it gets no startup grace (see _is_live)
        self._replicas[new.id] = new
        self._forget(new.id)
        if self._running is not None:
            self._running.sent_to.discard(new.id)  # the old process got the cell, not this one
        if self._ctx is not None and not self._stopped:
            self._connect(new)
        self.log.info("replica %s moved from %s to %s", new.id, old.address, new.address)

    def set_replicas(self, replicas: list[dict]) -> None:
        """Follow the scheduler's view of the group: connect to a replacement replica (new id, on
        another node), drop one that was replaced, reconnect one that moved."""
        wanted = {int(r["id"]): r for r in replicas}
        if not wanted:
            return
        for rid in [i for i in self._replicas if i not in wanted]:
            old = self._replicas.pop(rid)
            self._disconnect(old)
            self._forget(rid)
            self.log.info("replica %s (%s) left the group", rid, old.address)
        now = time.monotonic()
        for rid, r in wanted.items():
            current = self._replicas.get(rid)
            new = self._make_replica(r, now)
            if current is None:
                new.grace_s = self.startup_grace_s  # it catches up from its peers before it answers
                self._replicas[rid] = new
                if self._ctx is not None and not self._stopped:
                    self._connect(new)
                self.log.info("replica %s (%s) joined the group", rid, new.address)
            elif (current.ip, current.ports) != (new.ip, new.ports):
                self.replace_replica(r)

    def _forget(self, rid: int) -> None:
        """Drop what a replica that is gone (or restarted) asked or answered: its idles and input requests are moot."""
        for req in self._requests.values():
            req.idles.pop(rid, None)
            req.sent.pop(rid, None)  # a new process there never got it
            if req.answered_by == rid and not req.idle_sent:
                req.answer_breaks = -1  # nor will its idle come (_idle_lost)
        for ident, (owner, _) in list(self._stdin_owner.items()):
            if owner == rid:
                del self._stdin_owner[ident]

    def live_replicas(self) -> list[int]:
        now = time.monotonic()
        return sorted(r.id for r in self._replicas.values() if self._is_live(r, now))

    def majority_alive(self) -> bool:
        return 2 * len(self.live_replicas()) > len(self._replicas)

    def ready_replicas(self) -> list[int]:
        """Live replicas connected on every channel and welcomed on iopub."""
        now = time.monotonic()
        return sorted(r.id for r in self._replicas.values() if r.ready and self._is_live(r, now))

    @property
    def accepting(self) -> bool:
        """The replicas are up (see the module docstring): requests are no longer held for them."""
        return self._open

    def held(self) -> tuple[int, int]:
        """How many requests the router holds, and their size in bytes."""
        return len(self._held) + len(self._held_control), self._held_bytes

    async def stop(self) -> None:
        """Close every socket and task. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        tasks = list(self._tasks)
        for rep in self._replicas.values():
            tasks += rep.tasks
            self._disconnect(rep)
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in self._client.values():
            sock.close(linger=0)
        self._client = {}
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        self._requests.clear()
        self._stdin_owner.clear()
        self._idle_owed.clear()
        self._standing_by.clear()
        self._held.clear()
        self._held_control.clear()
        self._held_bytes = 0

    # ---------------------------------------------------------------- replicas' sockets

    @staticmethod
    def _make_replica(r: dict, now: float) -> _Replica:
        ports = {k: int(r[k]) for k in PORT_KEYS}
        return _Replica(id=int(r["id"]), ip=str(r.get("ip") or "127.0.0.1"), ports=ports,
                        last_seen=now)

    def _connect(self, rep: _Replica) -> None:
        assert self._ctx is not None
        # shell and stdin must share a routing id: the kernel sends input_request on its stdin
        # ROUTER to the identity it saw on shell.
        routing_id = f"gpuhub-router-{id(self):x}-{rep.id}-{time.monotonic_ns():x}".encode()
        for key, kind in (("shell_port", zmq.DEALER), ("control_port", zmq.DEALER),
                          ("stdin_port", zmq.DEALER), ("hb_port", zmq.DEALER),
                          ("iopub_port", zmq.SUB)):
            sock = self._ctx.socket(kind)
            # Short linger: a dying router must not hang on messages for a dead replica.
            sock.linger = 500
            # Reconnect quickly: a replica that restarts on the same address is back within 1 s.
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            # ZMTP heartbeats notice a peer whose host vanished (no RST), so IMMEDIATE kicks in.
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(self.hb_interval_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(300, int(self.hb_timeout_s * 1000)))
            if kind == zmq.DEALER:
                # IMMEDIATE: never queue a request for a replica that is not connected, or it
                # would be delivered when the replica comes back, long after the client moved on.
                sock.setsockopt(zmq.IMMEDIATE, 1)
                if key in ("shell_port", "stdin_port"):
                    sock.setsockopt(zmq.ROUTING_ID, routing_id)
            else:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            if key != "hb_port":
                # A name of our own: pyzmq's default names the endpoint after the socket's file
                # descriptor, which a new socket reuses while libzmq still closes an old one in the
                # background (its monitor endpoint still bound): EADDRINUSE on a reconnect.
                mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
                                              addr=f"inproc://gpuhub-router-monitor-{next(_monitor_names)}")
                rep.monitors.append(mon)
                rep.tasks.append(asyncio.ensure_future(self._watch(mon, rep, key)))
            curve.as_client(sock, self._curve)
            sock.connect(rep.url(key))
            rep.sockets[key] = sock
        handlers = {"shell_port": self._on_replica_reply, "control_port": self._on_replica_reply,
                    "stdin_port": self._on_replica_stdin, "iopub_port": self._on_replica_iopub,
                    "hb_port": self._on_replica_hb}
        for key, handler in handlers.items():
            what = f"replica {rep.id} {key.removesuffix('_port')}"
            rep.tasks.append(asyncio.ensure_future(
                self._pump(rep.sockets[key], handler, what, replica=rep, channel=key)))

    def _disconnect(self, rep: _Replica) -> None:
        for t in rep.tasks:
            t.cancel()
        rep.tasks = []
        for sock in rep.sockets.values():
            # Stop the socket's monitor before closing our end of it: libzmq sends monitor events
            # with a blocking send, from its I/O thread, so an event (the replica's process exiting
            # just now: DISCONNECTED) sent after our end closed blocks that thread for good, and
            # every socket of this router with it (all replicas then look dead).
            sock.disable_monitor()
            sock.close(linger=0)
        for mon in rep.monitors:
            mon.close(linger=0)
        rep.sockets, rep.monitors = {}, []
        rep.connected.clear()
        rep.welcomed = False

    async def _watch(self, mon: zmq.asyncio.Socket, rep: _Replica, channel: str) -> None:
        """Follow one replica socket's connection: requests wait until the handshake succeeded."""
        while True:
            try:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # closed with its socket
            except Exception:
                self.log.exception("bad monitor event from replica %s %s", rep.id, channel)
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                rep.connected.add(channel)
                await self._connection_up(rep)
            elif event == zmq.EVENT_DISCONNECTED:
                rep.connected.discard(channel)
                rep.breaks[channel] = rep.breaks.get(channel, 0) + 1
                if channel == "iopub_port":
                    rep.welcomed = False  # a new connection is welcomed again
                running = self._running
                if channel in ("shell_port", "control_port") and running is not None and rep.id in running.sent_to:
                    rep.lost_running = running.msg_id

    async def _connection_up(self, rep: _Replica) -> None:
        """One of ``rep``'s connections is up (a handshake, or its iopub's welcome): the kernel may
        open; once ``rep`` is ready it gets the running cell, or the requests held while no
        replica was ready."""
        await self._check_open()
        await self._hand_running(rep)
        if rep.ready and self._open and self._running is None and self._held:
            await self._release()

    async def _subscriptions(self) -> None:
        """Welcome each new iopub subscription (JEP 65), as ipykernel 7 does: signed, on its topic."""
        sock = self._client["iopub_port"]
        async for frames in self._received(sock, "client iopub"):
            for frame in frames:
                if not frame or frame[0] != 1:
                    continue  # an unsubscription
                try:
                    topic = bytes(frame[1:]).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                msg = self._session.msg("iopub_welcome", content={"subscription": topic})
                wire = self._session.serialize(msg)
                await self._send(sock, [topic.encode(), *wire] if topic else wire, "client iopub")

    # ---------------------------------------------------------------- plumbing

    async def _received(self, sock: zmq.asyncio.Socket, what: str):
        """Every multipart message ``sock`` receives, until it is closed (errors are logged)."""
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if sock.closed or e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.log.warning("receive on %s failed: %s", what, e)
                await asyncio.sleep(0.1)
                continue
            yield frames

    async def _pump(self, sock: zmq.asyncio.Socket, handler, what: str, *,
                    replica: _Replica | None = None, channel: str = "") -> None:
        """Receive from one socket forever; one bad message never stops the router."""
        async for frames in self._received(sock, what):
            try:
                if channel == "hb_port":  # heartbeats are bare frames, not signed messages
                    await handler(frames, replica)
                    continue
                msg = self._verify(frames, what)
                if msg is None:
                    continue
                if replica is None:
                    await handler(msg, channel)
                else:
                    await handler(msg, replica, channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("error handling a message from %s", what)

    def _verify(self, frames: list[bytes], what: str) -> _Msg | None:
        try:
            idx = frames.index(DELIM)
        except ValueError:
            idx = -1
        if idx < 0 or len(frames) < idx + 6:
            self.log.warning("dropped a malformed message from %s", what)
            return None
        if self.key:
            mac = hmac.new(self.key, digestmod=self._digest)
            for part in frames[idx + 2: idx + 6]:
                mac.update(part)
            if not hmac.compare_digest(mac.hexdigest().encode(), bytes(frames[idx + 1])):
                self.log.warning("dropped a message with a bad signature from %s", what)
                return None
        header, parent = _loads(frames[idx + 2]), _loads(frames[idx + 3])
        if not header.get("msg_type"):
            self.log.warning("dropped a malformed message from %s", what)
            return None
        return _Msg(frames, idx, header, parent)

    async def _send(self, sock: zmq.asyncio.Socket | None, frames: list[bytes], what: str) -> bool:
        if sock is None or sock.closed:
            return False
        try:
            # DONTWAIT: a DEALER with IMMEDIATE and no connected replica raises Again at once.
            await sock.send_multipart(frames, flags=zmq.DONTWAIT)
            return True
        except zmq.Again:
            self.log.debug("could not send to %s (not connected or full)", what)
        except zmq.ZMQError as e:
            self.log.warning("send to %s failed: %s", what, e)
        return False

    # ---------------------------------------------------------------- request bookkeeping

    def _request(self, msg_id: str, msg_type: str = "") -> _Request:
        req = self._requests.get(msg_id)
        if req is None:
            req = _Request(msg_type=msg_type, created=time.monotonic())
            self._requests[msg_id] = req
            if len(self._requests) > self.max_requests:
                self._evict()
        return req

    def _evict(self) -> None:
        # Finished requests go first: a long cell's entry must outlive a burst of widget
        # comm_msgs, or a follower's late idle could pass for the executor's.
        for msg_id in [m for m, r in self._requests.items() if r.finished]:
            if len(self._requests) <= self.max_requests:
                return
            del self._requests[msg_id]
        while len(self._requests) > self.max_requests:
            self._requests.popitem(last=False)

    def _maybe_finish(self, req: _Request) -> None:
        if not req.finished and req.idle_sent and (req.answered_by is not None
                                                   or not req.expects_reply):
            req.finished = True
            req.idles.clear()
            req.created = time.monotonic()  # from now on, finished_ttl_s counts

    def _sweep(self, now: float) -> None:
        for msg_id, req in list(self._requests.items()):
            ttl = self.finished_ttl_s if req.finished else self.request_ttl_s
            if now - req.created > ttl:
                del self._requests[msg_id]
        for ident, (_, since) in list(self._stdin_owner.items()):
            if now - since > self.request_ttl_s:
                del self._stdin_owner[ident]

    # ---------------------------------------------------------------- client side

    async def _on_client_request(self, msg: _Msg, channel: str) -> None:
        if channel == "control_port":
            # never held behind an execute (interrupt, shutdown, debug); only until the replicas are up
            if self._open:
                await self._forward(msg, channel)
            else:
                self._hold(msg, channel)
            return
        async with self._order:
            if self._open and self._running is None and not self._held:
                if not await self._forward(msg, channel):
                    self._hold(msg, channel)  # no replica takes requests now: it goes when one does
            else:
                self._hold(msg, channel)

    def _hold(self, msg: _Msg, channel: str) -> None:
        count, size = self.held()
        if count + 1 > self.max_held_requests or size + msg.size > self.max_held_bytes:
            self.log.warning("dropped %s %s: the router already holds %d requests (%d bytes), the "
                             "most it holds is %d requests or %d bytes", msg.msg_type,
                             msg.header.get("msg_id", ""), count, size, self.max_held_requests,
                             self.max_held_bytes)
            return
        (self._held if channel == "shell_port" else self._held_control).append(_Held(msg, channel))
        self._held_bytes += msg.size

    def _unhold(self, queue: deque[_Held]) -> _Held:
        held = queue.popleft()
        self._held_bytes -= held.msg.size
        return held

    def _put_back(self, held: _Held) -> None:
        """Undo :meth:`_unhold` of a shell request: it is first again."""
        self._held.appendleft(held)
        self._held_bytes += held.msg.size

    async def _forward(self, msg: _Msg, channel: str) -> int:
        """Send a request to every live replica; an execute_request on shell becomes the running one."""
        msg_id = str(msg.header.get("msg_id", ""))
        if msg_id:
            self._request(msg_id, msg.msg_type)
        now = time.monotonic()
        execute = channel == "shell_port" and msg.msg_type == "execute_request"
        sent: set[int] = set()
        for rep in list(self._replicas.values()):
            if not self._is_live(rep, now) or (channel == "shell_port" and not rep.ready):
                # Not ready: back from a restart, its iopub not yet welcomed (what it printed now
                # would be lost, and its idle with it). It gets a running cell once it is
                # (_hand_running), and later requests.
                continue
            if execute and rep.last_execute != self._last_execute:
                # it did not get the last cell: it must catch up before it acts on the lease
                await self._send_note(rep, "shell_port", {"cell": msg_id, "missed": True})
            if await self._send(rep.sockets.get(channel), msg.frames, f"replica {rep.id}"):
                sent.add(rep.id)
                if msg_id:
                    self._requests[msg_id].sent[rep.id] = rep.breaks.get(channel, 0)
                if execute:
                    rep.last_execute = msg_id
        if not sent:
            req = self._requests.get(msg_id) if msg_id else None
            if req is None or not req.undelivered:  # once, not at every retry
                self.log.warning("no ready replica took %s %s%s", msg.msg_type, msg_id,
                                 ": held until one does" if channel == "shell_port" else "")
            if req is not None:
                req.undelivered = True
        elif execute:
            self._last_execute = msg_id
            content = msg.content()
            self._running = _Running(msg_id, bool(content.get("silent", False)),
                                     bool(content.get("stop_on_error", True)), sent, msg.frames)
            left = self._last_sent - set(self._replicas)
            self._last_sent = sent  # the running cell's own set: a replica handed it late is added there
            if sent != set(self._replicas) or left:
                # A lease holder that did not get the cell cannot run it: the others must know. That
                # includes a holder that left the group since the last cell (its server was drained
                # or lost): it ran the last cell, and the router no longer sends it any.
                for rid in sorted(sent):
                    await self._send_note(self._replicas[rid], "control_port",
                                          {"cell": msg_id, "to": sorted(sent)})
        return len(sent)

    async def _hand_running(self, rep: _Replica) -> None:
        """A replica that joined the group (or was replaced) while a cell runs gets that cell too,
        once it is ready: the cell may be waiting for a GPU that only the newcomer's server has
        free (every other replica's server is busy), and only a replica that got the cell can
        offer to run it. It hears that it missed the last cell (so it catches up first) and which
        replicas got this one (whether the lease holder can run it). A replica whose connection
        broke after the cell was sent to it (``lost_running``) gets it again the same way."""
        running = self._running
        if running is None or not rep.ready or self._stopped or self._replicas.get(rep.id) is not rep:
            return
        again = rep.id in running.sent_to
        if again and rep.lost_running != running.msg_id:
            return
        to = sorted(running.sent_to | {rep.id})
        # "late": the others were told who got this cell before this replica did; if it holds the
        # lease, it must not run the cell under it (they may be electing another replica already).
        await self._send_note(rep, "control_port", {"cell": running.msg_id, "to": to})
        await self._send_note(rep, "shell_port", {"cell": running.msg_id, "missed": True, "late": True})
        if self._running is running and await self._send(
                rep.sockets.get("shell_port"), running.frames, f"replica {rep.id}"):
            running.sent_to.add(rep.id)
            self._request(running.msg_id).sent[rep.id] = rep.breaks.get("shell_port", 0)
            rep.last_execute, rep.lost_running = running.msg_id, None
            self.log.info("replica %s %s while %s runs: it got that cell %s", rep.id,
                          "came back" if again else "joined", running.msg_id, "again" if again else "too")

    async def _send_note(self, rep: _Replica, channel: str, content: dict) -> None:
        """A dispatch note (gpuhub/platform/messages.py) to one replica, signed with the kernel's key."""
        note = self._session.msg(DISPATCH_NOTE, content=content)
        self._notes[note["header"]["msg_id"]] = None
        while len(self._notes) > 1024:  # a replica's statuses for a note follow it within moments
            self._notes.popitem(last=False)
        await self._send(rep.sockets.get(channel), self._session.serialize(note), f"replica {rep.id} note")

    async def _release(self, abort: bool = False) -> None:
        """Forward held requests in order until one is an execute_request (it then runs); with
        abort, every held execute_request is answered "aborted" instead and never forwarded."""
        if not self._open:
            return
        while self._held_control:
            held = self._unhold(self._held_control)
            await self._forward(held.msg, held.channel)
        async with self._order:
            while self._held and self._running is None:
                held = self._unhold(self._held)
                if abort and held.msg.msg_type == "execute_request":
                    await self._send_aborted(held.msg)
                elif not await self._forward(held.msg, held.channel):
                    self._put_back(held)  # first again, for the next try (_heartbeat_loop)
                    return

    async def _send_aborted(self, msg: _Msg) -> None:
        """ipykernel 7's answer to an execute_request after an error (dispatch_shell and
        _send_abort_reply): busy, an "aborted" execute_reply, idle, all with the request as parent."""
        self.log.info("aborting %s %s", msg.msg_type, msg.header.get("msg_id", ""))
        parent = msg.header
        status = {"status": "aborted"}
        md = {"started": datetime.now(UTC), "dependencies_met": True,
              "engine": self._session.session, **status}
        topic = b"kernel.gpuhub-router.status"
        iopub, shell = self._client.get("iopub_port"), self._client.get("shell_port")
        busy = self._session.msg("status", {"execution_state": "busy"}, parent=parent)
        await self._send(iopub, self._session.serialize(busy, ident=topic), "client iopub")
        reply = self._session.msg(msg.msg_type.rsplit("_", 1)[0] + "_reply", status, parent=parent,
                                  metadata=md)
        await self._send(shell, self._session.serialize(reply, ident=list(msg.idents)), "client shell")
        idle = self._session.msg("status", {"execution_state": "idle"}, parent=parent)
        await self._send(iopub, self._session.serialize(idle, ident=topic), "client iopub")

    async def _check_open(self) -> None:
        """Open the gate once the replicas are up: all of them, or a majority for startup_straggler_s."""
        if self._open or self._stopped:
            return
        ready, now = len(self.ready_replicas()), time.monotonic()
        if 2 * ready > len(self._replicas):
            if self._majority_ready_at is None:
                self._majority_ready_at = now
        else:
            self._majority_ready_at = None
        if ready == len(self._replicas) or (
                self._majority_ready_at is not None
                and now - self._majority_ready_at >= self.startup_straggler_s):
            self._open = True
            self.log.info("replicas %s are up after %.1f s; %d held requests go to them",
                          self.ready_replicas(), now - self._started_at, self.held()[0])
            await self._release()

    async def _on_client_stdin(self, msg: _Msg, channel: str) -> None:
        owner = self._stdin_owner.pop(msg.idents, None)
        if owner is None:
            self.log.warning("dropped %s from a client with no pending input request",
                             msg.msg_type)
            return
        rep = self._replicas.get(owner[0])
        if rep is not None:
            await self._send(rep.sockets.get("stdin_port"), msg.frames, f"replica {rep.id}")

    async def _on_client_hb(self, frames: list[bytes], _: None) -> None:
        # Silence, not an error, below a majority: the Jupyter server's own heartbeat then
        # declares the kernel dead, which is the truth (it can no longer commit anything).
        if self.majority_alive():
            await self._send(self._client.get("hb_port"), frames, "client heartbeat")

    # ---------------------------------------------------------------- replica side

    async def _on_replica_reply(self, msg: _Msg, rep: _Replica, channel: str) -> None:
        parent_id = msg.parent_id
        req = self._request(parent_id) if parent_id else None
        if req is None or req.answered_by is not None:
            return  # a duplicate: another replica's reply was already forwarded
        gp = None
        if msg.msg_type == "execute_reply":
            gp = msg.metadata().get("gpuhub")
            if isinstance(gp, dict) and gp.get("role") != "executor":
                # A follower's reply; the executor's is the one that counts, unless the executor
                # is gone before it came (then this one stands in for it).
                executor = gp.get("executor")
                if type(executor) is int and (req.standby is None or executor == rep.id):
                    req.standby = (rep.id, msg, channel, executor)  # the executor restarted: its own first
                    self._standing_by[parent_id] = None
                await self._answer_with_standby(parent_id, req)
                return
        elif (channel == "shell_port" and self._last_executor not in (None, rep.id)
              and self._can_answer(self._last_executor, req)):
            # Completions, inspection, comm_info, …: the replica that ran the last cell answers, as
            # only it holds what could not be replicated (a widget's comm, an open file).
            if req.standby is None:
                req.standby = (rep.id, msg, channel, self._last_executor)
                self._standing_by[parent_id] = None
            await self._answer_with_standby(parent_id, req)
            return
        await self._answer(parent_id, req, rep.id, msg, channel, ran_cell=isinstance(gp, dict))

    async def _answer(self, parent_id: str, req: _Request, rid: int, msg: _Msg, channel: str, *,
                      ran_cell: bool = False) -> None:
        """Forward replica ``rid``'s reply to the client, with its idle if it came first.
        ``ran_cell``: an execute_reply from the replica that ran the cell."""
        req.answered_by, req.standby = rid, None
        self._standing_by.pop(parent_id, None)
        answerer = self._replicas.get(rid)
        req.answer_breaks = answerer.breaks.get("iopub_port", 0) if answerer is not None else 0
        if msg.msg_type == "execute_reply":
            self._last_executor = rid if ran_cell else None
        await self._send(self._client.get(channel), msg.frames, f"client {channel}")
        idle = req.idles.pop(rid, None)
        if idle is not None:
            await self._send_idle(parent_id, req, idle)
        elif not req.idle_sent:
            self._idle_owed[parent_id] = None  # _check_idles_owed
        self._maybe_finish(req)
        running = self._running
        if running is not None and running.msg_id == parent_id and msg.msg_type == "execute_reply":
            self._running = None
            # ipykernel's rule (execute_request), applied here once for every replica
            abort = (msg.content().get("status") == "error" and not running.silent
                     and running.stop_on_error)
            await self._release(abort=abort)

    async def _answer_with_standby(self, parent_id: str, req: _Request) -> None:
        """Forward the standby reply once the replica awaited can no longer send its own. For an
        execute: the cell ended in the log (a follower replies only then), so the client must not
        wait for good when the executor died (or lost its connection) after committing the cell,
        before its reply left. For anything else: also after ``prefer_executor_s``."""
        if req.standby is None or req.answered_by is not None:
            self._standing_by.pop(parent_id, None)
            return
        rid, msg, channel, awaited = req.standby
        execute = msg.msg_type == "execute_reply"
        if awaited != rid and self._can_answer(awaited, req) and (
                execute or time.monotonic() - req.created < self.prefer_executor_s):
            return
        if execute:
            self.log.warning("the executor of %s (replica %s) is gone without its reply; replica %s's "
                             "reply stands in for it", parent_id, awaited, rid)
        await self._answer(parent_id, req, rid, msg, channel)

    async def _check_standbys(self) -> None:
        for msg_id in list(self._standing_by):
            req = self._requests.get(msg_id)
            if req is None:
                self._standing_by.pop(msg_id, None)
            else:
                await self._answer_with_standby(msg_id, req)

    def _can_answer(self, rid: int, req: _Request) -> bool:
        """Whether replica ``rid`` may still send its reply to ``req``: it is in the group, its
        heartbeats go on, it got the request, and its shell connection has not broken since (a reply
        sent meanwhile was dropped; a replica that comes back while its cell runs is handed that
        cell again, _hand_running, and then names itself as the executor: its old process had
        the reply)."""
        rep = self._replicas.get(rid)
        return (rep is not None and self._is_live(rep, time.monotonic()) and rid in req.sent
                and rep.breaks.get("shell_port", 0) == req.sent[rid])

    def _idle_lost(self, req: _Request) -> bool:
        """The answerer's idle cannot come any more: it left the group, its heartbeats stopped, or
        its iopub connection broke since its reply (a PUB drops what it sends meanwhile)."""
        rep = self._replicas.get(req.answered_by)  # type: ignore[arg-type]
        return (rep is None or not self._is_live(rep, time.monotonic())
                or rep.breaks.get("iopub_port", 0) != req.answer_breaks)

    async def _send_idle(self, parent_id: str, req: _Request, frames: list[bytes]) -> None:
        req.idle_sent = True
        self._idle_owed.pop(parent_id, None)
        await self._send(self._client.get("iopub_port"), frames, "client iopub")

    async def _check_idles_owed(self) -> None:
        """A request answered by a replica that is gone before its idle came gets another
        replica's idle: a client takes a request as running until its idle."""
        for msg_id in list(self._idle_owed):
            req = self._requests.get(msg_id)
            if req is None or req.idle_sent or req.answered_by is None:
                self._idle_owed.pop(msg_id, None)
            elif req.idles and self._idle_lost(req):
                self.log.warning("replica %s answered %s and is gone without its idle; another replica's "
                                 "stands in for it", req.answered_by, msg_id)
                await self._send_idle(msg_id, req, next(iter(req.idles.values())))
                self._maybe_finish(req)

    async def _on_replica_iopub(self, msg: _Msg, rep: _Replica, channel: str) -> None:
        mtype = msg.msg_type
        if mtype == "iopub_welcome":
            # addressed to our own SUB's subscription, not to any client: from now on, this
            # replica's outputs reach the router
            if not rep.welcomed:
                rep.welcomed = True
                # A welcome proves the replica's sockets (its heartbeat's among them) are up: end
                # its start-up grace now, or a replica stopped before its first heartbeat echo
                # would count as live for the whole grace.
                self._heard_from(rep)
                await self._connection_up(rep)
            return
        if mtype == GROUP_CHANGE:  # for the router only (gpuhub/platform/messages.py)
            target = msg.content().get("target")
            if isinstance(target, str) and self.on_group_change is not None:
                self.on_group_change(target[:255])
            return
        parent_id = msg.parent_id
        if parent_id in self._notes:
            return  # a replica's busy/idle around one of our dispatch notes: not the client's business
        if mtype == "status":
            state = str(msg.content().get("execution_state", ""))
            if not parent_id:
                # the kernel-start status: each replica sends one, the client needs one
                if state in self._startup_status_sent:
                    return
                self._startup_status_sent.add(state)
            else:
                req = self._request(parent_id)
                if state == "busy":
                    if req.busy_sent:
                        return
                    req.busy_sent = True
                elif state == "idle":
                    if req.idle_sent:
                        return
                    if req.expects_reply and req.answered_by != rep.id:
                        req.idles.setdefault(rep.id, msg.frames)  # wait to learn who answered, or for its own
                        if req.answered_by is not None:
                            await self._check_idles_owed()
                        return
                    await self._send_idle(parent_id, req, msg.frames)
                    self._maybe_finish(req)
                    return
                else:
                    if state in req.statuses_sent:
                        return
                    req.statuses_sent.add(state)
        elif mtype == "execute_input" and parent_id:
            req = self._request(parent_id)
            if req.input_sent:
                return
            req.input_sent = True
        await self._send(self._client.get("iopub_port"), msg.frames, "client iopub")

    async def _on_replica_stdin(self, msg: _Msg, rep: _Replica, channel: str) -> None:
        parent_id = msg.parent_id
        if parent_id:
            req = self._request(parent_id)
            # Only one replica may talk to the user for a request: the first that asks.
            if req.stdin_replica is None:
                req.stdin_replica = rep.id
            elif req.stdin_replica != rep.id:
                return
        self._stdin_owner[msg.idents] = (rep.id, time.monotonic())
        await self._send(self._client.get("stdin_port"), msg.frames, "client stdin")

    async def _on_replica_hb(self, frames: list[bytes], rep: _Replica) -> None:
        if self._heard_from(rep):
            await self._check_open()

    def _heard_from(self, rep: _Replica) -> bool:
        """The replica runs now. True the first time it shows it."""
        rep.last_seen = time.monotonic()
        first = not rep.answered
        rep.answered = True
        if not rep.live:
            rep.live = True
            self.log.info("replica %s (%s) is alive again", rep.id, rep.address)
        return first

    # ---------------------------------------------------------------- liveness

    def _is_live(self, rep: _Replica, now: float) -> bool:
        grace = 0.0 if rep.answered else rep.grace_s
        return now - rep.last_seen <= self.hb_timeout_s + grace

    async def _heartbeat_loop(self) -> None:
        while True:
            now = time.monotonic()
            for rep in list(self._replicas.values()):
                if rep.live and not self._is_live(rep, now):
                    rep.live = False
                    self.log.info("replica %s (%s) is dead: no heartbeat for %.1f s", rep.id,
                                  rep.address, now - rep.last_seen)
                # [b"", ping]: the empty frame makes the ping valid for a REP as well as for
                # ipykernel's echoing ROUTER.
                await self._send(rep.sockets.get("hb_port"), [b"", b"ping"],
                                 f"replica {rep.id} heartbeat")
                self._watch_unready(rep, now)
            self._sweep(now)
            await self._check_open()
            await self._check_standbys()
            await self._check_running(now)
            await self._check_idles_owed()
            if self._open and self._running is None and self._held:
                await self._release()  # requests no replica could take (all restarting): try again
            await asyncio.sleep(self.hb_interval_s)

    def _watch_unready(self, rep: _Replica, now: float) -> None:
        """Log, once, a replica that answers heartbeats but has long been unready: it gets no cells
        and falls behind its peers (an iopub that never welcomes the router, as a replica of a
        release before every subscription was welcomed can do after a reconnection)."""
        if rep.ready or not rep.live or not rep.answered:  # (still starting: its grace covers it)
            rep.unready_since, rep.told_unready = None, False
            return
        if rep.unready_since is None:
            rep.unready_since = now
        elif not rep.told_unready and now - rep.unready_since >= self.unready_warning_s:
            rep.told_unready = True
            missing = sorted({"shell_port", "control_port", "iopub_port"} - rep.connected)
            why = f"not connected: {', '.join(missing)}" if missing else "its iopub never welcomed the router"
            self.log.warning("replica %s (%s) answers heartbeats but has not been ready for %.0f s "
                             "(%s): it gets no cells meanwhile and falls behind; restarting the kernel "
                             "brings it back", rep.id, rep.address, now - rep.unready_since, why)

    async def _check_running(self, now: float) -> None:
        """The running execute's reply can no longer come when every replica that got it is gone
        or dead: stop waiting for it, or the held requests would wait forever."""
        running = self._running
        if running is None:
            return
        if any(rid in self._replicas and self._is_live(self._replicas[rid], now)
               for rid in running.sent_to):
            return
        self.log.warning("no replica that got execute_request %s is alive: its reply will not come; "
                         "the %d held requests go on", running.msg_id, len(self._held))
        self._running = None
        await self._release()
