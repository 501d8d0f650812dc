"""Large values travel beside the Raft log (DESIGN D4).

After a cell, the executing replica holds the pickled new values of the variables the cell changed.
Small ones go through the Raft log inline; large ones are content-addressed: only :func:`digest`
goes into the log, and the bytes move replica-to-replica over TCP with this module:

- :class:`BlobStore`: the replica's in-memory, thread-safe ``digest -> bytes-like`` map;
- :class:`BlobServer`: background threads in the replica process that answer ``GET`` and ``PUT``;
- :func:`push` / :func:`push_all`: the executing replica sends new values to one / every peer;
- :func:`fetch`: a replica that lacks a value asks its peers for it, in order.

**Digest.** ``digest`` is a SHA-256 tree hash: the value is cut into fixed 16 MiB chunks
(:data:`CHUNK`), each chunk is hashed with SHA-256, and the root is
``SHA-256(TAG || len(value) as u64 || leaf_0 || leaf_1 || …)``, written as 64 lowercase hex
digits. The chunking depends only on the length, never on thread timing, so the digest is
deterministic; the leaves are hashed in a thread pool (hashlib releases the GIL for big buffers).
Measured on the 2-core AMD EPYC (SHA-NI, OpenSSL 3.0) dev VM, 1 GiB, machine otherwise idle:
sha256 1.56 GB/s, sha1 1.68, blake2b 0.81, sha512 0.75, sha3_256 0.30 single-threaded; 64 MiB
leaves over 2 threads: sha256 3.0 GB/s, blake2b 1.5, sha1 3.3 (rejected: not collision resistant).
16 MiB leaves (rather than 64) let values of 32-64 MiB hash in parallel too and shorten the
receive/hash pipeline's tail; a leaf costs one pool task, nothing measurable. The tag fixes the
chunk size: changing :data:`CHUNK` changes every digest.

**Wire protocol** (one TCP connection per ``push``/``fetch`` call; all integers big-endian):

1. server → client: ``MAGIC`` (5 bytes) + server nonce (32 random bytes);
2. client → server: client nonce (32) + ``HMAC-SHA256(key, "gpuhub-blob client" || ns || nc)``;
   a wrong answer: the server logs a WARNING (peer address only, never the key) and closes;
3. server → client: ``HMAC-SHA256(key, "gpuhub-blob server" || nc || ns)``: the client checks it,
   so a replica never sends values to, nor accepts values from, a server without the key;
4. requests, each a 73-byte header ``op (1) | digest (64 hex ascii) | length (u64)``:
   ``G`` (length 0) → ``O`` + length + bytes, or ``N`` (not found);
   ``P`` (length = size of the value) → ``O`` (already stored: the body is not sent) or ``C``
   (continue); after ``C`` the client sends the body and the server answers ``O`` (verified and
   stored) or ``E`` + message (digest mismatch: nothing stored). Replies are ``status (1) |
   length (u64)`` + payload; ``E`` carries a UTF-8 message. A malformed header or a length over
   ``max_blob`` (64 GiB by default) is answered with ``E`` and the connection is closed; the server
   itself goes on serving.

**Verification on receipt.** Both the server (on ``PUT``) and :func:`fetch` re-hash what they
received before storing or returning it, and we keep that on by default even though the
connection is authenticated: the handshake authenticates the *start* of the connection only (the
stream itself carries no MAC and no encryption), so a faulty sender, a corrupting middlebox or a
TCP injection after the handshake would otherwise go unnoticed and a wrong value would be bound to
a digest that Raft committed (an on-path attacker can even relay a genuine handshake and then
write into the stream). Each 16 MiB chunk is hashed in the pool while the next one is still
arriving, so on separate hosts with idle cores the check mostly overlaps the transfer. It is not
free, though: on the 2-core dev VM (all three replicas on one machine, bench/blob_bench.py) a
1 GiB value pushed to both followers costs 2.3 CPU-seconds with the check and 0.9 without, so at
best ~1.1 s against ~0.45 s of wall time on two idle cores (CPU-seconds / 2; the shared VM was
never idle enough to time it): the 1 GB/s-to-both goal needs ``verify=False`` there. ``BlobServer(verify=False)`` is for measurements and for sites whose links
have their own integrity (WireGuard, IPsec); it trusts any authenticated peer. :func:`fetch`
always verifies. The payload is not encrypted: unlike pysyncobj's messages (encrypted with its
password), values cross the cluster's network in clear, as pickles.

**Copies.** The sender passes ``memoryview`` slices of the caller's buffer to ``sendall``; the
receiver allocates the value's buffer once and ``recv_into`` slices of it; the stored object *is*
that buffer (exposed read-only). Sockets use ``TCP_NODELAY`` and :data:`SOCK_BUF`-sized send and
receive buffers. Fresh memory is the other big cost: faulting in a new 1 GiB buffer took ~0.8 s
on the dev VM (its host takes freed pages back), so ``BlobStore(spare_bytes=…)`` can keep the
buffers of dropped values for the next value of about that size (4.2 → 2.3 CPU-seconds for the
push above).

**Files.** ``BlobStore(file_backed=True)`` (CPU kernels' replicas) receives values of
:data:`FILE_MIN` or more into a memfd, so that a value can be built on the received pages with
private, copy-on-write mappings (:meth:`BlobStore.map_private`, gpuhub/replication/oob.py): the
stored bytes stay as received even when the value is written. Such files are never reused.

Caller contract: values handed to :meth:`BlobStore.put` and :func:`push` must not be mutated
afterwards (the store keeps a reference, not a copy).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Self

__all__ = [
    "CHUNK", "BlobError", "BlobServer", "BlobStore", "digest", "fetch", "fill_and_digest", "push",
    "push_all",
]

CHUNK = 16 << 20
"""Leaf size of the tree hash and unit of the receive/hash pipeline (part of the digest format)."""
TAG = b"gpuhub-blob/1 sha256-tree 16MiB\0"
MAX_BLOB = 64 << 30
"""Default cap on one value's length, in bytes (a header over it is refused)."""
FILE_MIN = 1 << 20
"""``BlobStore(file_backed=True)`` receives values of at least this size into a memfd."""
SOCK_BUF = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for (Linux caps it at net.core.[rw]mem_max and doubles it)."""

MAGIC = b"GPHB\x01"
NONCE = 32
MAC = 32
_CLIENT_LABEL = b"gpuhub-blob client"
_SERVER_LABEL = b"gpuhub-blob server"
_REQ = struct.Struct("!c64sQ")
_REP = struct.Struct("!cQ")
_MAX_MSG = 4096
_HEX64 = re.compile(rb"[0-9a-f]{64}")

LOG = logging.getLogger(__name__)


class BlobError(RuntimeError):
    """A push or fetch failed (peer down, refused, authentication, protocol or digest error)."""


# --- digest --------------------------------------------------------------------------------------
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                workers = max(1, min(os.cpu_count() or 1, 8))
                _pool = ThreadPoolExecutor(workers, thread_name_prefix="blob-hash")
    return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _leaf(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def _root(n: int, leaves: Iterable[bytes]) -> str:
    h = hashlib.sha256(TAG)
    h.update(n.to_bytes(8, "big"))
    for leaf in leaves:
        h.update(leaf)
    return h.hexdigest()


def _bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def digest(data: bytes | bytearray | memoryview) -> str:
    """The content address of ``data`` (any C-contiguous buffer): 64 lowercase hex digits."""
    mv = _bytes_view(data)
    n = mv.nbytes
    chunks = [mv[i:i + CHUNK] for i in range(0, n, CHUNK)]
    if len(chunks) > 1:
        leaves = list(_hash_pool().map(_leaf, chunks))
    else:
        leaves = [_leaf(c) for c in chunks]
    return _root(n, leaves)


def fill_and_digest(dest: bytearray | memoryview, write: Callable[[int, int], None]) -> str:
    """The digest of ``dest`` while ``write(lo, hi)`` fills it, one :data:`CHUNK` at a time: each
    chunk is hashed in the pool as soon as it is written, so filling and hashing overlap (both
    without the GIL when ``write`` copies with numpy). Same result as ``digest`` afterwards."""
    mv = _bytes_view(dest)
    n = mv.nbytes
    pool = _hash_pool()
    futures: list[Future[bytes]] = []
    try:
        for i in range(0, n, CHUNK):
            write(i, min(i + CHUNK, n))
            futures.append(pool.submit(_leaf, mv[i:i + CHUNK]))
        return _root(n, [f.result() for f in futures])
    finally:
        for f in futures:
            f.cancel()
        wait(futures)


def _check_digest(d: str) -> bytes:
    raw = d.encode("ascii", "replace") if isinstance(d, str) else b""
    if not _HEX64.fullmatch(raw):
        raise ValueError(f"not a blob digest: {d!r:.80}")
    return raw


# --- store ---------------------------------------------------------------------------------------
class _FileBuffer(mmap.mmap):
    """A shared, writable mapping of a memfd of its own; ``fd`` stays open while it lives, so
    that parts of it can be mapped again privately (:meth:`BlobStore.map_private`)."""

    fd: int

    @classmethod
    def create(cls, n: int) -> _FileBuffer:
        fd = os.memfd_create("gpuhub-blob", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, n)
            buf = cls(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        buf.fd = fd
        weakref.finalize(buf, os.close, fd)
        return buf


class BlobStore:
    """Thread-safe in-memory map ``digest -> bytes-like``.

    :meth:`put` keeps a reference to the caller's object (no copy). Values received from peers
    live in buffers the store owns (:meth:`alloc`, :meth:`adopt`); :meth:`get` hands those out as
    read-only memoryviews. With ``spare_bytes`` > 0, :meth:`retain` keeps up to that many bytes of
    dropped owned buffers — only those nothing else references any more — and :meth:`alloc`
    reuses them for the next value of about the same size: a changed 1 GB variable then lands in
    memory that is already mapped, instead of page-faulting a fresh gigabyte (0.2 s/GiB on bare
    metal, about 0.8 s/GiB in a VM that hands freed memory back to its host). The price is that
    much extra resident memory per replica, so it is off by default.

    With ``file_backed``, :meth:`alloc` puts values of at least :data:`FILE_MIN` bytes in a memfd
    (an anonymous in-memory file) mapped shared, and :meth:`map_private` maps a page-aligned part
    of a stored one copy-on-write: the mapping shares the stored pages until someone writes to
    it, then that page becomes private, so the stored bytes never change. Such buffers are never
    kept as spares (a private mapping of a reused file would see the new value's bytes).
    """

    def __init__(self, spare_bytes: int = 0, *, file_backed: bool = False) -> None:
        self.spare_bytes = spare_bytes
        self.file_backed = file_backed
        self._blobs: dict[str, bytes | bytearray | memoryview] = {}
        self._owned: dict[str, int] = {}  # digest -> length, for buffers from alloc()
        self._spares: list[bytearray] = []
        self._nbytes = 0
        self._lock = threading.Lock()

    def put(self, d: str, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` under ``d`` (the caller vouches that ``d == digest(data)`` and will not
        mutate it)."""
        size = memoryview(data).nbytes
        with self._lock:
            if d not in self._blobs:
                self._blobs[d] = data
                self._nbytes += size

    def alloc(self, n: int, *, anonymous: bool = False) -> bytearray | _FileBuffer:
        """A buffer of at least ``n`` bytes to receive a value into, then :meth:`adopt` or
        :meth:`recycle`: a spare when one fits within n + n/4; in a file-backed store, a new memfd
        for a value of :data:`FILE_MIN` or more, unless ``anonymous`` (for a value this process
        writes itself, that it never maps copy-on-write). Raises MemoryError."""
        to_file = self.file_backed and n >= FILE_MIN and not anonymous
        if not to_file:
            with self._lock:
                fits = [b for b in self._spares if n <= len(b) <= n + n // 4]
                if fits:
                    buf = min(fits, key=len)
                    self._spares = [b for b in self._spares if b is not buf]
                    return buf
            return bytearray(n)
        try:
            return _FileBuffer.create(n)
        except OSError as e:
            raise MemoryError(f"no memfd for {n} bytes: {e}") from None

    def adopt(self, d: str, buf: bytearray | _FileBuffer, n: int) -> None:
        """Keep the first ``n`` bytes of ``buf`` (from :meth:`alloc`) under ``d``."""
        with self._lock:
            if d not in self._blobs:
                self._blobs[d], self._owned[d] = buf, n
                self._nbytes += n
                return
        self.recycle(buf)  # someone stored the same value meanwhile

    def recycle(self, buf: bytearray | _FileBuffer) -> None:
        """Give back a buffer from :meth:`alloc` that was not adopted."""
        with self._lock:
            self._spare(buf, 4)  # the caller's variable, ours, _spare's, getrefcount's

    def _spare(self, buf: bytearray, refs: int) -> None:
        # ``refs``: the references the caller's frames hold; more means a view is still alive
        if (type(buf) is bytearray and sys.getrefcount(buf) <= refs
                and sum(map(len, self._spares)) + len(buf) <= self.spare_bytes):
            self._spares.append(buf)

    def get(self, d: str) -> bytes | bytearray | memoryview | None:
        with self._lock:
            data = self._blobs.get(d)
            n = self._owned.get(d)
            if n is None:
                return data
            return memoryview(data)[:n].toreadonly()  # made under the lock: see _spare

    def map_private(self, d: str, offset: int, length: int) -> mmap.mmap | None:
        """A writable copy-on-write mapping of ``length`` bytes at ``offset`` (a multiple of the
        page size) of the stored value ``d``, or None when that value is not file-backed."""
        with self._lock:  # under the lock: retain() may drop the file meanwhile
            buf = self._blobs.get(d)
            if type(buf) is not _FileBuffer or offset + length > self._owned[d]:
                return None
            return mmap.mmap(buf.fd, length, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    def has(self, d: str) -> bool:
        with self._lock:
            return d in self._blobs

    __contains__ = has

    def retain(self, keep: set[str]) -> None:
        """Drop every blob whose digest is not in ``keep``."""
        with self._lock:
            for d in [d for d in self._blobs if d not in keep]:
                data = self._blobs.pop(d)
                n = self._owned.pop(d, None)
                if n is None:
                    self._nbytes -= memoryview(data).nbytes
                else:
                    self._nbytes -= n
                    self._spare(data, 3)  # our variable, _spare's, getrefcount's
                del data

    def digests(self) -> set[str]:
        with self._lock:
            return set(self._blobs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blobs)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored values (spares not counted)."""
        with self._lock:
            return self._nbytes

    @property
    def spare_nbytes(self) -> int:
        with self._lock:
            return sum(map(len, self._spares))


# --- socket helpers ------------------------------------------------------------------------------
class _Closed(Exception):
    """The peer closed the connection."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def _recv_into(sock: socket.socket, mv: memoryview) -> None:
    pos, n = 0, len(mv)
    while pos < n:
        got = sock.recv_into(mv[pos:], n - pos)
        if not got:
            raise _Closed("connection closed by peer")
        pos += got


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _send_body(sock: socket.socket, mv: memoryview) -> None:
    # slice so a socket timeout bounds each 16 MiB step, not the whole value
    for i in range(0, len(mv), CHUNK):
        sock.sendall(mv[i:i + CHUNK])


def _recv_body(sock: socket.socket, mv: memoryview, verify: bool) -> str | None:
    """Fill ``mv`` from ``sock``; with ``verify``, hash each chunk in the pool while the next one
    arrives and return the root digest of what came."""
    n = len(mv)
    parts = [mv[i:i + CHUNK] for i in range(0, n, CHUNK)]
    futures: list[Future[bytes]] = []
    pool = _hash_pool() if verify and len(parts) > 1 else None
    try:
        for part in parts:
            _recv_into(sock, part)
            if pool is not None:
                futures.append(pool.submit(_leaf, part))
        if not verify:
            return None
        if pool is None:
            return _root(n, [_leaf(p) for p in parts])
        return _root(n, [f.result() for f in futures])
    finally:
        for f in futures:
            f.cancel()
        wait(futures)
        for part in parts:  # a pool thread may still hold a part: drop its hold on the buffer
            part.release()


def _client_mac(key: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, _CLIENT_LABEL + ns + nc, hashlib.sha256).digest()


def _server_mac(key: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, _SERVER_LABEL + nc + ns, hashlib.sha256).digest()


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise BlobError(f"bad peer address {addr!r} (want host:port)")
    return host.strip("[]"), int(port)


def _connect(addr: str, key: bytes, timeout: float) -> socket.socket:
    """Connect to a blob server and authenticate both ways."""
    host, port = _split_addr(addr)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise BlobError(f"{addr}: cannot connect: {e}") from None
    try:
        _tune(sock)
        hello = _recv_exact(sock, len(MAGIC) + NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise BlobError(f"{addr}: not a gpuhub blob server")
        ns, nc = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        sock.sendall(nc + _client_mac(key, ns, nc))
        try:
            answer = _recv_exact(sock, MAC)
        except (_Closed, ConnectionError):
            raise BlobError(f"{addr}: authentication refused by the peer (wrong key?)") from None
        if not hmac.compare_digest(answer, _server_mac(key, ns, nc)):
            raise BlobError(f"{addr}: the peer failed to authenticate (wrong key?)")
        return sock
    except BaseException as e:
        sock.close()
        if isinstance(e, (_Closed, OSError)):
            raise BlobError(f"{addr}: handshake failed: {e}") from None
        raise


def _read_reply(sock: socket.socket, addr: str) -> tuple[bytes, int]:
    status, length = _REP.unpack(_recv_exact(sock, _REP.size))
    if status == b"E":
        msg = _recv_exact(sock, min(length, _MAX_MSG)).decode("utf-8", "replace")
        raise BlobError(f"{addr}: {msg}")
    return status, length


# --- server --------------------------------------------------------------------------------------
class _ProtocolError(Exception):
    """A request the server refuses; the connection is closed after the error reply."""


class BlobServer:
    """Serves a :class:`BlobStore` to the replica's peers from background threads.

    ``port=0`` picks a free port; :attr:`address` is ``host:port`` once started. ``max_blob`` caps
    one value's length; ``verify=False`` stores authenticated PUTs without re-hashing them (see the
    module docstring); ``idle_timeout`` bounds how long a silent connection holds its thread
    (``handshake_timeout`` one that has not authenticated yet), and at most ``max_conns``
    connections are served at once (a thread each).
    """

    def __init__(self, store: BlobStore, key: bytes, host: str, port: int,
                 log: logging.Logger | None = None, *, max_blob: int = MAX_BLOB,
                 verify: bool = True, idle_timeout: float = 60.0,
                 handshake_timeout: float = 10.0, max_conns: int = 64) -> None:
        if not key:
            raise ValueError("BlobServer needs a non-empty key")
        self.store, self.host, self.port = store, host, port
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
            _tune(sock)  # accepted sockets inherit the buffer sizes (window scale at SYN time)
            sock.bind((self.host, self.port))
            sock.listen(socket.SOMAXCONN)
            sock.settimeout(0.2)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
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
        try:
            conn.settimeout(self.handshake_timeout)
            _tune(conn)
            if not self._handshake(conn, who):
                return
            conn.settimeout(self.idle_timeout)
            while not self._stopping.is_set():
                try:
                    header = conn.recv(_REQ.size, socket.MSG_WAITALL)
                except TimeoutError:
                    return
                if not header:
                    return  # clean end between requests
                if len(header) < _REQ.size:
                    raise _ProtocolError(f"truncated request header ({len(header)} bytes)")
                self._request(conn, who, header)
        except _ProtocolError as e:
            self.log.warning("blob server %s: refused request from %s: %s", self.address, who, e)
            self._reply(conn, b"E", str(e).encode())
        except (_Closed, OSError) as e:
            if not self._stopping.is_set():
                self.log.info("blob server %s: connection from %s ended: %s", self.address, who, e)
        except Exception:
            self.log.exception("blob server %s: error serving %s", self.address, who)
            self._reply(conn, b"E", b"internal error")
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _handshake(self, conn: socket.socket, who: str) -> bool:
        ns = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + ns)
        answer = _recv_exact(conn, NONCE + MAC)
        nc, mac = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(mac, _client_mac(self._key, ns, nc)):
            self.log.warning("blob server %s: authentication failed for %s (wrong key); "
                             "connection closed", self.address, who)
            return False
        conn.sendall(_server_mac(self._key, ns, nc))
        return True

    def _reply(self, conn: socket.socket, status: bytes, payload: bytes = b"") -> None:
        try:
            conn.sendall(_REP.pack(status, len(payload)) + payload)
        except OSError:
            pass

    def _request(self, conn: socket.socket, who: str, header: bytes) -> None:
        op, raw, length = _REQ.unpack(header)
        if not _HEX64.fullmatch(raw):
            raise _ProtocolError("malformed request: bad digest")
        d = raw.decode("ascii")
        if op == b"G":
            if length:
                raise _ProtocolError("malformed request: GET with a length")
            data = self.store.get(d)
            if data is None:
                self._reply(conn, b"N")
                return
            mv = _bytes_view(data)
            conn.sendall(_REP.pack(b"O", mv.nbytes))
            _send_body(conn, mv)
        elif op == b"P":
            if length > self.max_blob:
                raise _ProtocolError(f"value of {length} bytes is over the limit of "
                                     f"{self.max_blob} bytes")
            if self.store.has(d):
                self._reply(conn, b"O")
                return
            try:
                buf = self.store.alloc(length)  # before "continue": a refusal costs no transfer
            except MemoryError:
                raise _ProtocolError(f"no memory for a value of {length} bytes") from None
            conn.sendall(_REP.pack(b"C", 0))
            view = memoryview(buf)[:length]
            got = _recv_body(conn, view, self.verify)
            del view
            if self.verify and got != d:
                self.store.recycle(buf)
                self.log.warning("blob server %s: PUT from %s: digest mismatch for %s…; "
                                 "not stored", self.address, who, d[:16])
                self._reply(conn, b"E", f"digest mismatch for {d}: not stored".encode())
                return
            self.store.adopt(d, buf, length)
            del buf  # before the reply: the sender may retain() at once (see BlobStore._spare)
            self._reply(conn, b"O")
        else:
            raise _ProtocolError(f"malformed request: unknown op {op!r}")


# --- client --------------------------------------------------------------------------------------
def push(addr: str, key: bytes, items: dict[str, bytes | bytearray | memoryview],
         timeout: float = 30) -> None:
    """Send every ``digest -> value`` of ``items`` to the peer at ``host:port``; values it already
    has are skipped. Raises :class:`BlobError` on any failure (some items may have been stored)."""
    for d in items:
        _check_digest(d)
    sock = _connect(addr, key, timeout)
    try:
        for d, data in items.items():
            mv = _bytes_view(data)
            sock.sendall(_REQ.pack(b"P", d.encode("ascii"), mv.nbytes))
            status, _ = _read_reply(sock, addr)
            if status == b"O":
                continue
            if status != b"C":
                raise BlobError(f"{addr}: unexpected reply {status!r} to PUT")
            _send_body(sock, mv)
            status, _ = _read_reply(sock, addr)
            if status != b"O":
                raise BlobError(f"{addr}: unexpected reply {status!r} after PUT body")
    except (_Closed, OSError) as e:
        raise BlobError(f"{addr}: push failed: {e}") from None
    finally:
        sock.close()


def push_all(addrs: list[str], key: bytes, items: dict[str, bytes | bytearray | memoryview],
             timeout: float = 30) -> dict[str, str | None]:
    """:func:`push` to every peer at once (a thread each); returns ``addr -> error text or None``."""
    results: dict[str, str | None] = {}

    def one(addr: str) -> None:
        try:
            push(addr, key, items, timeout)
            results[addr] = None
        except Exception as e:  # noqa: BLE001 - reported per peer: one failure must not hide others
            results[addr] = str(e) if isinstance(e, BlobError) else f"{addr}: {e!r}"

    threads = [threading.Thread(target=one, args=(a,), name=f"blob-push-{a}", daemon=True)
               for a in addrs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {a: results.get(a, f"{a}: push did not finish") for a in addrs}


def _fetch_one(addr: str, key: bytes, d: str, timeout: float, max_blob: int,
               store: BlobStore | None) -> bytearray | memoryview | None:
    sock = _connect(addr, key, timeout)
    try:
        sock.sendall(_REQ.pack(b"G", d.encode("ascii"), 0))
        status, length = _read_reply(sock, addr)
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
        got = _recv_body(sock, view, verify=True)
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
    except (_Closed, OSError) as e:
        raise BlobError(f"{addr}: fetch failed: {e}") from None
    finally:
        sock.close()


def fetch(addrs: list[str], key: bytes, d: str, timeout: float = 30, *,
          max_blob: int = MAX_BLOB, store: BlobStore | None = None) -> bytearray | memoryview:
    """The value with digest ``d`` from the first peer (in ``addrs`` order) that has it, verified.

    Without ``store``: a new bytearray the caller owns. With ``store``: the value is received
    into a buffer from ``store.alloc`` (a spare when one fits), kept in the store, and returned
    as the store's read-only view. Raises :class:`BlobError` listing what each peer answered
    when none could provide it."""
    _check_digest(d)
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
