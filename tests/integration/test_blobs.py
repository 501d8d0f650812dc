"""Large values beside the Raft log: the blob server and client over real sockets on 127.0.0.1
(authentication, verification on receipt, malformed requests). The digest and the store alone:
tests/unit/test_digest.py, tests/unit/test_blobstore.py."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import struct
import threading

import numpy as np
import pytest

from gpuhub.kernel.replica import reachable
from gpuhub.replication import blobclient, blobwire
from gpuhub.replication.blobclient import BlobError, fetch, push, push_all
from gpuhub.replication.blobserver import BlobServer
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest
from tests.helpers import wait_for

KEY = b"k" * 32
MIB = 1 << 20


@pytest.fixture
def servers():
    """Start BlobServers on free ports; all stopped at the end."""
    started = []

    def start(n: int = 1, key: bytes = KEY, **kw) -> list[BlobServer]:
        new = [BlobServer(BlobStore(), key, "127.0.0.1", 0, **kw).start() for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for s in started:
        s.stop()


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# --- network -------------------------------------------------------------------------------------
def test_put_get_round_trip(servers):
    (srv,) = servers(1)
    value = b"hello" * 1000
    d = digest(value)
    srv.store.put(d, value)
    assert bytes(fetch([srv.address], KEY, d)) == value
    push(srv.address, KEY, {digest(b"other"): b"other"})
    assert bytes(srv.store.get(digest(b"other"))) == b"other"


def counting_connects(monkeypatch) -> list[str]:
    """Start with no kept connection; the addresses of the new ones from now on."""
    blobclient._kept.forget()
    made: list[str] = []
    real = blobclient._connect

    def connect(addr, *args, **kw):
        made.append(addr)
        return real(addr, *args, **kw)

    monkeypatch.setattr(blobclient, "_connect", connect)
    return made


def test_calls_to_a_server_share_one_kept_connection_and_one_it_closed_is_replaced(servers, monkeypatch):
    made = counting_connects(monkeypatch)
    (srv,) = servers(1)
    values = {digest(v): v for v in (b"a" * 100_000, b"b" * 300, b"c" * 3 * MIB)}
    for d, v in values.items():
        push(srv.address, KEY, {d: v})
    got = {d: bytes(fetch([srv.address], KEY, d)) for d in values}
    assert got == values and made == [srv.address]  # one handshake for six calls
    for conn in list(srv._conns):  # the server ends it (a restart, its idle timeout)
        conn.shutdown(socket.SHUT_RDWR)
    wait_for(lambda: not srv._conns, what="the server to close the connection")
    new = b"d" * 200_000
    push(srv.address, KEY, {digest(new): new})  # the kept one fails: the push is made again afresh
    assert bytes(srv.store.get(digest(new))) == new and made == [srv.address] * 2
    assert bytes(fetch([srv.address], KEY, digest(new))) == new and made == [srv.address] * 2


def test_a_kept_connection_serves_only_its_key_and_never_a_forked_child(servers, monkeypatch):
    made = counting_connects(monkeypatch)
    (srv,) = servers(1)
    other_key = b"o" * 32
    push(srv.address, KEY, {digest(b"x"): b"x"})
    with pytest.raises(BlobError, match="authentication refused"):
        push(srv.address, other_key, {digest(b"y"): b"y"})  # not the connection kept for KEY
    assert made == [srv.address] * 2 and not srv.store.has(digest(b"y"))
    pid = os.fork()
    if pid == 0:  # the child: the parent's connections (and their record counters) are not its
        os._exit(0 if len(blobclient._kept) == 0 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    push(srv.address, KEY, {digest(b"z"): b"z"})  # the parent's kept connection still works
    assert made == [srv.address] * 2 and bytes(srv.store.get(digest(b"z"))) == b"z"


def test_a_kept_connection_is_not_tried_again_once_its_call_timed_out_or_got_a_reply(servers, monkeypatch):
    made = counting_connects(monkeypatch)
    (srv,) = servers(1)
    push(srv.address, KEY, {digest(b"x"): b"x"})
    hung, has = threading.Event(), srv.store.has
    monkeypatch.setattr(srv.store, "has", lambda d: hung.wait(30) and has(d))  # the server stops answering
    with pytest.raises(BlobError, match="timed out"):
        push(srv.address, KEY, {digest(b"y"): b"y"}, timeout=0.5)
    hung.set()
    assert made == [srv.address]  # a slow or hung peer costs the call its timeout once, not twice
    monkeypatch.setattr(srv.store, "has", has)
    push(srv.address, KEY, {digest(b"x2"): b"x2"})  # kept again
    real = blobwire.recv_body

    def cut(chan, view, verify):  # the server ends the connection after its "continue"
        if threading.current_thread().name.startswith("blob-conn"):
            raise blobwire.Closed("cut off")
        return real(chan, view, verify)

    monkeypatch.setattr(blobwire, "recv_body", cut)
    value = np.ones(1 << 20).tobytes()
    with pytest.raises(BlobError):
        push(srv.address, KEY, {digest(value): value})
    assert made == [srv.address] * 2 and not srv.store.has(digest(value))  # once: not sent again


def test_a_kept_connection_is_never_used_by_another_process(servers, monkeypatch):
    made = counting_connects(monkeypatch)
    (srv,) = servers(1)
    push(srv.address, KEY, {digest(b"x"): b"x"})
    ((chan, _),) = blobclient._kept._idle.values()
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)  # what a child forked without the at-fork hook sees
    with pytest.raises(blobwire.Closed, match="another process"):
        chan.send(b"anything")  # its record numbers are the parent's
    assert blobclient._kept.take(srv.address, KEY) is None and len(blobclient._kept) == 0
    assert made == [srv.address]


def test_push_all_to_two_then_fetch_from_either(servers):
    a, b = servers(2)
    items = {digest(v): v for v in (b"x" * 100_000, b"small", b"")}
    errors = push_all([a.address, b.address], KEY, items)
    assert errors == {a.address: None, b.address: None}
    for srv in (a, b):
        assert srv.store.digests() == set(items)
        for d, v in items.items():
            assert bytes(fetch([srv.address], KEY, d)) == v
    # a second push is answered "already stored" and changes nothing
    assert push_all([a.address, b.address], KEY, items) == {a.address: None, b.address: None}
    assert a.store.nbytes == sum(len(v) for v in items.values())


def test_push_all_reports_a_down_peer_without_hiding_the_others(servers):
    (a,) = servers(1)
    down = free_addr()
    errors = push_all([down, a.address], KEY, {digest(b"v"): b"v"})
    assert errors[a.address] is None and "cannot connect" in errors[down]
    assert a.store.has(digest(b"v"))


def test_push_all_returns_once_enough_peers_have_the_values(servers):
    """An executor needs a majority, not every peer: push_all(enough=1) returns when one peer
    has the values; a peer still in its push is reported later through on_late."""
    (a,) = servers(1)
    stalled = socket.socket()  # accepts and never says hello: the push to it waits until it closes
    stalled.bind(("127.0.0.1", 0))
    stalled.listen()
    slow = f"127.0.0.1:{stalled.getsockname()[1]}"
    late: dict[str, str | None] = {}
    ended = threading.Event()

    def on_late(addr: str, err: str | None) -> None:
        late[addr] = err
        ended.set()

    try:
        value = b"v" * 100_000
        errors = push_all([slow, a.address], KEY, {digest(value): value}, timeout=120, enough=1,
                          on_late=on_late)
        assert errors == {a.address: None}  # back while the other push still waits
        assert a.store.has(digest(value)) and not ended.is_set()
    finally:
        stalled.close()  # resets the queued connection: that push ends now, with an error
    assert ended.wait(60), "the stalled push was never reported"
    assert list(late) == [slow] and "failed" in late[slow]


def test_a_load_waits_for_a_value_still_arriving(servers):
    """A replica that must load a value while its PUT still arrives waits for it
    (BlobStore.wait_incoming) instead of fetching it a second time; a receive that ends without
    storing it (a digest mismatch, a dead peer) ends the wait with False: then it fetches."""
    (a,) = servers(1)
    value = np.arange(4 * MIB // 8, dtype=np.float64).tobytes()
    d, other = digest(value), digest(b"never stored")
    assert not a.store.wait_incoming(d, 0)  # nothing on its way: no wait

    def once_waiting(then) -> threading.Thread:
        def run():
            wait_for(lambda: a.store._arrived._waiters, 30, "the load to wait")
            then()
        t = threading.Thread(target=run)
        t.start()
        return t

    a.store.incoming(d)  # as the server does when a PUT's body begins
    t = once_waiting(lambda: push(a.address, KEY, {d: value}))  # the PUT arrives meanwhile
    assert a.store.wait_incoming(d, 60) and bytes(a.store.get(d)) == value
    t.join()
    a.store.received(d)
    a.store.incoming(other)
    t = once_waiting(lambda: a.store.received(other))
    assert a.store.wait_incoming(other, 60) is False
    t.join()


def test_fetch_falls_back_to_the_next_peer(servers):
    empty, full = servers(2)
    value = b"payload" * 99
    d = digest(value)
    full.store.put(d, value)
    assert bytes(fetch([free_addr(), empty.address, full.address], KEY, d)) == value
    store = BlobStore()
    got = fetch([empty.address, full.address], KEY, d, store=store)
    assert bytes(got) == value and store.has(d)
    with pytest.raises(BlobError, match="not found") as e:
        fetch([empty.address, free_addr()], KEY, "0" * 64)
    assert "cannot connect" in str(e.value)


def test_wrong_key_is_refused_and_logged_without_the_key(servers, caplog):
    (srv,) = servers(1)
    wrong = b"not-the-key-0123456789"
    caplog.set_level(logging.INFO, logger="gpuhub.replication.blobserver")
    with pytest.raises(BlobError, match=r"refused|authenticat"):
        push(srv.address, wrong, {digest(b"v"): b"v"})
    with pytest.raises(BlobError, match="not available"):
        fetch([srv.address], wrong, digest(b"v"))
    assert len(srv.store) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("authentication failed" in r.getMessage() for r in warnings)
    assert not any(k in r.getMessage() for r in caplog.records for k in (repr(KEY), repr(wrong)))
    # the server itself must prove the key too
    (impostor,) = servers(1, key=b"impostor-key")
    with pytest.raises(BlobError, match=r"refused|authenticat"):
        push(impostor.address, KEY, {digest(b"v"): b"v"})
    assert len(impostor.store) == 0
    push(srv.address, KEY, {digest(b"v"): b"v"})  # and it still serves the right key
    assert srv.store.has(digest(b"v"))


def test_a_liveness_probe_leaves_no_line_in_the_log(servers, caplog):
    """Followers check that a cell's executor still answers by connecting to its blob server twice
    a second (gpuhub/kernel/replica.py, reachable): a long cell must not fill the executor's journal."""
    (srv,) = servers(1)
    caplog.set_level(logging.DEBUG, logger="gpuhub.replication.blobserver")
    for _ in range(3):
        assert reachable(srv.address)
    wait_for(lambda: caplog.text.count("closed before the handshake") == 3, 10, "the probes handled")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_a_connection_held_open_without_a_handshake_is_logged(servers, caplog):
    (srv,) = servers(1, handshake_timeout=0.2)
    caplog.set_level(logging.INFO, logger="gpuhub.replication.blobserver")
    host, port = srv.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        while s.recv(4096):  # the server's greeting, then its close once the handshake timed out
            pass
    wait_for(lambda: any(r.levelno == logging.INFO and "ended" in r.getMessage() for r in caplog.records),
             10, "the timed-out handshake logged")


def test_corrupt_data_is_rejected(servers, caplog):
    (srv,) = servers(1)
    with pytest.raises(BlobError, match="digest mismatch"):
        push(srv.address, KEY, {digest(b"good"): b"evil"})
    assert len(srv.store) == 0
    assert any("digest mismatch" in r.getMessage() for r in caplog.records)
    # a peer that serves wrong bytes for a digest is skipped by fetch
    (liar,) = servers(1)
    liar.store.put(digest(b"good"), b"evil")
    srv.store.put(digest(b"good"), b"good")
    assert bytes(fetch([liar.address, srv.address], KEY, digest(b"good"))) == b"good"
    with pytest.raises(BlobError, match="does not match"):
        fetch([liar.address], KEY, digest(b"good"))


def raw_request(addr: str, payload: bytes) -> bytes:
    """Authenticate, send ``payload`` as one record, and return the server's answer (one record)."""
    chan = blobclient._connect(addr, KEY, 5)
    try:
        chan.send(payload)
        return chan.recv(blobwire.REP.size + blobwire.MAX_MSG)
    finally:
        chan.close()


def test_malformed_and_oversize_requests_are_refused_and_the_server_goes_on(servers):
    (srv,) = servers(1, max_blob=1000)
    d = digest(b"v")
    cases = {
        "bad digest": struct.pack("!c64sQ", b"P", b"Z" * 64, 1),
        "unknown op": struct.pack("!c64sQ", b"X", d.encode(), 0),
        "GET with a length": struct.pack("!c64sQ", b"G", d.encode(), 5),
        "over the limit": struct.pack("!c64sQ", b"P", d.encode(), 1 << 62),
        "truncated": b"P" + d.encode()[:10],
    }
    for what, payload in cases.items():
        answer = raw_request(srv.address, payload)
        status, length = struct.unpack("!cQ", answer[:9])
        assert status == b"E", what
        assert what.split()[0] in answer[9:9 + length].decode(), answer
    with pytest.raises(BlobError, match="over the limit"):
        push(srv.address, KEY, {digest(b"y" * 2000): b"y" * 2000})
    # garbage instead of a handshake
    host, port = srv.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        # The hello first: a server that closes with the garbage unread resets the connection, and
        # a reset may drop a hello not yet read.
        assert blobwire.recv_exact(s, len(blobwire.MAGIC) + blobwire.NONCE).startswith(blobwire.MAGIC)
        try:
            s.sendall(b"\xff" * 10_000)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100) == b""  # closed, nothing said
        except OSError:
            pass  # or reset, the garbage unread: the same refusal
    assert len(srv.store) == 0
    push(srv.address, KEY, {d: b"v"})  # the next good request works
    assert bytes(fetch([srv.address], KEY, d)) == b"v"
    with pytest.raises(ValueError):
        push(srv.address, KEY, {"not-a-digest": b"v"})


class Relay:
    """A TCP relay between a blob client and server that keeps what passes each way and may change
    one byte of it: what an eavesdropper or an attacker on the path sees and does. What it keeps,
    and so the offset of the byte it changes, counts from the first connection through it.

    While it stands, ``target`` is named at the relay's address (as behind a port forward: that is
    the address its peers dial, which the handshake binds); ``close`` gives it its own name back.
    With ``name_it=False`` it keeps its name: the relay redirects to a server that was not meant."""

    def __init__(self, target: BlobServer, flip: tuple[str, int] | None = None, *, name_it: bool = True) -> None:
        self.server, self.flip = target, flip  # flip: (direction, offset after the handshake)
        self.target = target.address
        self.handshake = {"up": blobwire.NONCE + blobwire.MAC,
                          "down": len(blobwire.MAGIC) + blobwire.NONCE + blobwire.MAC}
        self.seen = {"up": bytearray(), "down": bytearray()}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.own_name = target.name
        if name_it:
            target.name = self.address
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(65536):
                data = bytearray(data)
                seen = self.seen[direction]
                if self.flip and self.flip[0] == direction:
                    at = self.handshake[direction] + self.flip[1] - len(seen)
                    if 0 <= at < len(data):
                        data[at] ^= 0x01
                seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.listener.close()
        self.server.name = self.own_name


def test_values_and_requests_cross_the_network_encrypted(servers):
    (srv,) = servers(1)
    relay = Relay(srv)
    try:
        secret = b"my-password-is-hunter2;" * 100_000  # 2.3 MB: several records
        d = digest(secret)
        push(relay.address, KEY, {d: secret})
        assert bytes(fetch([relay.address], KEY, d)) == secret
        for direction, seen in relay.seen.items():
            assert len(seen) > len(secret), direction  # the value went up, then came down
            assert b"hunter2" not in seen and d.encode() not in seen, direction
    finally:
        relay.close()


@pytest.mark.parametrize("verify", [True, False], ids=["rehash", "no-rehash"])
@pytest.mark.parametrize("where", [0, 10, 5000, 1_500_000], ids=["length", "request", "body", "second-record"])
def test_a_byte_changed_on_the_way_is_refused_and_nothing_is_stored(servers, caplog, where, verify):
    (srv,) = servers(1, verify=verify)
    relay = Relay(srv, flip=("up", where))
    value = bytes(range(256)) * 8192  # 2 MiB: two records
    d = digest(value)
    try:
        with pytest.raises(BlobError):
            push(relay.address, KEY, {d: value})
    finally:
        relay.close()
    assert not srv.store.has(d) and len(srv.store) == 0
    # the tag fails (or, for a changed length, the record is longer than the request may be)
    wait_for(lambda: re.search(r"closed: a record (failed its authentication tag|of \d+ bytes where)", caplog.text),
             10, "the server's warning")
    push(srv.address, KEY, {d: value})  # and it goes on serving
    assert bytes(srv.store.get(d)) == value


def test_a_byte_changed_on_the_way_back_fails_the_fetch(servers):
    (srv,) = servers(1)
    value = bytes(range(256)) * 8192
    d = digest(value)
    srv.store.put(d, value)
    store = BlobStore()
    relay = Relay(srv, flip=("down", 100_000))  # in the value's first record
    try:
        with pytest.raises(BlobError, match="fetch failed: a record failed its authentication tag"):
            fetch([relay.address], KEY, d, store=store)
    finally:
        relay.close()
    assert not store.has(d) and len(store) == 0


def fed_channel(ns: bytes, nc: bytes, *, client: bool,
                server: str = "10.0.0.2:7000") -> tuple[blobwire.Channel, socket.socket]:
    """A channel as one end of the connection with nonces ``ns``, ``nc`` to ``server`` sees it, and
    the socket whose bytes it receives (what an attacker on the path would write)."""
    ours, theirs = socket.socketpair()
    return blobwire.Channel(ours, KEY, ns, nc, server, client=client), theirs


def raw_record(sock: socket.socket) -> bytes:
    header = blobwire.recv_exact(sock, blobwire.LENGTH.size)
    return header + blobwire.recv_exact(sock, blobwire.LENGTH.unpack(header)[0] + blobwire.TAG)


def test_records_are_bound_to_their_direction_order_and_connection():
    ns, nc = os.urandom(blobwire.NONCE), os.urandom(blobwire.NONCE)
    sender, wire_end = fed_channel(ns, nc, client=True)
    try:
        sender.send(b"same words")
        sender.send(b"same words")
        first, second = raw_record(wire_end), raw_record(wire_end)
    finally:
        sender.close()
        wire_end.close()
    assert first != second and b"same words" not in first + second  # the record number is the nonce

    def opens(feed: bytes, ns: bytes = ns, nc: bytes = nc, client: bool = False,
              server: str = "10.0.0.2:7000") -> list:
        """What a receiver opens of ``feed``, up to the first record it refuses ("refused")."""
        chan, feeder = fed_channel(ns, nc, client=client, server=server)
        try:
            feeder.sendall(feed)
            feeder.shutdown(socket.SHUT_WR)
            got = []
            while True:
                try:
                    record = chan.recv(100, eof_ok=True)
                except blobwire.Tampered:
                    return [*got, "refused"]
                if record is None:
                    return got
                got.append(record)
        finally:
            chan.close()
            feeder.close()

    assert opens(first + second) == [b"same words", b"same words"]  # as sent
    assert opens(second + first) == ["refused"]  # reordered
    assert opens(first + first) == [b"same words", "refused"]  # replayed
    assert opens(first, client=True) == ["refused"]  # reflected back to its sender
    assert opens(first, ns=os.urandom(blobwire.NONCE)) == ["refused"]  # into another connection
    assert opens(first, server="10.0.0.3:7000") == ["refused"]  # to another server, same nonces


def test_a_push_redirected_to_another_replica_of_the_kernel_is_refused(servers, caplog):
    """The replicas of a kernel share its key: an attacker on the path who sends a connection meant
    for one of them to another must not make the sender count a copy that is not where it thinks."""
    meant, other = servers(2)
    redirect = Relay(other, name_it=False)  # the address the sender dials leads to `other`
    meant.name = redirect.address  # ...but names `meant`
    caplog.set_level(logging.WARNING, logger="gpuhub.replication.blobserver")
    d = digest(b"v")
    try:
        with pytest.raises(BlobError, match="authentication refused"):
            push(redirect.address, KEY, {d: b"v"})
        other.store.put(d, b"v")
        with pytest.raises(BlobError, match="not available"):
            fetch([redirect.address], KEY, d)
    finally:
        redirect.close()
    assert not meant.store.has(d) and len(other.store) == 1
    assert re.search(rf"meant for a server other than {re.escape(other.name)}", caplog.text)
    push(other.address, KEY, {digest(b"w"): b"w"})  # each still answers for its own name
    meant.name = meant.address
    push(meant.address, KEY, {d: b"v"})
    assert meant.store.has(d)


def test_a_peer_of_the_earlier_protocol_is_named():
    listener = socket.create_server(("127.0.0.1", 0))

    def old_server() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"GPHB\x01" + b"n" * blobwire.NONCE)  # version 1's hello
            conn.recv(100)

    threading.Thread(target=old_server, daemon=True).start()
    try:
        with pytest.raises(BlobError, match=r"protocol version 1.*must be restarted"):
            push(f"127.0.0.1:{listener.getsockname()[1]}", KEY, {digest(b"v"): b"v"})
    finally:
        listener.close()


def test_a_64_mib_value_round_trips(servers):
    (srv,) = servers(1)
    words = np.random.default_rng(1).integers(0, 2**63, (8 << 20) + 16, dtype=np.uint64)
    value = words.view(np.uint8)[:(64 << 20) + 123]  # several leaves: the pipelined hash path
    d = digest(value)
    push(srv.address, KEY, {d: value})
    assert srv.store.nbytes == value.nbytes
    got = fetch([srv.address], KEY, d)  # verified against d on the way in
    assert np.array_equal(np.frombuffer(got, dtype=np.uint8), value)


def test_a_server_reuses_the_buffer_of_a_dropped_value(servers):
    (srv,) = servers(1)
    srv.store.spare_bytes = 64 << 20
    old, new = b"o" * (3 << 20), b"n" * (3 << 20)  # the new value lands in the old one's memory
    push(srv.address, KEY, {digest(old): old})
    srv.store.retain(set())
    assert srv.store.spare_nbytes == len(old)
    push(srv.address, KEY, {digest(new): new})
    assert srv.store.spare_nbytes == 0 and bytes(srv.store.get(digest(new))) == new


def test_stop_returns_with_an_idle_connection_open(servers):
    (srv,) = servers(1)
    chan = blobclient._connect(srv.address, KEY, 5)
    try:
        srv.stop()
        assert chan.sock.recv(1) == b""
    finally:
        chan.close()


# --- large blobs into file-backed stores (a follower's; the store alone: tests/unit/test_blobstore.py)
def test_push_and_fetch_of_a_large_blob_verify_and_corruption_is_refused():
    stores = [BlobStore(file_backed=True) for _ in range(2)]
    servers = [BlobServer(s, KEY, "127.0.0.1", 0).start() for s in stores]
    try:
        blob = np.arange(3 * MIB, dtype=np.uint8).tobytes()  # received into a memfd (FILE_MIN)
        d = digest(blob)
        bad = bytearray(blob)
        bad[2 * MIB + 5] ^= 0xFF  # one byte in the middle
        with pytest.raises(BlobError, match="digest mismatch"):
            push(servers[1].address, KEY, {d: bad})
        assert not stores[1].has(d)

        push(servers[0].address, KEY, {d: blob})
        assert stores[0].has(d)
        got = fetch([servers[0].address], KEY, d, store=stores[1])
        assert bytes(got) == blob
        mapped = stores[1].map_private(d, 0, len(blob))  # the received file, mapped copy-on-write
        assert mapped is not None and bytes(mapped) == blob
        mapped[0] ^= 1
        assert digest(stores[1].get(d)) == d
    finally:
        for s in servers:
            s.stop()


def test_a_corrupted_stored_large_blob_is_refused_by_fetch():
    store = BlobStore()
    server = BlobServer(store, KEY, "127.0.0.1", 0).start()
    try:
        blob = bytearray(np.arange(MIB, dtype=np.uint8).tobytes())
        d = digest(blob)
        blob[-1] ^= 1  # the stored bytes differ from the digest they are stored under
        store.put(d, blob)
        with pytest.raises(BlobError, match="does not match"):
            fetch([server.address], KEY, d)
    finally:
        server.stop()


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if start <= addr < end:
                return True
    return False


@pytest.mark.parametrize("anonymous", [True, False])
def test_a_store_kept_from_forks_is_not_in_a_forked_child(anonymous):
    """A CPU kernel's store (keep_from_forks) is not inherited by a fork (the page tracker's
    sentinel, user code's multiprocessing): writes into its buffers pay no copy-on-write fault and
    a fork copies none of its page tables. Small buffers (in malloc's heap) are left alone."""
    store = BlobStore(file_backed=True, keep_from_forks=True)
    big = store.alloc(64 * MIB, anonymous=anonymous)
    small = store.alloc(1000, anonymous=anonymous)
    middle = lambda b: ctypes.addressof((ctypes.c_char * 1).from_buffer(b)) + len(b) // 2  # noqa: E731
    addrs = [middle(big), middle(small)]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, bytes(_mapped(a) for a in addrs))
        finally:
            os._exit(0)
    os.close(w)
    seen = os.read(r, 2)
    os.close(r)
    os.waitpid(pid, 0)
    assert seen == bytes([False, True]) and all(_mapped(a) for a in addrs)
    memoryview(big)[:5] = b"still"  # and the parent uses it as before
    assert bytes(memoryview(big)[:5]) == b"still"
