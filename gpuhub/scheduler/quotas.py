"""Fair share of scarce GPUs: per-user and per-group limits on the GPUs held at once and on the
GPU-hours used a week, and the books of what each user used (docs/quotas.md).

The agents decide grants, so they enforce the limits (gpuhub/agent/quota_gate.py). The scheduler
keeps the books: it adds up the GPU-seconds of ended leases that the agents report in their
heartbeats (each batch once, by its sequence number), sees every live lease in those heartbeats,
and answers each heartbeat with the limits of the users whose kernels run on that server and what
those users use elsewhere. GPU-hours count what cells held (the leases), not session time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gpuhub.platform.quota_text import RESETS
from gpuhub.platform.weeks import WEEK_S, week_key, week_start

LIMIT_KEYS = ("gpus", "gpu_hours_per_week")
KEEP_WEEKS = 8  # weeks of usage kept in the books (the CLI and the dashboard show this week)


class QuotaConfigError(ValueError):
    """A quota setting that cannot be used; the message names the setting."""


@dataclass(frozen=True)
class Limit:
    """One limit: a user's own (or the default's, for that user), or a group's, shared by its members."""

    name: str
    kind: str  # "user" or "group"
    members: frozenset[str]
    gpus: int | None  # GPUs held at once; None: no limit
    gpu_hours: float | None  # GPU-hours a week, before extra hours; None: no limit

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "members": sorted(self.members), "gpus": self.gpus,
                "gpu_hours": self.gpu_hours}


def _limit_values(where: str, raw: object, extra_keys: tuple[str, ...] = ()) -> tuple[int | None, float | None]:
    if not isinstance(raw, dict):
        raise QuotaConfigError(f"{where} must be a table like {{gpus = 2, gpu_hours_per_week = 30}}, not {raw!r}")
    unknown = sorted(set(raw) - set(LIMIT_KEYS) - set(extra_keys))
    if unknown:
        raise QuotaConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                               f"use {', '.join(LIMIT_KEYS + extra_keys)}")
    gpus, hours = raw.get("gpus"), raw.get("gpu_hours_per_week")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise QuotaConfigError(f"{where}.gpus must be a whole number >= 0, not {gpus!r}")
    if hours is not None:
        if isinstance(hours, bool) or not isinstance(hours, int | float) or not math.isfinite(hours) or hours < 0:
            raise QuotaConfigError(f"{where}.gpu_hours_per_week must be a number >= 0, not {hours!r}")
        hours = float(hours)
    return gpus, hours


class QuotaPolicy:
    """The limits from the scheduler's settings (``quota_default``, ``quota_groups``, ``quota_users``).

    A user's own entry replaces the default for that user; every group the user is a member of
    applies too, its limit shared by all its members. A grant must fit every limit that applies."""

    def __init__(self, default: dict | None = None, groups: dict | None = None, users: dict | None = None) -> None:
        default, groups, users = default or {}, groups or {}, users or {}
        self.default = _limit_values("quota_default", default) if default else None
        self.users: dict[str, tuple[int | None, float | None]] = {}
        for user, raw in users.items():
            self.users[str(user)] = _limit_values(f"quota_users.{user}", raw)
        self.groups: list[Limit] = []
        for name, raw in groups.items():
            members = raw.get("members") if isinstance(raw, dict) else None
            if not isinstance(members, list) or not members or not all(isinstance(m, str) and m for m in members):
                raise QuotaConfigError(f"quota_groups.{name}.members must list the group's user names")
            gpus, hours = _limit_values(f"quota_groups.{name}", raw, ("members",))
            self.groups.append(Limit(f"group {name}", "group", frozenset(members), gpus, hours))

    @property
    def enabled(self) -> bool:
        return bool(self.default or self.users or self.groups)

    def limits_for(self, user: str) -> list[Limit]:
        own = self.users.get(user, self.default)
        limits = [Limit(user, "user", frozenset({user}), *own)] if own else []
        return limits + [g for g in self.groups if user in g.members]

    def named_users(self) -> set[str]:
        """Users the settings name (their own entries and the groups' members)."""
        return set(self.users).union(*(g.members for g in self.groups))


@dataclass(frozen=True)
class LiveLease:
    """A lease an agent reported in its last heartbeat."""

    node: str
    user: str
    kernel_id: str
    gpus: int
    granted_at: float


def held_by_kernel(members: Iterable[str], leases: Iterable[LiveLease], exclude_node: str = "") -> dict[str, int]:
    """GPUs ``members``' kernels hold, per kernel: the most any one of its leases holds. A kernel runs
    one cell at a time; the replicas that lost a cell's election give back the grants they got, but
    their servers' last heartbeats may still show them, and those must not count twice."""
    members = set(members)
    held: dict[str, int] = {}
    for le in leases:
        if le.user in members and le.node != exclude_node:
            held[le.kernel_id] = max(held.get(le.kernel_id, 0), le.gpus)
    return held


class UsageLedger:
    """GPU-seconds of ended leases per week and user, extra GPU-hours granted by admins, and the last
    usage batch applied per server (so a batch sent again after a lost answer counts once)."""

    def __init__(self) -> None:
        self.closed: dict[str, dict[str, float]] = {}  # week -> user -> GPU-seconds
        self.extra: dict[str, dict[str, float]] = {}  # week -> user -> extra GPU-hours
        self.seqs: dict[str, int] = {}  # server -> sequence number of the last batch applied

    def apply(self, node: str, usage: object) -> int:
        """Add one heartbeat's usage batch ``{"seq": N, "weeks": {week: {user: seconds}}}``; returns the
        sequence number to acknowledge. ValueError if the batch is malformed (nothing is added)."""
        if not isinstance(usage, dict) or isinstance(usage.get("seq"), bool) or not isinstance(usage.get("seq"), int):
            raise ValueError("field 'usage' must be {\"seq\": <int>, \"weeks\": {...}}")
        seq, weeks = usage["seq"], usage.get("weeks", {})
        if not isinstance(weeks, dict):
            raise ValueError("field 'usage.weeks' must map weeks to {user: GPU-seconds}")
        for week, per_user in weeks.items():
            if not isinstance(per_user, dict) or not all(
                    isinstance(u, str) and not isinstance(s, bool) and isinstance(s, int | float)
                    and math.isfinite(s) and s >= 0 for u, s in per_user.items()):
                raise ValueError(f"field 'usage.weeks.{week}' must map user names to GPU-seconds >= 0")
        if seq <= self.seqs.get(node, -1):
            return seq  # applied already: its answer was lost
        for week, per_user in weeks.items():
            book = self.closed.setdefault(str(week), {})
            for user, seconds in per_user.items():
                book[user] = book.get(user, 0.0) + float(seconds)
        self.seqs[node] = seq
        return seq

    def add_extra(self, user: str, hours: float, now: float) -> float:
        week = self.extra.setdefault(week_key(now), {})
        week[user] = week.get(user, 0.0) + hours
        return week[user]

    def prune(self, now: float) -> None:
        oldest = week_key(week_start(now) - (KEEP_WEEKS - 1) * WEEK_S)
        for book in (self.closed, self.extra):
            for week in [w for w in book if w < oldest]:
                del book[week]

    def to_dict(self) -> dict:
        return {"closed": self.closed, "extra": self.extra, "seqs": self.seqs}

    @classmethod
    def from_dict(cls, data: dict) -> UsageLedger:
        ledger = cls()
        ledger.closed = {str(w): {str(u): float(s) for u, s in v.items()} for w, v in data.get("closed", {}).items()}
        ledger.extra = {str(w): {str(u): float(h) for u, h in v.items()} for w, v in data.get("extra", {}).items()}
        ledger.seqs = {str(n): int(s) for n, s in data.get("seqs", {}).items()}
        return ledger


class Quotas:
    """The scheduler's side of quotas: the policy, the ledger, and the views built from them and the
    live leases (which the caller passes in, from the agents' last heartbeats)."""

    def __init__(self, policy: QuotaPolicy, ledger: UsageLedger | None = None) -> None:
        self.policy = policy
        self.ledger = ledger or UsageLedger()

    def used_s(self, members: Iterable[str], now: float, leases: Iterable[LiveLease], exclude_node: str = "") -> float:
        """GPU-seconds ``members`` used this week: ended leases, plus the live ones' time so far."""
        members = set(members)
        start, week = week_start(now), week_key(now)
        closed = self.ledger.closed.get(week, {})
        total = sum(closed.get(m, 0.0) for m in members)
        for le in leases:
            if le.user in members and le.node != exclude_node:
                total += le.gpus * max(0.0, now - max(le.granted_at, start))
        return total

    def extra_hours(self, user: str, now: float) -> float:
        return self.ledger.extra.get(week_key(now), {}).get(user, 0.0)

    def node_view(self, node: str, users: Iterable[str], now: float, leases: list[LiveLease]) -> dict:
        """The answer to ``node``'s heartbeat: every limit of ``users`` (those with kernels there),
        with what its members used and hold on the other servers. The agent adds its own."""
        limits: dict[str, Limit] = {}
        extra: dict[str, float] = {}
        for user in users:
            for limit in self.policy.limits_for(user):
                limits[limit.name] = limit
            if self.extra_hours(user, now):
                extra[user] = self.extra_hours(user, now)
        out = []
        for limit in limits.values():
            out.append({**limit.to_dict(), "used_s": self.used_s(limit.members, now, leases, exclude_node=node),
                        "held_elsewhere": held_by_kernel(limit.members, leases, exclude_node=node)})
        return {"week": week_key(now), "week_start": week_start(now), "users": sorted(users), "limits": out,
                "extra_hours": extra}

    def status(self, user: str, now: float, leases: list[LiveLease]) -> dict:
        """What ``gpuhub quota`` and the spawn page show a user: this week's GPU-hours and GPUs held,
        and each limit that applies with its members' use."""
        extra = self.extra_hours(user, now)
        limits = []
        for limit in self.policy.limits_for(user):
            hours = None if limit.gpu_hours is None else limit.gpu_hours + extra
            limits.append({**limit.to_dict(), "gpu_hours": hours,
                           "gpu_hours_used": round(self.used_s(limit.members, now, leases) / 3600, 4),
                           "gpus_held": sum(held_by_kernel(limit.members, leases).values())})
        return {"user": user, "week": week_key(now), "resets": RESETS,
                "gpu_hours_used": round(self.used_s({user}, now, leases) / 3600, 4),
                "gpus_held": sum(held_by_kernel({user}, leases).values()),
                "extra_gpu_hours": extra, "limits": limits}

    def users(self, now: float, leases: list[LiveLease], others: Iterable[str] = ()) -> list[str]:
        """Everyone worth a line: named in the settings, with usage or extra hours this week, holding
        a lease, or ``others`` (the kernels' owners)."""
        week = week_key(now)
        found = (self.policy.named_users() | set(self.ledger.closed.get(week, {}))
                 | set(self.ledger.extra.get(week, {})) | {le.user for le in leases} | set(others))
        return sorted(u for u in found if u)


def check_file(path: str) -> int:
    """``python -m gpuhub.scheduler.quotas scheduler.toml``: exit 1 with the reason when the file's
    quota settings cannot be used (the scheduler role validates the file with it before installing)."""
    import sys
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        QuotaPolicy(raw.get("quota_default"), raw.get("quota_groups"), raw.get("quota_users"))
    except (OSError, tomllib.TOMLDecodeError, QuotaConfigError, AttributeError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(check_file(sys.argv[1]))
