"""The replica's side of per-cell GPU leases: ask the local agent for a lease now, release it.

Waiting for a GPU is the replica's business (every replica of the kernel asks; see kernel.py).

Every cell of a GPU kernel asks the agent twice (grant, release), so the client keeps its HTTP/1.1
connection to the agent open (:class:`~gpuhub.platform.http_client.HttpClient`) instead of paying a
TCP handshake per call; the client also decides when a lost request may be sent again (a grant never)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from gpuhub.platform.http_client import ApiClientError, HttpClient


class LeaseError(RuntimeError):
    """The agent could not be asked, or refused for a reason waiting will not fix."""


class QuotaExceeded(RuntimeError):
    """The agent refused because the grant would take the user past a GPU quota; the message says
    which, in words for the notebook (gpuhub/agent/quota_gate.py)."""


@dataclass
class Lease:
    lease_id: str
    node: str
    uuids: list[str]
    # Set when a cell runs under this lease: how long it waited for the GPUs (the agent's histogram).
    waited_s: float | None = None


class LeaseClient:
    def __init__(self, agent_url: str, token: str, node: str = "") -> None:
        self.agent_url = agent_url.rstrip("/")
        self.token = token
        self.node = node
        # Its own client, not the shared one: the kernel's main and reaper threads need at most two.
        self.http = HttpClient(maxsize=2, connect_timeout=10)

    @classmethod
    def from_env(cls) -> LeaseClient | None:
        url, token = os.environ.get("GPUHUB_AGENT_URL"), os.environ.get("GPUHUB_LEASE_TOKEN")
        if not url or not token:
            return None
        return cls(url, token, os.environ.get("GPUHUB_NODE", ""))

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            resp = self.http.request(method, self.agent_url + path, token=self.token, body=body, timeout=10)
        except ApiClientError as exc:
            raise LeaseError(f"cannot reach the GPU agent of node {self.node or '?'} at {self.agent_url}: "
                             f"{exc.message.removeprefix('cannot reach: ')}") from None
        status, raw = resp.status, resp.data
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = {"error": f"HTTP {status}"}
        return status, payload if isinstance(payload, dict) else {"error": f"HTTP {status}"}

    def try_grant(self, gpus: int, reclaim: bool = True) -> Lease | None:
        """The GPUs now, or None. ``reclaim`` False: not by ending other kernels' lingering
        processes (an election's tentative ask, which most replicas give back at once)."""
        status, body = self._call("POST", "/api/v1/leases", {"gpus": gpus, "holder_pid": os.getpid(),
                                                             "reclaim": reclaim})
        if status == 200:
            return Lease(body["lease_id"], body.get("node", self.node), [g["uuid"] for g in body["gpus"]])
        if status == 409:
            return None
        if status == 403 and body.get("quota"):
            raise QuotaExceeded(str(body.get("error", "over the GPU quota")))
        raise LeaseError(f"the GPU agent refused the lease: {body.get('error', status)}")

    def linger(self, grant: Lease, pid: int) -> str | None:
        """Keep ``grant`` while process ``pid`` (the cell's, idle now) keeps its GPUs warm for the
        next cell, until another kernel needs them (the agent then ends the process). None when
        the agent agreed, else why not (the caller then ends the process and releases)."""
        body: dict = {"pid": pid}
        if grant.waited_s is not None:
            body["waited_s"] = round(max(0.0, grant.waited_s), 6)
            grant.waited_s = None  # reported once, for the cell that waited
        try:
            status, answer = self._call("POST", f"/api/v1/leases/{grant.lease_id}/linger", body)
        except LeaseError as exc:
            return str(exc)
        return None if status == 200 else str(answer.get("error", f"HTTP {status}"))

    def resume(self, grant: Lease) -> bool:
        """Run the next cell under a lingering ``grant``; False when the agent took it back."""
        status, body = self._call("POST", f"/api/v1/leases/{grant.lease_id}/resume", {})
        if status == 200:
            return True
        if status == 403 and body.get("quota"):
            raise QuotaExceeded(str(body.get("error", "over the GPU quota")))
        return False

    def request_migration(self) -> tuple[str | None, str]:
        """Ask (through the agent, which asks the scheduler) to move a replica of this kernel to a
        server that can grant its GPUs now: (the target server, "") when a move is under way, or
        (None, why not) when no server can take it now."""
        try:
            status, body = self._call("POST", "/api/v1/migrations", {})
        except LeaseError as exc:
            return None, str(exc)
        if status == 202 and isinstance(body.get("target"), str):
            return body["target"], ""
        return None, str(body.get("error", f"HTTP {status}"))

    def release(self, grant: Lease) -> None:
        for attempt in range(3):
            try:
                query = "" if grant.waited_s is None else f"?waited_s={max(0.0, grant.waited_s):.6f}"
                self._call("DELETE", f"/api/v1/leases/{grant.lease_id}{query}")
                return
            except LeaseError:
                time.sleep(0.2 * (attempt + 1))
        # The agent expires leases of dead holders; a live holder retries at the next cell.

    def close(self) -> None:
        self.http.close()
