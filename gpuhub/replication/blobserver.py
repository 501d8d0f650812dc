"""A replica's blob server: background threads that answer its peers' authenticated, encrypted
``GET`` and ``PUT`` requests (protocol: :mod:`gpuhub.replication.blobwire`) from its
:class:`~gpuhub.replication.blobstore.BlobStore`."""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
from typing import Self

from gpuhub.replication import blobwire as wire
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import DIGEST_ASCII, byte_view

__all__ = ["BlobServer"]

LOG = logging.getLogger(__name__)


class _ProtocolError(Exception):
    """A request the server refuses; the connection is closed after the error reply."""


class BlobServer:
    """Serves a :class:`BlobStore` to the replica's peers from background threads.

    ``port=0`` picks a free port; :attr:`address` is ``host:port`` once started. ``name`` is the
    address its peers dial (the kernel's placement says it; :attr:`address` if not given): the
    handshake binds it, so the server answers only connections meant for it. ``max_blob`` caps
    one value's length; ``verify=False`` stores authenticated PUTs without re-hashing them (see "Verification
    on receipt" in :mod:`gpuhub.replication.blobwire`); ``idle_timeout`` bounds how long a silent
    connection holds its thread (``handshake_timeout`` one that has not authenticated yet), and at most
    ``max_conns`` connections are served at once (a thread each).
    """

    def __init__(self, store: BlobStore, key: bytes, host: str, port: int,
                 log: logging.Logger | None = None, *, name: str | None = None, max_blob: int = wire.MAX_BLOB,
                 verify: bool = True, idle_timeout: float = 60.0,
                 handshake_timeout: float = 10.0, max_conns: int = 64) -> None:
        if not key:
            raise ValueError("BlobServer needs a non-empty key")
        self.store, self.host, self.port, self.name = store, host, port, name
        self._key = bytes(key)
        self.log = log or LOG
        self.max_blob, self.verify = max_blob, verify
        self.idle_timeout, self.handshake_timeout = idle_timeout, handshake_timeout
        self.max_conns = max_conns
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never shows the key
        return f"BlobServer({self.host}:{self.port}, {len(self.store)} blobs)"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> Self:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            wire.tune(sock)  # accepted sockets inherit the buffer sizes (window scale at SYN time)
            sock.bind((self.host, self.port))
            sock.listen(socket.SOMAXCONN)
            sock.settimeout(0.2)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        if self.name is None:
            self.name = self.address
        self._listener = sock
        self._stopping.clear()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"blob-server-{self.port}", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join()
            self._accept_thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> Self:
        return self if self._listener is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if not self._stopping.is_set():
                    self.log.error("blob server %s: accept failed: %s", self.address, e)
                    self._stopping.wait(0.2)
                continue
            with self._lock:
                busy = len(self._conns) >= self.max_conns
            if busy:
                self.log.warning("blob server %s: %d connections open; refusing %s:%s",
                                 self.address, self.max_conns, peer[0], peer[1])
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn, peer),
                                 name=f"blob-conn-{peer[1]}", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        who = f"{peer[0]}:{peer[1]}"
        chan: wire.Channel | None = None
        try:
            conn.settimeout(self.handshake_timeout)
            wire.tune(conn)
            chan = self._handshake(conn, who)
            if chan is None:
                return
            conn.settimeout(self.idle_timeout)
            while not self._stopping.is_set():
                try:
                    header = chan.recv(wire.REQ.size, eof_ok=True)
                except TimeoutError:
                    return
                if header is None:
                    return  # clean end between requests
                if len(header) != wire.REQ.size:
                    raise _ProtocolError(f"truncated request header ({len(header)} bytes)")
                self._request(chan, who, header)
        except _ProtocolError as e:
            self.log.warning("blob server %s: refused request from %s: %s", self.address, who, e)
            self._reply(chan, b"E", str(e).encode())
        except wire.Tampered as e:
            self.log.warning("blob server %s: connection from %s closed: %s", self.address, who, e)
        except (wire.Closed, OSError) as e:
            # Closed before the handshake: a replica's liveness probe (gpuhub/kernel/replica.py,
            # reachable), twice a second per follower while a cell runs here. Not worth a line.
            # (A handshake that timed out, a connection held open, is still logged.)
            probe = chan is None and isinstance(e, wire.Closed | ConnectionResetError | BrokenPipeError)
            if probe:
                self.log.debug("blob server %s: %s closed before the handshake: %s", self.address, who, e)
            elif not self._stopping.is_set():
                self.log.info("blob server %s: connection from %s ended: %s", self.address, who, e)
        except Exception:
            self.log.exception("blob server %s: error serving %s", self.address, who)
            self._reply(chan, b"E", b"internal error")
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _handshake(self, conn: socket.socket, who: str) -> wire.Channel | None:
        ns = secrets.token_bytes(wire.NONCE)
        conn.sendall(wire.MAGIC + ns)
        answer = wire.recv_exact(conn, wire.NONCE + wire.MAC)
        nc, mac = answer[:wire.NONCE], answer[wire.NONCE:]
        assert self.name is not None  # set by start()
        if not hmac.compare_digest(mac, wire.client_mac(self._key, ns, nc, self.name)):
            self.log.warning("blob server %s: authentication failed for %s (wrong key, or meant for "
                             "a server other than %s); connection closed", self.address, who, self.name)
            return None
        conn.sendall(wire.server_mac(self._key, ns, nc, self.name))
        return wire.Channel(conn, self._key, ns, nc, self.name, client=False)

    def _reply(self, chan: wire.Channel | None, status: bytes, payload: bytes = b"") -> None:
        if chan is None or chan.broken:
            return  # not authenticated, or the peer waits for the rest of a value: nothing to say
        payload = payload[:wire.MAX_MSG]
        try:
            chan.send(wire.REP.pack(status, len(payload)) + payload)
        except OSError:
            pass

    def _request(self, chan: wire.Channel, who: str, header: bytes) -> None:
        op, raw, length = wire.REQ.unpack(header)
        if not DIGEST_ASCII.fullmatch(raw):
            raise _ProtocolError("malformed request: bad digest")
        d = raw.decode("ascii")
        if op == b"G":
            if length:
                raise _ProtocolError("malformed request: GET with a length")
            data = self.store.get(d)
            if data is None:
                self._reply(chan, b"N")
                return
            mv = byte_view(data)
            chan.send(wire.REP.pack(b"O", mv.nbytes))
            wire.send_body(chan, mv)
        elif op == b"P":
            if length > self.max_blob:
                raise _ProtocolError(f"value of {length} bytes is over the limit of "
                                     f"{self.max_blob} bytes")
            if self.store.has(d):
                self._reply(chan, b"O")
                return
            try:
                buf = self.store.alloc(length)  # before "continue": a refusal costs no transfer
            except MemoryError:
                raise _ProtocolError(f"no memory for a value of {length} bytes") from None
            self.store.incoming(d)
            try:
                chan.send(wire.REP.pack(b"C", 0))
                view = memoryview(buf)[:length]
                got = wire.recv_body(chan, view, self.verify)
                del view
                if not self.verify or got == d:
                    self.store.adopt(d, buf, length)
            finally:
                self.store.received(d)
            if self.verify and got != d:
                self.store.recycle(buf)
                self.log.warning("blob server %s: PUT from %s: digest mismatch for %s…; "
                                 "not stored", self.address, who, d[:16])
                self._reply(chan, b"E", f"digest mismatch for {d}: not stored".encode())
                return
            del buf  # before the reply: the sender may retain() at once (see BlobStore._spare)
            self._reply(chan, b"O")
        else:
            raise _ProtocolError(f"malformed request: unknown op {op!r}")

