"""The agent's side of GPU quotas (docs/quotas.md): it meters what its leases held and refuses a
grant that would take a user past a limit.

Grants are decided here, so quotas are enforced here. What a user uses on other servers comes from
the scheduler's answer to this agent's last heartbeat (gpuhub/scheduler/quotas.py); what they use
here is counted locally, so a user's own cells on this server are seen at once. Without an answer
yet (the scheduler was never reached since this agent started) no quota is enforced: GPUs are never
held back because the books are out of reach.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from gpuhub.platform.quota_text import RESETS, hours_text
from gpuhub.platform.weeks import split_by_week, week_key, week_start


class QuotaRefused(Exception):
    """A grant past a limit: the message is what the notebook shows."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit  # "gpus" or "gpu_hours": the metric's label


class UsageMeter:
    """GPU-seconds of this server's ended leases, per week and user, until the scheduler acknowledges
    them. Each heartbeat carries one batch with a sequence number; the batch is sent again, unchanged,
    until it is acknowledged, so a lost answer never counts it twice."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, float]] = {}
        self.inflight: dict | None = None
        # Above any number an earlier run of this agent used, even if its state file was lost.
        self.next_seq = time.time_ns() // 1000

    def record(self, user: str, gpus: int, start: float, end: float) -> None:
        if not user or gpus <= 0 or end <= start:
            return
        for week, seconds in split_by_week(start, end):
            book = self.pending.setdefault(week, {})
            book[user] = book.get(user, 0.0) + gpus * seconds

    def batch(self) -> dict | None:
        """What the next heartbeat reports (None: nothing)."""
        if self.inflight is None and self.pending:
            self.inflight = {"seq": self.next_seq, "weeks": self.pending}
            self.next_seq += 1
            self.pending = {}
        return self.inflight

    def acked(self, seq: object) -> None:
        if self.inflight is not None and seq == self.inflight["seq"]:
            self.inflight = None

    def unreported_s(self, members: set[str], week: str) -> float:
        total = 0.0
        for weeks in (self.pending, (self.inflight or {}).get("weeks", {})):
            total += sum(s for u, s in weeks.get(week, {}).items() if u in members)
        return total

    def to_dict(self) -> dict:
        return {"pending": self.pending, "inflight": self.inflight, "next_seq": self.next_seq}

    @classmethod
    def from_dict(cls, data: dict | None) -> UsageMeter:
        meter = cls()
        if data:
            meter.pending = data.get("pending") or {}
            meter.inflight = data.get("inflight")
            meter.next_seq = max(meter.next_seq, int(data.get("next_seq", 0)))
        return meter


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_limit(lim: object) -> bool:
    return (isinstance(lim, dict) and isinstance(lim.get("name"), str)
            and isinstance(lim.get("members"), list) and all(isinstance(m, str) for m in lim["members"])
            and (lim.get("gpus") is None or (_number(lim["gpus"]) and int(lim["gpus"]) == lim["gpus"]))
            and (lim.get("gpu_hours") is None or _number(lim["gpu_hours"]))
            and _number(lim.get("used_s", 0))
            and isinstance(lim.get("held_elsewhere", {}), dict)
            and all(_number(g) for g in lim.get("held_elsewhere", {}).values()))


def _is_view(view: object) -> bool:
    """A quota view the gate can use: anything else is ignored (a malformed answer must not turn
    every grant into an error)."""
    return (isinstance(view, dict) and isinstance(view.get("week"), str) and isinstance(view.get("limits"), list)
            and all(_is_limit(lim) for lim in view["limits"])
            and isinstance(view.get("extra_hours", {}), dict)
            and all(_number(h) for h in view.get("extra_hours", {}).values())
            and isinstance(view.get("users", []), list))


class QuotaGate:
    """Decides whether a grant fits every limit of its user, from the scheduler's last view plus
    this server's own leases and unreported usage."""

    def __init__(self) -> None:
        self._view: dict | None = None
        self._by_user: dict[str, list[tuple[dict, frozenset[str]]]] = {}  # user -> (limit, its members)

    @property
    def view(self) -> dict | None:
        return self._view

    @view.setter
    def view(self, view: dict | None) -> None:
        # Indexed by member once per answer, so a grant looks at its user's few limits only.
        self._view, self._by_user = view, {}
        for lim in (view or {}).get("limits", ()):
            members = frozenset(lim["members"])
            for m in members:
                self._by_user.setdefault(m, []).append((lim, members))

    def update(self, view: object, local_users: set[str] = frozenset()) -> None:
        """The ``quotas`` part of the scheduler's heartbeat answer (ignored if it is not one). It
        covers the users with kernels here in the scheduler's books (``users``); the limits of a
        user whose kernel is still being placed (``local_users``: this server's kernel units) came
        with its unit and are kept until an answer covers them."""
        if not _is_view(view):
            return
        old = self.view
        if old is not None and old["week"] == view["week"] and "users" in view:
            pending = set(local_users) - set(view["users"])
            names = {lim["name"] for lim in view["limits"]}
            kept = [lim for lim in old["limits"] if lim["name"] not in names and pending & set(lim["members"])]
            extra = {u: h for u, h in old.get("extra_hours", {}).items() if u in pending}
            view = {**view, "limits": view["limits"] + kept,
                    "extra_hours": {**extra, **view.get("extra_hours", {})}}
        self.view = view

    def merge(self, view: object) -> None:
        """A new kernel's user's limits, sent with its unit: added to (or replacing, by name) those
        known, until the next heartbeat's answer brings them all."""
        if not _is_view(view):
            return
        if self.view is None or self.view["week"] != view["week"]:
            self.view = view
            return
        limits = {lim.get("name"): lim for lim in self.view["limits"]}
        limits.update({lim.get("name"): lim for lim in view["limits"]})
        extra = {**self.view.get("extra_hours", {}), **view.get("extra_hours", {})}
        self.view = {**self.view, "limits": list(limits.values()), "extra_hours": extra}

    def check(self, user: str, kernel_id: str, gpus: int, leases: Iterable, meter: UsageMeter,
              now: float | None = None) -> None:
        """Raise QuotaRefused if ``gpus`` more GPUs for ``user``'s kernel ``kernel_id`` would pass a
        limit. ``leases``: this server's live leases (gpuhub/agent/leases.py: ``user``, ``kernel_id``,
        ``gpus`` (the GPU indices), ``granted_at``); the asking kernel's own never count against it
        (it runs one cell at a time)."""
        view = self.view
        if view is None or gpus <= 0:
            return
        now = time.time() if now is None else now
        week, start = week_key(now), week_start(now)
        current = view["week"] == week  # else the week turned since the last answer: its hours are 0
        leases = list(leases)
        for lim, members in self._by_user.get(user, ()):
            group = lim.get("kind") == "group"
            if lim.get("gpu_hours") is not None:
                hours = lim["gpu_hours"] + (view.get("extra_hours", {}).get(user, 0.0) if current else 0.0)
                used = (lim.get("used_s", 0.0) if current else 0.0) + meter.unreported_s(members, week)
                used += sum(len(le.gpus) * max(0.0, now - max(le.granted_at, start))
                            for le in leases if le.user in members)
                if used >= hours * 3600:
                    who = f"{lim['name']} used" if group else "used"
                    its = "its " if group else ""
                    raise QuotaRefused(f"{who} {hours_text(used / 3600)} of {its}{hours:g} GPU-hours this week; "
                                       f"resets {RESETS}", "gpu_hours")
            if lim.get("gpus") is not None:
                cap = lim["gpus"]
                # Per kernel, the most it is seen holding, never the sum: a kernel runs one cell at a
                # time, and a replica that lost the election may still show a grant it is giving back
                # (here, or in another server's last heartbeat).
                by_kernel = {k: g for k, g in (lim.get("held_elsewhere") or {}).items() if k != kernel_id}
                for le in leases:
                    if le.user in members and le.kernel_id != kernel_id:
                        by_kernel[le.kernel_id] = max(by_kernel.get(le.kernel_id, 0), len(le.gpus))
                held = sum(by_kernel.values())
                if held + gpus > cap:
                    whose = f"{lim['name']}" if group else "you"
                    if gpus > cap:
                        msg = (f"this kernel asks for {gpus} GPU(s) per cell, more than the {cap} "
                               f"{whose} may hold at once")
                    else:
                        msg = (f"this cell needs {gpus} GPU(s), and {whose} already hold{'s' if group else ''} "
                               f"{held} of {'its' if group else 'your'} {cap} at once in other kernels; "
                               "it can run when one of their cells ends")
                    raise QuotaRefused(msg, "gpus")
