"""The blob client: the executing replica sends new values to its peers (:func:`push`,
:func:`push_all`); a replica that lacks a value asks its peers for it (:func:`fetch`). Protocol:
:mod:`gpuhub.replication.blobwire`."""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
from collections.abc import Callable

from gpuhub.replication import blobwire as wire
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import byte_view, check_digest

__all__ = ["BlobError", "fetch", "push", "push_all"]


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
    chan = _connect(addr, key, timeout)
    try:
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
    except (wire.Closed, wire.Tampered, OSError) as e:
        raise BlobError(f"{addr}: push failed: {e}") from None
    finally:
        chan.close()


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
    chan = _connect(addr, key, timeout)
    try:
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
    except (wire.Closed, wire.Tampered, OSError) as e:
        raise BlobError(f"{addr}: fetch failed: {e}") from None
    finally:
        chan.close()


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
