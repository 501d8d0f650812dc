"""This process's memory limit (its systemd unit's ``MemoryMax=``, a cgroup's limit) and the
out-of-memory killer's kills in its cgroup: a GPU cell's process killed by SIGKILL is then reported
to the user as out of memory (with the limit, when it was this limit that was reached) rather than
as a bare signal.

Both cgroup layouts are read: the unified one (cgroup v2, Debian 12's default: ``memory.max``,
``memory.events``) and the memory controller of cgroup v1 (hybrid hosts: ``memory.limit_in_bytes``,
``memory.oom_control``; v1 cannot tell this limit from the server running out). Anything
unreadable answers None: the report then names the signal only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT_V1 = 1 << 62  # cgroup v1 reports "no limit" as a huge page-rounded number


def _dirs(proc_cgroup: str, root: Path) -> list[tuple[str, Path]]:
    """(layout, directory) of this process's memory cgroup, the v1 memory controller's first."""
    found: list[tuple[str, Path]] = []
    for line in proc_cgroup.splitlines():
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):
            found.insert(0, ("v1", root / "memory" / rel))
        elif hid == "0" and controllers == "":
            found += [("v2", root / rel), ("v2", root / "unified" / rel)]
    return found


def _read(name_v1: str, name_v2: str, root: Path, proc_cgroup: str | None) -> tuple[str, Path, str] | None:
    """(layout, directory, text) of the first of this process's memory cgroup files found. Never
    raises: a cell's error report calls it, and an unreadable file only makes that report plainer."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except (OSError, ValueError):  # ValueError: undecodable bytes
        return None
    for layout, d in _dirs(text, root):
        try:
            return layout, d, (d / (name_v1 if layout == "v1" else name_v2)).read_text()
        except (OSError, ValueError):
            continue
    return None


def _count(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


@dataclass(frozen=True)
class OomCounts:
    """Counters of this process's memory cgroup: ``kills`` grows when Linux's out-of-memory killer
    ended one of its processes, whatever ran out (this limit, a parent slice's, the whole server's
    memory); ``limit_hits`` when the cgroup's own limit was reached and an allocation was about to
    fail (cgroup v2 ``oom``). None on cgroup v1, which counts no such thing (its ``failcnt`` also
    grows whenever reclaiming page cache kept usage under the limit)."""

    limit_hits: int | None
    kills: int


def oom_counts(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> OomCounts | None:
    """This process's cgroup's :class:`OomCounts` now, or None where they cannot be read."""
    found = _read("memory.oom_control", "memory.events", root, proc_cgroup)
    if found is None:
        return None
    layout, _, text = found
    fields = dict(line.partition(" ")[::2] for line in text.splitlines())
    kills, hits = _count(fields.get("oom_kill", "")), _count(fields.get("oom", ""))
    if kills is None or (layout == "v2" and hits is None):
        return None
    return OomCounts(hits if layout == "v2" else None, kills)


def killed_by(before: OomCounts | None, after: OomCounts | None) -> str:
    """Why a process of this cgroup that got SIGKILL between two readings died, as the end of a
    sentence ("" when the counters do not say it was the out-of-memory killer)."""
    if before is None or after is None or after.kills <= before.kills:
        return ""
    limit = limit_bytes()
    if before.limit_hits is None or after.limit_hits is None:
        return f"out of memory (this kernel's limit is {describe(limit)}, or the server ran out)" if limit \
            else "out of memory"
    if after.limit_hits > before.limit_hits:
        return "out of memory, this kernel's processes reached their limit" + (
            f" of {describe(limit)}" if limit else "")
    return "out of memory, the server ran out (this kernel's limit was not reached)"


def limit_bytes(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int | None:
    """This cgroup's memory limit in bytes, or None (no limit, or unknown)."""
    found = _read("memory.limit_in_bytes", "memory.max", root, proc_cgroup)
    n = _count(found[2]) if found is not None else None  # None for "max": no limit
    return None if n is None or n >= NO_LIMIT_V1 else n


def describe(n: int) -> str:
    gib = n / (1 << 30)
    return f"{gib:.1f} GiB" if gib >= 1 else f"{n / (1 << 20):.0f} MiB"
