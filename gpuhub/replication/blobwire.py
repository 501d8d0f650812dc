"""The blob protocol both ends speak (:mod:`~gpuhub.replication.blobserver`,
:mod:`~gpuhub.replication.blobclient`): framing, the handshake's MACs, socket helpers.

One TCP connection per ``push``/``fetch`` call; all integers big-endian:

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
   ``max_blob`` (:data:`MAX_BLOB` by default) is answered with ``E`` and the connection is
   closed; the server itself goes on serving.

**Verification on receipt.** Both the server (on ``PUT``) and the client's ``fetch`` re-hash what
they received before storing or returning it, and we keep that on by default even though the
connection is authenticated: the handshake authenticates the *start* of the connection only (the
stream itself carries no MAC and no encryption), so a faulty sender, a corrupting middlebox or a
TCP injection after the handshake would otherwise go unnoticed and a wrong value would be bound to
a digest that Raft committed (an on-path attacker can even relay a genuine handshake and then
write into the stream). Each 16 MiB chunk is hashed in the pool while the next one is still
arriving (:func:`gpuhub.replication.digest.receive_and_digest`), so on separate hosts with idle
cores the check mostly overlaps the transfer. It is not free, though: on the 2-core dev VM (all
three replicas on one machine, bench/blob_bench.py) a 1 GiB value pushed to both followers costs
2.3 CPU-seconds with the check and 0.9 without, so at best ~1.1 s against ~0.45 s of wall time on
two idle cores (CPU-seconds / 2; the shared VM was never idle enough to time it): the
1 GB/s-to-both goal needs ``verify=False`` there. ``BlobServer(verify=False)`` is for
measurements and for sites whose links have their own integrity (WireGuard, IPsec); it trusts any
authenticated peer. ``fetch`` always verifies. The payload is not encrypted: unlike pysyncobj's
messages (encrypted with its password), values cross the cluster's network in clear, as pickles.

**Copies.** The sender passes ``memoryview`` slices of the caller's buffer to ``sendall``; the
receiver allocates the value's buffer once and ``recv_into`` slices of it; the stored object *is*
that buffer (exposed read-only). Sockets use ``TCP_NODELAY`` and :data:`SOCK_BUF`-sized send and
receive buffers.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from gpuhub.replication.digest import CHUNK, receive_and_digest

MAX_BLOB = 64 << 30
"""Default cap on one value's length, in bytes (a header over it is refused)."""
SOCK_BUF = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for (Linux caps it at net.core.[rw]mem_max and doubles it)."""

MAGIC = b"GPHB\x01"
NONCE = 32
MAC = 32
REQ = struct.Struct("!c64sQ")
"""A request header: op, digest (hex ascii), length."""
REP = struct.Struct("!cQ")
"""A reply header: status, length of what follows."""
MAX_MSG = 4096
"""The longest error message a client reads from an ``E`` reply."""
_CLIENT_LABEL = b"gpuhub-blob client"
_SERVER_LABEL = b"gpuhub-blob server"


class Closed(Exception):
    """The peer closed the connection."""


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


def send_body(sock: socket.socket, mv: memoryview) -> None:
    # slice so a socket timeout bounds each 16 MiB step, not the whole value
    for i in range(0, len(mv), CHUNK):
        sock.sendall(mv[i:i + CHUNK])


def recv_body(sock: socket.socket, mv: memoryview, verify: bool) -> str | None:
    """Fill ``mv`` from ``sock``; with ``verify``, hash each chunk in the pool while the next one
    arrives and return the root digest of what came."""
    return receive_and_digest(mv, lambda part: recv_into(sock, part), verify)


def client_mac(key: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, _CLIENT_LABEL + ns + nc, hashlib.sha256).digest()


def server_mac(key: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, _SERVER_LABEL + nc + ns, hashlib.sha256).digest()
