"""A cell waiting for GPUs that none of the kernel's servers can grant asks for a migration.

The replica that speaks for the waiting cell (the one that announces the wait) asks its agent,
which asks the scheduler, to move one replica to a server that can grant now
(gpuhub/scheduler/migration.py). The new replica joins the group, the router hands it the waiting
cell and it wins the next attempt's election. Asking is cheap for the kernel but not free for
the scheduler, so a cell asks at most every ``every_s`` seconds, and the scheduler refuses a
second move of a kernel within its own interval.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# A cell that could not be moved asks again after this long (servers free up, the scheduler's
# interval between moves of one kernel passes).
ASK_EVERY_S = 5.0


class MoveRequests:
    """One waiting cell's requests; ``told`` is the target the notebook was last told of."""

    def __init__(self, lease_client, every_s: float = ASK_EVERY_S) -> None:
        self.lease_client = lease_client
        self.every_s = every_s
        self.asked_at: float | None = None
        self.target: str | None = None
        self.told: str | None = None

    def ask(self, waited: float) -> str | None:
        """The server a replica is moving to (asking again when it is time), or None."""
        if self.lease_client is None:
            return None
        if self.asked_at is not None and waited - self.asked_at < self.every_s:
            return self.target
        self.asked_at = waited
        target, why = self.lease_client.request_migration()
        if target is None:
            log.info("no migration for the waiting cell: %s", why)
        self.target = target
        return target
