"""The client side of the daemons' HTTP APIs: authenticated JSON requests over kept-alive connections.

One :class:`HttpClient` (urllib3 connection pools, one per host) serves every caller: the async
daemons through :func:`call_json`, the replica's lease client, the CLI, the development harness
and the tests through the synchronous :meth:`HttpClient.call_json` and :meth:`HttpClient.request`.

Retries: a pooled connection the server closed while idle (say, the agent restarted) is noticed
and replaced before the request is sent. A request lost with a dropped connection is sent once more
only when that cannot act twice (for a lease: grant twice): idempotent methods, or any method when
the connection could not be made at all. Timeouts are never retried."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from urllib3 import HTTPConnectionPool, HTTPSConnectionPool, Retry, Timeout
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
)

# Methods whose repetition changes nothing: safe to send again after a dropped connection.
IDEMPOTENT = frozenset({"GET", "PUT", "DELETE"})

# urllib3 raises at the first error and follows no redirect; HttpClient.request decides on retries.
# (urllib3's own Retry would also retry timeouts, doubling a caller's wait.) Built once, not per request.
_NO_RETRY = Retry(total=False, redirect=False)


class ApiClientError(RuntimeError):
    """The request failed: ``status`` is the HTTP status, or 0 when no HTTP answer came (cannot
    connect, connection dropped, timed out)."""

    def __init__(self, status: int, message: str, url: str) -> None:
        super().__init__(f"{url}: {status} {message}")
        self.status = status
        self.message = message
        self.url = url


@dataclass(frozen=True)
class Response:
    status: int
    data: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.data) if self.data else None


class _Connection:
    """urllib3's connection, telling the client each time it is (re)opened: tests count them."""

    def __init__(self, *args: Any, on_connect: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_connect = on_connect

    def connect(self) -> None:
        super().connect()
        self._on_connect()


class _HTTPConnection(_Connection, HTTPConnection):
    pass


class _HTTPSConnection(_Connection, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class HttpClient:
    """Kept-alive connections per host, shared by any number of threads."""

    def __init__(self, maxsize: int = 10, connect_timeout: float = 5.0, ca_file: str | None = None,
                 max_hosts: int = 1024) -> None:
        """``ca_file``: the CA certificates an https server's certificate must chain to; by default the
        host's trust store (where the roles install the cluster CA). The name is always checked.
        ``max_hosts``: connections are kept for this many hosts, the ones used last; a host's pool
        beyond that is closed (a server that left the cluster must not hold descriptors for good)."""
        self.maxsize = maxsize  # idle connections kept per host; more may be open at once
        self.connect_timeout = connect_timeout
        self.ca_file = ca_file
        self.max_hosts = max_hosts
        self._pools: OrderedDict[tuple[str, str, int], HTTPConnectionPool] = OrderedDict()
        self._lock = threading.Lock()
        self._opened = 0

    @property
    def connections_opened(self) -> int:
        """Connections made so far, reconnects included (tests and debugging)."""
        return self._opened

    def _count(self) -> None:
        with self._lock:
            self._opened += 1

    def _pool(self, scheme: str, host: str, port: int) -> HTTPConnectionPool:
        key = (scheme, host, port)
        evicted = []
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None:
                self._pools.move_to_end(key)
            else:
                if scheme == "https":
                    pool = _HTTPSPool(host, port, maxsize=self.maxsize, retries=_NO_RETRY, on_connect=self._count,
                                      cert_reqs="CERT_REQUIRED", ca_certs=self.ca_file)
                else:
                    pool = _HTTPPool(host, port, maxsize=self.maxsize, retries=_NO_RETRY, on_connect=self._count)
                self._pools[key] = pool
                while len(self._pools) > self.max_hosts:
                    evicted.append(self._pools.popitem(last=False)[1])
        for old in evicted:  # its connections in use are closed when they come back
            old.close()
        return pool

    def discard(self, url: str) -> None:
        """Close the kept connections to ``url``'s host (a server that is gone for good)."""
        parts = urlsplit(url)
        try:
            key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except ValueError:
            return
        with self._lock:
            pool = self._pools.pop(key, None)
        if pool is not None:
            pool.close()

    def request(self, method: str, url: str, *, token: str | None = None, body: Any = None,
                data: bytes | None = None, headers: Mapping[str, str] | None = None,
                timeout: float = 20.0) -> Response:
        """One request; any HTTP status is returned. ``body`` is sent as JSON, ``data`` as is.
        Raises ApiClientError (status 0) only when no HTTP answer came."""
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:  # a port that is not a number
            host = None
        if parts.scheme not in ("http", "https") or not host:
            raise ApiClientError(0, "not an http(s) URL", url)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        all_headers = {"Content-Type": "application/json"}
        if token:
            all_headers["Authorization"] = f"Bearer {token}"
        all_headers.update(headers or {})
        if data is None and body is not None:
            data = json.dumps(body).encode()
        pool = self._pool(parts.scheme, host, port)
        limits = Timeout(total=timeout, connect=min(timeout, self.connect_timeout))
        method = method.upper()
        retried = False
        while True:
            try:
                resp = pool.urlopen(method, target, body=data, headers=all_headers,
                                    timeout=limits, retries=_NO_RETRY, redirect=False,
                                    assert_same_host=False, preload_content=True)
                return Response(resp.status, resp.data, resp.headers)
            except NewConnectionError as exc:
                # Not connected, so nothing was sent: any method may go again. (A connect that timed
                # out is a ConnectTimeoutError, not this: retrying it would double the wait.)
                error, again = exc, True
            except ProtocolError as exc:
                # The connection dropped under the request: the server may have acted on it.
                error, again = exc, method in IDEMPOTENT
            except (HTTPError, OSError) as exc:  # timeouts among them
                error, again = exc, False
            if retried or not again:
                raise ApiClientError(0, f"cannot reach: {_reason(error)}", url) from None
            retried = True

    def call_json(self, method: str, url: str, token: str, body: Any = None,
                  timeout: float = 20.0) -> tuple[int, Any]:
        """One authenticated JSON request; returns (status, body). Raises ApiClientError unless 2xx,
        with the server's ``{"error": ...}`` as the message when it gave one."""
        method = method.upper()
        data = None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}).encode()
        resp = self.request(method, url, token=token, data=data, timeout=timeout)
        if not 200 <= resp.status < 300:
            raise ApiClientError(resp.status, _error_message(resp), url)
        return resp.status, resp.json()

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            pool.close()


def _reason(exc: BaseException) -> str:
    """What went wrong, without urllib3's wrapping (``[Errno 111] Connection refused``)."""
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)) and not isinstance(exc, NewConnectionError):
        return "timed out"
    cause: BaseException = exc
    if isinstance(exc, NewConnectionError) and exc.__cause__ is not None:
        cause = exc.__cause__
    elif isinstance(exc, ProtocolError) and len(exc.args) > 1 and isinstance(exc.args[1], BaseException):
        cause = exc.args[1]
    return str(cause) or type(cause).__name__


def _error_message(resp: Response) -> str:
    message = http.client.responses.get(resp.status, "Unknown")
    try:
        payload = json.loads(resp.data) if resp.data else None
    except ValueError:
        return message
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return message


_default: HttpClient | None = None
_default_lock = threading.Lock()


def default_client() -> HttpClient:
    """The process's shared client (one pool per host for every caller)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HttpClient()
        return _default


def call_json_sync(method: str, url: str, token: str, body: Any = None, timeout: float = 20.0) -> tuple[int, Any]:
    """:meth:`HttpClient.call_json` on the shared client."""
    return default_client().call_json(method, url, token, body, timeout)


async def call_json(method: str, url: str, token: str, body: Any = None, timeout: float = 20.0) -> tuple[int, Any]:
    """:func:`call_json_sync` without blocking the event loop. Returns (status, body); raises
    ApiClientError on failure."""
    return await _in_thread(call_json_sync, method, url, token, body, timeout)


def _in_thread(fn: Any, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread. Not asyncio.to_thread: its executor's threads are joined at
    exit, so a daemon stopping mid-request would wait for the request's timeout (up to 30 s), and
    they are shared with other blocking work a slow host must not starve."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except Exception as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while the request ran: nobody waits for it
            pass

    threading.Thread(target=work, name="gpuhub-http", daemon=True).start()
    return future
