"""The replica's side of per-cell GPU leases: ask the local agent, wait visibly, release.

Every cell of a GPU kernel asks the agent twice (grant, release), so the client keeps one HTTP/1.1
connection open to it (:class:`AgentConnection`) instead of paying a TCP handshake per call."""

from __future__ import annotations

import http.client
import json
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit


class LeaseError(RuntimeError):
    """The agent could not be asked, or refused for a reason waiting will not fix."""


class LeaseTimeout(LeaseError):
    pass


class LeaseCancelled(LeaseError):
    pass


@dataclass
class Lease:
    lease_id: str
    node: str
    uuids: list[str]


# The connection died under a request (e.g. the agent restarted while it was idle).
DROPPED = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError,
           ConnectionAbortedError, BrokenPipeError)


class AgentConnection:
    """One kept-alive HTTP/1.1 connection to the local agent, shared by the kernel's threads.

    A connection the agent closed while idle (agent restart, idle timeout) is noticed before the
    next request and replaced. A request that the dropped connection lost is sent again once on a
    new connection when that cannot grant twice: always for idempotent methods, and for others
    only if the connection failed while the request was still being written."""

    def __init__(self, url: str, timeout: float = 10) -> None:
        parts = urlsplit(url)
        self.base_path = parts.path.rstrip("/")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or (443 if self.https else 80)
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.opened = 0  # connections made so far (tests and debugging)

    def request(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, bytes]:
        with self._lock:
            reused = self._conn is not None and not self._closed_by_peer()
            if not reused:
                self._open()
            try:
                return self._exchange(method, path, body, headers)
            except _WriteFailed as exc:
                retry, cause = reused, exc.cause
            except DROPPED as exc:
                retry, cause = reused and method in ("GET", "PUT", "DELETE"), exc
            except OSError:
                self.close_locked()
                raise
            self.close_locked()
            if not retry:
                raise cause
            self._open()
            try:
                return self._exchange(method, path, body, headers)
            except _WriteFailed as exc:
                self.close_locked()
                raise exc.cause from None
            except OSError:
                self.close_locked()
                raise

    def _exchange(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, bytes]:
        conn = self._conn
        try:
            conn.request(method, self.base_path + path, body=body, headers=headers)
        except OSError as exc:
            raise _WriteFailed(exc) from None
        resp = conn.getresponse()
        data = resp.read()
        if resp.will_close:
            self.close_locked()
        return resp.status, data

    def _open(self) -> None:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        self._conn = cls(self.host, self.port, timeout=self.timeout)
        self._conn.connect()
        self.opened += 1

    def _closed_by_peer(self) -> bool:
        """True when the idle connection has something to read: the agent's FIN (or garbage)."""
        sock = self._conn.sock
        if sock is None:
            return True
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            readable = True
        if readable:
            self.close_locked()
        return bool(readable)

    def close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class _WriteFailed(Exception):
    """Sending the request failed: the agent cannot have acted on it."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class LeaseClient:
    def __init__(self, agent_url: str, token: str, node: str = "") -> None:
        self.agent_url = agent_url.rstrip("/")
        self.token = token
        self.node = node
        self.connection = AgentConnection(self.agent_url)

    @classmethod
    def from_env(cls) -> LeaseClient | None:
        url, token = os.environ.get("GPUHUB_AGENT_URL"), os.environ.get("GPUHUB_LEASE_TOKEN")
        if not url or not token:
            return None
        return cls(url, token, os.environ.get("GPUHUB_NODE", ""))

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        try:
            status, raw = self.connection.request(method, path, data, headers)
        except (OSError, http.client.HTTPException) as exc:
            raise LeaseError(f"cannot reach the GPU agent of node {self.node or '?'} at {self.agent_url}: "
                             f"{exc or type(exc).__name__}") from None
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = {"error": f"HTTP {status}"}
        return status, payload if isinstance(payload, dict) else {"error": f"HTTP {status}"}

    def try_grant(self, gpus: int) -> Lease | None:
        status, body = self._call("POST", "/api/v1/leases", {"gpus": gpus, "holder_pid": os.getpid()})
        if status == 200:
            return Lease(body["lease_id"], body.get("node", self.node), [g["uuid"] for g in body["gpus"]])
        if status == 409:
            return None
        raise LeaseError(f"the GPU agent refused the lease: {body.get('error', status)}")

    def acquire(self, gpus: int, timeout_s: float, on_wait: Callable[[str], None],
                cancelled: Callable[[], bool] = lambda: False) -> Lease:
        """A lease now, or wait (bounded) telling the user why; never a silent hang."""
        start = time.monotonic()
        delay, told = 0.05, 0.0
        while True:
            grant = self.try_grant(gpus)
            if grant is not None:
                return grant
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise LeaseTimeout(f"no GPU became free on node {self.node} within {timeout_s:g} s")
            if told == 0.0 or waited - told >= 30:
                on_wait(f"[gpuhub] waiting for {gpus} GPU(s) on {self.node} (all busy; waited {waited:.0f} s)…\n")
                told = waited or 1e-9
            if cancelled():
                raise LeaseCancelled("interrupted while waiting for a GPU")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def release(self, grant: Lease) -> None:
        for attempt in range(3):
            try:
                self._call("DELETE", f"/api/v1/leases/{grant.lease_id}")
                return
            except LeaseError:
                time.sleep(0.2 * (attempt + 1))
        # The agent expires leases of dead holders; a live holder retries at the next cell.

    def close(self) -> None:
        self.connection.close()
