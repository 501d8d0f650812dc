"""ZeroMQ sockets as a kernel's rightful client (with its CurveZMQ keys) or as another user on the
same network (without them), and what their handshake came to: an event, never a guessed sleep."""

from __future__ import annotations

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from gpuhub.platform import curve

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def peer(ctx: zmq.Context, kind: int, keys: dict | None) -> zmq.Socket:
    """A socket of ``kind`` (not connected yet, a SUB subscribed to nothing): a CurveZMQ client with
    ``keys`` (a connection info's curve_publickey/curve_secretkey), or a plain one with None."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if keys is not None:
        curve.as_client(sock, keys)
    return sock


def handshake(sock: zmq.Socket, url: str, timeout_s: float = 30.0) -> str:
    """Connect ``sock`` to ``url`` and wait for its first handshake to end: "ok" or "failed"
    (a plain socket against a CurveZMQ server, or a wrong server key)."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    try:
        sock.connect(url)
        if not mon.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no handshake with {url} within {timeout_s:g} s")
        event = recv_monitor_message(mon)["event"]
        return "ok" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


async def handshake_async(sock: zmq.asyncio.Socket, url: str, timeout_s: float = 30.0) -> str:
    """:func:`handshake` for an asyncio socket."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    try:
        sock.connect(url)
        if not await mon.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no handshake with {url} within {timeout_s:g} s")
        event = (await recv_monitor_message(mon))["event"]
        return "ok" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
