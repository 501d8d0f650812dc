"""CurveZMQ keys of one kernel: its ZeroMQ sockets encrypted, and open only to holders of its key.

A replica's sockets listen on its server's address, where every other user of that server (and
of the site network) can connect. Jupyter's HMAC signature stops them from *driving* a kernel but
not from *reading* it: a keyless SUB on the iopub port would get every output. So every ZeroMQ
socket of a kernel, the replicas' and the router's (the ones Jupyter Server connects to), is a
CurveZMQ server, as ipykernel and jupyter_client do when a connection file carries
``curve_publickey``/``curve_secretkey``: traffic is encrypted, and a handshake succeeds only for a
client that knows the server's public key.

That key pair is derived from the kernel's connection key (HMAC-SHA256 with a fixed label, then
Curve25519's public key of it) rather than drawn at random, so it needs no distribution of its
own: whoever holds the kernel's key (its router, its replicas, their replacements and a scheduler
that rebuilt its books) derives the same pair, and whoever does not cannot complete a handshake.
The public key is never sent over the network (only the short-term keys of each handshake are),
so it is as secret as the kernel's key it comes from. Clients reuse the same pair, as
jupyter_client does.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
from zmq.utils import z85

LABEL = b"gpuhub kernel curve v1"
KEY_FIELDS = ("curve_publickey", "curve_secretkey")


def kernel_curve_keys(key: str | bytes) -> dict[str, str]:
    """The kernel's key pair for a connection file: ``{"curve_publickey": z85, "curve_secretkey": z85}``."""
    if isinstance(key, str):
        key = key.encode()
    if not key:
        raise ValueError("a kernel without a connection key has no CurveZMQ keys")
    secret = z85.encode(hmac.new(key, LABEL, hashlib.sha256).digest())
    public = zmq.curve_public(secret)
    return {"curve_publickey": public.decode("ascii"), "curve_secretkey": secret.decode("ascii")}


def with_keys(connection: dict, key: str | bytes) -> dict:
    """A kernel socket's connection info (ip, ports) with everything a client needs to use it:
    the kernel's key and its CurveZMQ key pair (a connection file's fields)."""
    return {**connection, "key": key, **kernel_curve_keys(key)}


def without_keys(connection: dict) -> dict:
    """A connection file's fields that may be shown (in an API answer, a log): no key of any kind."""
    return {k: v for k, v in connection.items() if k != "key" and k not in KEY_FIELDS}


def as_server(sock: zmq.Socket, keys: dict[str, str]) -> None:
    """Make ``sock`` (before it binds) accept only CurveZMQ clients that know the kernel's public key."""
    sock.curve_secretkey = keys["curve_secretkey"].encode()
    sock.curve_publickey = keys["curve_publickey"].encode()
    sock.curve_server = True


def as_client(sock: zmq.Socket, keys: dict[str, str]) -> None:
    """Make ``sock`` (before it connects) talk CurveZMQ to a kernel socket set up by :func:`as_server`."""
    sock.curve_serverkey = keys["curve_publickey"].encode()
    sock.curve_secretkey = keys["curve_secretkey"].encode()
    sock.curve_publickey = keys["curve_publickey"].encode()
