"""The blob protocol both ends speak (:mod:`~gpuhub.replication.blobserver`,
:mod:`~gpuhub.replication.blobclient`): the handshake, the encrypted records, socket helpers.

Requests follow one another on a connection (the client keeps one per server between calls,
:mod:`~gpuhub.replication.blobclient`); each connection starts with the handshake; all integers big-endian:

1. server → client: ``MAGIC`` (5 bytes) + server nonce ``ns`` (32 random bytes);
2. client → server: client nonce ``nc`` (32) + ``HMAC-SHA256(key, "gpuhub-blob client v2" || S || ns || nc)``;
   a wrong answer: the server logs a WARNING (peer address only, never the key) and closes;
3. server → client: ``HMAC-SHA256(key, "gpuhub-blob server v2" || S || nc || ns)``: the client checks
   it, so a replica never sends values to, nor accepts values from, a server without the key.

``S`` is the server's name, length-prefixed: the ``host:port`` the kernel's placement gives that
replica's blob server, which is what its peers dial. All replicas of a kernel share its key, so
without ``S`` an attacker on the path could send a push meant for one replica to another of the same
kernel (both would answer it), and the sender would count a copy where there is none.

From then on every byte both ways travels in **records** (:class:`Channel`): ``length (u32)`` +
that many bytes of AES-256-GCM ciphertext + its 16-byte tag, at most :data:`RECORD` bytes of
plaintext each. Each direction has its own key, derived with HKDF-SHA256 from the kernel's key and
both nonces (fresh for every connection) and ``S``, and counts its records: the nonce is the record's
number, and the length is the associated data. So a value is unreadable on the network, and a
record that was changed, dropped, replayed, reordered, injected or redirected to another server
fails its tag: the receiver
stores nothing and closes. A peer must pass the handshake before the server buffers anything, and
then at most one record (1 MiB) before that record's tag is checked. Messages, each in a record:

- a request, ``op (1) | digest (64 hex ascii) | length (u64)`` (:data:`REQ`):
  ``G`` (length 0) → ``O`` + length, then the value in records; or ``N`` (not found);
  ``P`` (length = size of the value) → ``O`` (already stored: the body is not sent) or ``C``
  (continue); after ``C`` the client sends the value in records and the server answers ``O``
  (verified and stored) or ``E`` + message (digest mismatch: nothing stored);
- a reply, ``status (1) | length (u64)`` (:data:`REP`), an ``E`` reply followed in the same record
  by its UTF-8 message. A malformed request or a length over ``max_blob`` (:data:`MAX_BLOB` by
  default) is answered with ``E`` and the connection is closed; the server itself goes on serving.

**Verification on receipt.** Both the server (on ``PUT``) and the client's ``fetch`` re-hash what
they received before storing or returning it. The records prove that the bytes are the ones a
holder of the kernel's key sent; the hash proves that they are the value the digest names, which
the records cannot: a sender may name a value by a digest it did not compute from those bytes (a
GPU cell's child reports some digests from its change tracker), or hold a value that rotted in
its memory, and a follower keeps what it stores (it answers later pushes of that digest with
"already stored"). Each 16 MiB chunk is hashed in the pool while the next one is still arriving
(:func:`gpuhub.replication.digest.receive_and_digest`). ``BlobServer(verify=False)`` is for
measurements only.

**Cost of the encryption.** AES-GCM runs at memory-like speed where the CPU has AES and carry-less
multiply instructions (every x86 server since 2010, ARMv8): on the dev VM 6 GB/s per core
(docs/benchmarks.md), faster than the BLAKE3 hash beside it (3.6 GB/s per core).

**What the network still sees:** who talks to whom, when, and how long each record is, so the
size of each value sent (not its bytes, nor its digest).

**Copies.** The sender encrypts each record from ``memoryview`` slices of the caller's buffer into
one reused record buffer; the receiver allocates the value's buffer once, receives each record
into one reused buffer and decrypts it into its place in the value's. The stored object *is* that
buffer (exposed read-only). Sockets use ``TCP_NODELAY`` and :data:`SOCK_BUF`-sized send and
receive buffers.

Protocol version 2 (encrypted records) does not talk to version 1 (values in clear): a kernel that
was running when its servers were upgraded across that change must be restarted before a new
replica of it can join its old ones (docs/install.md, "Upgrading").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gpuhub.replication.digest import CHUNK, receive_and_digest

MAX_BLOB = 64 << 30
"""Default cap on one value's length, in bytes (a header over it is refused)."""
SOCK_BUF = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for (Linux caps it at net.core.[rw]mem_max and doubles it)."""

MAGIC = b"GPHB\x02"
"""Version 2: encrypted records. A version 1 peer's hello differs in its last byte."""
NONCE = 32
MAC = 32
REQ = struct.Struct("!c64sQ")
"""A request header: op, digest (hex ascii), length."""
REP = struct.Struct("!cQ")
"""A reply header: status, length of what follows."""
MAX_MSG = 4096
"""The longest error message a client reads from an ``E`` reply."""
RECORD = 1 << 20
"""The most plaintext bytes in one record: what a peer may make the other buffer before a tag."""
TAG = 16
LENGTH = struct.Struct("!I")
_CLIENT_LABEL = b"gpuhub-blob client v2"
_SERVER_LABEL = b"gpuhub-blob server v2"
_KEYS_INFO = b"gpuhub-blob v2 record keys"
assert CHUNK % RECORD == 0  # a chunk the receiver hashes is made of whole records


class Closed(Exception):
    """The peer closed the connection."""


class Tampered(Exception):
    """A record failed its tag, or is longer than the protocol allows: the connection is closed."""


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def recv_into(sock: socket.socket, mv: memoryview) -> None:
    pos, n = 0, len(mv)
    while pos < n:
        got = sock.recv_into(mv[pos:], n - pos)
        if not got:
            raise Closed("connection closed by peer")
        pos += got


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


class Channel:
    """One connection after its handshake: every message both ways in AES-256-GCM records, each
    direction with its own key and record counter (see the module's docstring)."""

    def __init__(self, sock: socket.socket, key: bytes, ns: bytes, nc: bytes, server: str, *,
                 client: bool) -> None:
        keys = HKDF(algorithm=SHA256(), length=64, salt=ns + nc, info=_KEYS_INFO + _named(server)).derive(key)
        to_server, to_client = AESGCM(keys[:32]), AESGCM(keys[32:])
        self.sock = sock
        self._seal, self._open = (to_server, to_client) if client else (to_client, to_server)
        self._sent = self._received = 0
        self._out: bytearray | None = None  # one record's buffer each way, reused
        self._in: bytearray | None = None
        self.broken = False  # a value was cut off midway: the peer would read any message as its rest
        self._pid = os.getpid()  # a forked child must never send on it (see send)

    def close(self) -> None:
        """End the connection. In the process that made it, the peer is told at once even while a
        forked child holds a copy of the descriptor (a child forked during a call: a GPU cell's)."""
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close_copy(self) -> None:
        """Drop this process's descriptor only (a forked child's copy: the parent's stays up)."""
        self.sock.close()

    @property
    def received(self) -> int:
        """Records received so far (whether a call on a kept connection got any reply)."""
        return self._received

    def shed_buffers(self) -> None:
        """Free the record buffers (a connection kept idle holds none; the next record makes them)."""
        self._out = self._in = None

    @staticmethod
    def _nonce(n: int) -> bytes:
        return n.to_bytes(12, "big")  # the record's number: never the same twice under one key

    def send(self, data: bytes | memoryview) -> None:
        """One record of ``data`` (at most :data:`RECORD` bytes)."""
        if os.getpid() != self._pid:
            # a copy in a forked child: its record numbers are the parent's, and a record number used
            # twice under one key would break AES-GCM
            raise Closed("a connection made by another process (this one was forked from it)")
        n = len(data)
        if n > RECORD:
            raise ValueError(f"a record holds at most {RECORD} bytes, not {n}")
        if self._out is None or len(self._out) < LENGTH.size + n + TAG:
            self._out = bytearray(LENGTH.size + n + TAG)  # grows to the largest record sent
        out = memoryview(self._out)
        header = LENGTH.pack(n)
        out[:LENGTH.size] = header
        self._seal.encrypt_into(self._nonce(self._sent), data, header, out[LENGTH.size:LENGTH.size + n + TAG])
        self._sent += 1
        self.sock.sendall(out[:LENGTH.size + n + TAG])

    def _header(self, eof_ok: bool) -> tuple[bytes, int] | None:
        header = bytearray(LENGTH.size)
        view = memoryview(header)
        got = 0
        while got < LENGTH.size:
            k = self.sock.recv_into(view[got:])
            if not k:
                if got == 0 and eof_ok:
                    return None
                raise Closed("connection closed by peer")
            got += k
        return bytes(header), LENGTH.unpack(header)[0]

    def _open_into(self, header: bytes, n: int, dest: memoryview) -> None:
        if self._in is None or len(self._in) < n + TAG:
            self._in = bytearray(n + TAG)  # grows to the largest record received
        sealed = memoryview(self._in)[:n + TAG]
        recv_into(self.sock, sealed)
        try:
            self._open.decrypt_into(self._nonce(self._received), sealed, header, dest[:n])
        except InvalidTag:
            raise Tampered("a record failed its authentication tag (changed on the way, or not from "
                           "the peer that authenticated)") from None
        self._received += 1

    def recv(self, limit: int, eof_ok: bool = False) -> bytes | None:
        """One record of at most ``limit`` bytes, decrypted; None at a clean end of the connection
        before it, with ``eof_ok``."""
        got = self._header(eof_ok)
        if got is None:
            return None
        header, n = got
        if n > min(limit, RECORD):
            raise Tampered(f"a record of {n} bytes where at most {min(limit, RECORD)} may come")
        out = bytearray(n)
        self._open_into(header, n, memoryview(out))
        return bytes(out)

    def recv_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly with the records that come."""
        pos, end = 0, len(dest)
        while pos < end:
            got = self._header(eof_ok=False)
            assert got is not None  # (without eof_ok, an end is Closed)
            header, n = got
            if n == 0 or n > min(end - pos, RECORD):
                raise Tampered(f"a record of {n} bytes where {min(end - pos, RECORD)} were due")
            self._open_into(header, n, dest[pos:pos + n])
            pos += n


def send_body(chan: Channel, mv: memoryview) -> None:
    try:
        for i in range(0, len(mv), RECORD):
            chan.send(mv[i:i + RECORD])
    except BaseException:
        chan.broken = True
        raise


def recv_body(chan: Channel, mv: memoryview, verify: bool) -> str | None:
    """Fill ``mv`` from the records that come; with ``verify``, hash each chunk in the pool while
    the next one arrives and return the root digest of what came."""
    try:
        return receive_and_digest(mv, chan.recv_into, verify)
    except BaseException:
        chan.broken = True
        raise


def _named(server: str) -> bytes:
    raw = server.encode()
    return len(raw).to_bytes(2, "big") + raw  # the length first: no two names run into the nonces alike


def client_mac(key: bytes, ns: bytes, nc: bytes, server: str) -> bytes:
    return hmac.new(key, _CLIENT_LABEL + _named(server) + ns + nc, hashlib.sha256).digest()


def server_mac(key: bytes, ns: bytes, nc: bytes, server: str) -> bytes:
    return hmac.new(key, _SERVER_LABEL + _named(server) + nc + ns, hashlib.sha256).digest()
