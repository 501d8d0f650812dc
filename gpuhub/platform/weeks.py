"""Quota weeks: Monday 00:00 UTC to the next Monday 00:00 UTC (the weekly GPU-hour quotas)."""

from __future__ import annotations

import datetime as dt

WEEK_S = 7 * 86400.0


def week_start(t: float) -> float:
    """The Monday 00:00 UTC at or before ``t`` (epoch seconds)."""
    day = dt.datetime.fromtimestamp(t, dt.UTC).date()
    monday = day - dt.timedelta(days=day.weekday())
    return dt.datetime(monday.year, monday.month, monday.day, tzinfo=dt.UTC).timestamp()


def week_key(t: float) -> str:
    """The week of ``t`` by its Monday, ``2026-11-23``: how usage is keyed in the books."""
    return dt.datetime.fromtimestamp(week_start(t), dt.UTC).date().isoformat()


def split_by_week(start: float, end: float) -> list[tuple[str, float]]:
    """The seconds of [start, end) in each week it touches, e.g. a lease held over Monday 00:00."""
    out: list[tuple[str, float]] = []
    t = start
    while t < end:
        boundary = week_start(t) + WEEK_S
        upto = min(end, boundary)
        out.append((week_key(t), upto - t))
        t = upto
    return out
