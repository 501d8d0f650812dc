"""The blob client: the executing replica sends new values to its peers (:func:`push`,
:func:`push_all`); a replica that lacks a value asks its peers for it (:func:`fetch`). Protocol:
:mod:`gpuhub.replication.blobwire`.

**Connections kept between calls.** Opening a connection costs a TCP connect, a thread on the
server and the handshake's three messages: 3 ms of a push of 100 KB to two peers on the dev VM,
whatever its size, paid by every cell whose image has a new value or a stream over the inline
limit. So a connection that ended its call cleanly is kept for the next call to that server with
that key: one each, for :data:`KEEP_S` (well under the server's idle timeout), without its record
buffers, holding a thread of the server's. Before a kept connection is used it is checked (the
server must have said nothing since, nor closed it); one the server ended all the same just before
the call, which fails before any reply of that call came, is replaced by a new one and the call
made on it (nothing of the call had reached the server). A timeout is never retried: a peer that
is slow or hung costs a call its timeout once. A process forked from this one never uses them:
their record numbers are this process's, and a number sent twice under one key would break the
encryption (the at-fork hook drops them in the child; a child forked without it is refused by
:meth:`~gpuhub.replication.blobwire.Channel.send`).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from gpuhub.replication import blobwire as wire
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import byte_view, check_digest

__all__ = ["BlobError", "fetch", "push", "push_all"]

LOG = logging.getLogger(__name__)


class BlobError(RuntimeError):
    """A push or fetch failed (peer down, refused, authentication, protocol or digest error)."""


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise BlobError(f"bad peer address {addr!r} (want host:port)")
    return host.strip("[]"), int(port)


def _connect(addr: str, key: bytes, timeout: float) -> wire.Channel:
    """Connect to a blob server and authenticate both ways; the encrypted channel to it."""
    host, port = _split_addr(addr)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise BlobError(f"{addr}: cannot connect: {e}") from None
    try:
        wire.tune(sock)
        hello = wire.recv_exact(sock, len(wire.MAGIC) + wire.NONCE)
        if hello[:len(wire.MAGIC)] != wire.MAGIC:
            if hello[:len(wire.MAGIC) - 1] == wire.MAGIC[:-1]:
                raise BlobError(f"{addr}: the peer speaks blob protocol version {hello[len(wire.MAGIC) - 1]}, "
                                f"this replica {wire.MAGIC[-1]}: a kernel started before an upgrade that "
                                "changed it must be restarted (docs/install.md, Upgrading)")
            raise BlobError(f"{addr}: not a gpuhub blob server")
        ns, nc = hello[len(wire.MAGIC):], secrets.token_bytes(wire.NONCE)
        sock.sendall(nc + wire.client_mac(key, ns, nc, addr))  # bound to the server meant
        try:
            answer = wire.recv_exact(sock, wire.MAC)
        except (wire.Closed, ConnectionError):
            raise BlobError(f"{addr}: authentication refused by the peer (wrong key, or another "
                            "server answers at that address)") from None
        if not hmac.compare_digest(answer, wire.server_mac(key, ns, nc, addr)):
            raise BlobError(f"{addr}: the peer failed to authenticate (wrong key?)")
        return wire.Channel(sock, key, ns, nc, addr, client=True)
    except BaseException as e:
        sock.close()
        if isinstance(e, (wire.Closed, OSError)):
            raise BlobError(f"{addr}: handshake failed: {e}") from None
        raise


KEEP_S = 20.0
"""How long a connection is kept unused for the next call (blob servers close theirs after 60 s)."""


class _Kept:
    """The connections kept between calls: at most one idle per (server, key), in the process that
    made them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, bytes], tuple[wire.Channel, float]] = {}
        self._pid = os.getpid()

    def take(self, addr: str, key: bytes) -> wire.Channel | None:
        """The kept connection to ``addr`` for ``key`` if it is still open, else None."""
        if os.getpid() != self._pid:  # forked without the at-fork hook (a raw fork): none is ours
            self._after_fork()
            return None
        with self._lock:
            kept = self._idle.pop((addr, key), None)
        if kept is None:
            return None
        chan, since = kept
        if time.monotonic() - since < KEEP_S and _still_open(chan.sock):
            return chan
        chan.close()
        return None

    def give(self, addr: str, key: bytes, chan: wire.Channel) -> None:
        if os.getpid() != self._pid:
            chan.close_copy()
            return
        chan.shed_buffers()
        now = time.monotonic()
        with self._lock:
            old = [c for k, (c, since) in self._idle.items() if k == (addr, key) or now - since >= KEEP_S]
            self._idle = {k: v for k, v in self._idle.items() if v[0] not in old}
            self._idle[(addr, key)] = (chan, now)
        for c in old:
            c.close()

    def forget(self) -> None:
        """Close every kept connection."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for chan, _ in idle.values():
            chan.close()

    def _after_fork(self) -> None:
        # in a forked child: the lock may have been held by a thread the child does not have
        self._lock = threading.Lock()
        self._pid = os.getpid()
        idle, self._idle = self._idle, {}
        for chan, _ in idle.values():
            chan.close_copy()  # the child's copy of the descriptor: the parent's connection stays

    def __len__(self) -> int:
        return len(self._idle)


_kept = _Kept()
os.register_at_fork(after_in_child=_kept._after_fork)


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection is still up: nothing to read (the server says nothing between
    calls: no end, no reset, no stray byte), asked without waiting."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # a socket with a timeout would wait for something to read first
    try:
        sock.recv(1, socket.MSG_PEEK)  # b"": the server closed it; anything else is out of turn
        return False
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(timeout)


def _call(addr: str, key: bytes, timeout: float, work: Callable[[wire.Channel], object]):
    """``work(channel)`` on the kept connection to ``addr``, else on a new one, kept afterwards if
    the call ended cleanly. A kept connection the server ended just before the call (it fails
    before any reply of this call came) is replaced by a new one and ``work`` made on it: nothing
    of the call reached the server. Any other failure (a timeout: a peer that is slow or hung, a
    record that fails its tag) is the call's."""
    chan = _kept.take(addr, key)
    if chan is not None:
        replies = chan.received
        try:
            chan.sock.settimeout(timeout)
            result = work(chan)
        except (wire.Closed, ConnectionResetError, BrokenPipeError) as exc:
            chan.close()
            if chan.received != replies:
                raise
            LOG.debug("blob client: the kept connection to %s had ended (%s): a new one", addr, exc)
        except BaseException:
            chan.close()
            raise
        else:
            _kept.give(addr, key, chan)
            return result
    chan = _connect(addr, key, timeout)
    try:
        result = work(chan)
    except BaseException:
        chan.close()
        raise
    _kept.give(addr, key, chan)
    return result


def _read_reply(chan: wire.Channel, addr: str) -> tuple[bytes, int]:
    record = chan.recv(wire.REP.size + wire.MAX_MSG)
    assert record is not None
    if len(record) < wire.REP.size:
        raise BlobError(f"{addr}: a reply of {len(record)} bytes")
    status, length = wire.REP.unpack(record[:wire.REP.size])
    if status == b"E":
        raise BlobError(f"{addr}: {record[wire.REP.size:].decode('utf-8', 'replace')}")
    return status, length



def push(addr: str, key: bytes, items: dict[str, bytes | bytearray | memoryview],
         timeout: float = 30) -> None:
    """Send every ``digest -> value`` of ``items`` to the peer at ``host:port``; values it already
    has are skipped. Raises :class:`BlobError` on any failure (some items may have been stored)."""
    for d in items:
        check_digest(d)

    def put_all(chan: wire.Channel) -> None:
        for d, data in items.items():
            mv = byte_view(data)
            chan.send(wire.REQ.pack(b"P", d.encode("ascii"), mv.nbytes))
            status, _ = _read_reply(chan, addr)
            if status == b"O":
                continue
            if status != b"C":
                raise BlobError(f"{addr}: unexpected reply {status!r} to PUT")
            wire.send_body(chan, mv)
            status, _ = _read_reply(chan, addr)
            if status != b"O":
                raise BlobError(f"{addr}: unexpected reply {status!r} after PUT body")

    try:
        _call(addr, key, timeout, put_all)
    except (wire.Closed, wire.Tampered, OSError) as e:
        raise BlobError(f"{addr}: push failed: {e}") from None


def push_all(addrs: list[str], key: bytes, items: dict[str, bytes | bytearray | memoryview],
             timeout: float = 30, *, enough: int | None = None,
             on_late: Callable[[str, str | None], None] | None = None) -> dict[str, str | None]:
    """:func:`push` to every peer at once (a thread each). Returns ``addr -> error text or None``
    once ``enough`` peers have every item (default: all of them) or every push has ended; the
    pushes still under way then go on, and ``on_late(addr, error or None)`` gets their end.
    The items must not change until every push has ended."""
    results: dict[str, str | None] = {}
    done = threading.Condition()
    returned = False

    def one(addr: str) -> None:
        nonlocal returned
        try:
            push(addr, key, items, timeout)
            err = None
        except Exception as e:
            err = str(e) if isinstance(e, BlobError) else f"{addr}: {e!r}"
        with done:
            results[addr] = err
            late = returned
            done.notify_all()
        if late and on_late is not None:
            on_late(addr, err)

    need = len(addrs) if enough is None else min(enough, len(addrs))
    for a in addrs:
        threading.Thread(target=one, args=(a,), name=f"blob-push-{a}", daemon=True).start()
    with done:
        done.wait_for(lambda: len(results) == len(addrs)
                      or sum(err is None for err in results.values()) >= need)
        returned = True
        return dict(results)


def _fetch_one(addr: str, key: bytes, d: str, timeout: float, max_blob: int,
               store: BlobStore | None) -> bytearray | memoryview | None:
    try:
        return _call(addr, key, timeout, lambda chan: _get(chan, addr, d, max_blob, store))
    except (wire.Closed, wire.Tampered, OSError) as e:
        raise BlobError(f"{addr}: fetch failed: {e}") from None


def _get(chan: wire.Channel, addr: str, d: str, max_blob: int,
         store: BlobStore | None) -> bytearray | memoryview | None:
    chan.send(wire.REQ.pack(b"G", d.encode("ascii"), 0))
    status, length = _read_reply(chan, addr)
    if status == b"N":
        return None
    if status != b"O":
        raise BlobError(f"{addr}: unexpected reply {status!r} to GET")
    if length > max_blob:
        raise BlobError(f"{addr}: value of {length} bytes is over the limit")
    try:
        buf = store.alloc(length) if store is not None else bytearray(length)
    except MemoryError:
        raise BlobError(f"{addr}: no memory for a value of {length} bytes") from None
    view = memoryview(buf)[:length]
    got = wire.recv_body(chan, view, verify=True)
    del view
    if got != d:
        if store is not None:
            store.recycle(buf)
        raise BlobError(f"{addr}: sent data whose digest does not match {d}")
    if store is None:
        return buf
    store.adopt(d, buf, length)
    del buf
    return store.get(d)


def fetch(addrs: list[str], key: bytes, d: str, timeout: float = 30, *,
          max_blob: int = wire.MAX_BLOB, store: BlobStore | None = None) -> bytearray | memoryview:
    """The value with digest ``d`` from the first peer (in ``addrs`` order) that has it, verified.

    Without ``store``: a new bytearray the caller owns. With ``store``: the value is received
    into a buffer from ``store.alloc`` (a spare when one fits), kept in the store, and returned
    as the store's read-only view. Raises :class:`BlobError` listing what each peer answered
    when none could provide it."""
    check_digest(d)
    errors = []
    for addr in addrs:
        try:
            data = _fetch_one(addr, key, d, timeout, max_blob, store)
        except BlobError as e:
            errors.append(str(e))
            continue
        if data is not None:
            return data
        errors.append(f"{addr}: not found")
    raise BlobError(f"blob {d} not available: " + ("; ".join(errors) or "no peers"))
