"""The router follows a replica that moves while a cell waits for it (docs/architecture.md, "Migration").

The provisioner polls the scheduler every few seconds, which is also how a router meets the
replacement of a lost replica. A migration is different: a cell waits for the new replica, so
when a replica says that one is moving (gpuhub/platform/messages.py, GROUP_CHANGE) the router
asks the scheduler until the new replica is in the group, and routes to it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gpuhub.platform.http_client import ApiClientError

log = logging.getLogger(__name__)


def routable(record: dict) -> list[dict]:
    """The router's view of a kernel's replicas (id and connection) from the scheduler's record."""
    return [{"id": r["id"], **r["connection"]} for r in record.get("replicas", []) if r.get("connection")]


class GroupFollower:
    """Wires a router's GROUP_CHANGE to the scheduler: ``fetch`` returns the kernel's record."""

    def __init__(self, router, fetch: Callable[[], Awaitable[dict]], timeout_s: float = 60.0,
                 interval_s: float = 0.2) -> None:
        self.router = router
        self.fetch = fetch
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        router.on_group_change = self.moving

    def moving(self, target: str) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.follow(target))

    async def follow(self, target: str) -> bool:
        """Ask for the group until it has a replica on ``target``; route to it. False after the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while loop.time() < deadline:
            try:
                record = await self.fetch()
            except ApiClientError as exc:
                log.debug("the group of a moving kernel: %s", exc)
                record = {}
            if any(r.get("node") == target and r.get("connection") for r in record.get("replicas", [])):
                self.router.set_replicas(routable(record))
                return True
            await asyncio.sleep(self.interval_s)
        log.warning("a replica was said to move to %s, but the scheduler's group never showed it", target)
        return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
