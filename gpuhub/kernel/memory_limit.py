"""This process's memory limit (its systemd unit's ``MemoryMax=``, a cgroup's limit) and how many
processes that limit has killed: a GPU cell's process killed by SIGKILL is then reported to the
user as out of memory, with the limit, rather than as a bare signal.

Both cgroup layouts are read: the unified one (cgroup v2, Debian 12's default: ``memory.max``,
``memory.events``) and the memory controller of cgroup v1 (hybrid hosts: ``memory.limit_in_bytes``,
``memory.oom_control``). Anything unreadable answers None: the report then names the signal only.
"""

from __future__ import annotations

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


def _read(name_v1: str, name_v2: str, root: Path, proc_cgroup: str | None) -> tuple[str, str] | None:
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for layout, d in _dirs(text, root):
        try:
            return layout, (d / (name_v1 if layout == "v1" else name_v2)).read_text()
        except OSError:
            continue
    return None


def oom_kills(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int | None:
    """How many processes of this cgroup its memory limit has killed so far, or None."""
    found = _read("memory.oom_control", "memory.events", root, proc_cgroup)
    if found is None:
        return None
    for line in found[1].splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def limit_bytes(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int | None:
    """This cgroup's memory limit in bytes, or None (no limit, or unknown)."""
    found = _read("memory.limit_in_bytes", "memory.max", root, proc_cgroup)
    if found is None or not found[1].strip().isdigit():
        return None  # "max": no limit
    n = int(found[1])
    return None if n >= NO_LIMIT_V1 else n


def describe(n: int) -> str:
    gib = n / (1 << 30)
    return f"{gib:.1f} GiB" if gib >= 1 else f"{n / (1 << 20):.0f} MiB"
