"""Is a newly placed kernel working? Ask it a real ``kernel_info_request`` through its router.

A replica that cannot start (an ImportError, a broken environment) exits at once, and a kernel
whose replicas are dead never answers. Whoever started the kernel (the provisioner, or ``gpuhub
local-kernel``) waits here until the kernel answers, until ``failure()`` says it cannot start
(its replicas' units are dead, with their errors), or until a deadline: so a user sees why a kernel
failed instead of a kernel that never answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from queue import Empty

from jupyter_client.asynchronous import AsyncKernelClient

# Unit states of a replica that is not running (the agent's; systemd's "activating" is a restart).
DEAD_STATES = frozenset({"failed", "inactive", "gone"})
# ... and of one that counts as running ("unreachable": its agent did not answer, the unit may run).
RUNNING_STATES = frozenset({"active", "activating", "unreachable"})


class KernelStartError(RuntimeError):
    """The kernel did not start; the message says why (a replica's error when there is one).
    ``timed_out``: it did not answer in time (its replicas may still run)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def replica_errors(replicas: list[dict]) -> str:
    """The errors of the dead replicas in a scheduler's kernel view (``GET /api/v1/kernels/{id}``),
    each different error once (replicas of one installation usually fail alike)."""
    by_error: dict[str, list[str]] = {}
    for r in replicas:
        if r.get("state") in DEAD_STATES:
            where = f"replica {r.get('id')} on {r.get('node')} ({r.get('state')})"
            by_error.setdefault((r.get("error") or "").strip(), []).append(where)
    return "\n\n".join(f"{', '.join(where)}:\n{error}" if error else f"{', '.join(where)}: no output"
                         for error, where in by_error.items())


def dead_replicas(replicas: list[dict]) -> list[dict]:
    return [r for r in replicas if r.get("state") in DEAD_STATES]


def majority_running(replicas: list[dict]) -> bool:
    """Whether a majority of a kernel's replicas (its view's ``replicas``) runs, which keeps it
    working. Without one the kernel has ended: its client shut it down, or it was lost. (After a
    shutdown the scheduler may briefly replace the first replica to exit, so "none runs" may never
    come: the rule is the majority's.)"""
    return sum(r.get("state") in RUNNING_STATES for r in replicas) > len(replicas) // 2


async def wait_until_answering(connection: dict, key: bytes, failure: Callable[[], Awaitable[str | None]], *,
                               timeout_s: float, check_every_s: float = 1.0,
                               progress: Callable[[float], None] | None = None) -> dict:
    """Send ``kernel_info_request`` (again every ``check_every_s``, as jupyter_client's
    ``wait_for_ready`` does: a request the router could not yet pass on is dropped) until the kernel
    replies; return the reply's content. Between tries, ``failure()`` returns why the kernel cannot
    start, or None; a reason, or no answer within ``timeout_s``, raises :class:`KernelStartError`.
    ``progress(elapsed_s)`` is called after each unanswered try."""
    kc = AsyncKernelClient()
    kc.load_connection_info({**connection, "key": key})
    kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    started = time.monotonic()
    try:
        while True:
            kc.kernel_info()
            answer_by = time.monotonic() + check_every_s
            while (left := answer_by - time.monotonic()) > 0:
                try:
                    msg = await kc.get_shell_msg(timeout=left)
                except Empty:
                    break
                if msg["msg_type"] == "kernel_info_reply":
                    return msg["content"]
            problem = await failure()
            if problem:
                raise KernelStartError(problem)
            elapsed = time.monotonic() - started
            if elapsed >= timeout_s:
                raise KernelStartError(f"the kernel did not answer within {timeout_s:g} s", timed_out=True)
            if progress is not None:
                progress(elapsed)
    finally:
        kc.stop_channels()
