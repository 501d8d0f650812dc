"""The replica's side of per-cell GPU leases: ask the local agent, wait visibly, release."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable


class GrantError(RuntimeError):
    """The agent could not be asked, or refused for a reason waiting will not fix."""


class GrantTimeout(GrantError):
    pass


class GrantCancelled(GrantError):
    pass


@dataclass
class Grant:
    lease_id: str
    node: str
    uuids: list[str]


class GrantClient:
    def __init__(self, agent_url: str, token: str, node: str = "") -> None:
        self.agent_url = agent_url.rstrip("/")
        self.token = token
        self.node = node

    @classmethod
    def from_env(cls) -> "GrantClient | None":
        url, token = os.environ.get("GPUHUB_AGENT_URL"), os.environ.get("GPUHUB_LEASE_TOKEN")
        if not url or not token:
            return None
        return cls(url, token, os.environ.get("GPUHUB_NODE", ""))

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.agent_url + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"{}")
            except ValueError:
                payload = {"error": exc.reason}
            return exc.code, payload
        except OSError as exc:
            raise GrantError(f"cannot reach the GPU agent of node {self.node or '?'} at {self.agent_url}: {exc}") from None

    def try_grant(self, gpus: int) -> Grant | None:
        status, body = self._call("POST", "/api/v1/leases", {"gpus": gpus, "holder_pid": os.getpid()})
        if status == 200:
            return Grant(body["lease_id"], body.get("node", self.node), [g["uuid"] for g in body["gpus"]])
        if status == 409:
            return None
        raise GrantError(f"the GPU agent refused the lease: {body.get('error', status)}")

    def acquire(self, gpus: int, timeout_s: float, on_wait: Callable[[str], None],
                cancelled: Callable[[], bool] = lambda: False) -> Grant:
        """Grant now, or wait (bounded) telling the user why; never a silent hang."""
        start = time.monotonic()
        delay, told = 0.05, 0.0
        while True:
            grant = self.try_grant(gpus)
            if grant is not None:
                return grant
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise GrantTimeout(f"no GPU became free on node {self.node} within {timeout_s:g} s")
            if told == 0.0 or waited - told >= 30:
                on_wait(f"[gpuhub] waiting for {gpus} GPU(s) on {self.node} (all busy; waited {waited:.0f} s)…\n")
                told = waited or 1e-9
            if cancelled():
                raise GrantCancelled("interrupted while waiting for a GPU")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def release(self, grant: Grant) -> None:
        for attempt in range(3):
            try:
                self._call("DELETE", f"/api/v1/leases/{grant.lease_id}")
                return
            except GrantError:
                time.sleep(0.2 * (attempt + 1))
        # The agent expires leases of dead holders; a live holder retries at the next cell.
