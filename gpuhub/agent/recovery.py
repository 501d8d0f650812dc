"""What an agent restart needs to stop nothing and forget nothing (docs/architecture.md D5): its state file,
units systemd runs that the state file lost, and which leases still have a live holder.

The :class:`~gpuhub.agent.service.Agent` runs these steps in :meth:`~gpuhub.agent.service.Agent.recover`.
"""

from __future__ import annotations

import json
import logging
import os
import time

from gpuhub.agent.leases import Lease
from gpuhub.agent.records import CONNECTION_FILE, UnitRecord, sha256
from gpuhub.agent.units import SystemdRunner as UnitRunner  # ProcessRunner is one too
from gpuhub.platform.curve import without_keys
from gpuhub.platform.store import CorruptStore, JsonStore

log = logging.getLogger(__name__)


def load_state(store: JsonStore) -> dict:
    """The state file's document; ``{}`` if there is none, or if it is corrupt (then it is kept
    aside as ``state.corrupt-<time>`` and the agent rebuilds from systemd)."""
    try:
        data = store.load()
    except CorruptStore:
        bad = store.path.with_suffix(f".corrupt-{int(time.time())}")
        os.replace(store.path, bad)
        log.error("state file was corrupt; kept it as %s and rebuilt from systemd", bad)
        return {}
    return {} if data is None else data


def read_connection(runner: UnitRunner, name: str) -> dict | None:
    """A kernel unit's connection file, without its keys."""
    try:
        conn = json.loads((runner.unit_dir(name) / CONNECTION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return without_keys(conn) if isinstance(conn, dict) else None


async def adopt_unit(runner: UnitRunner, name: str) -> UnitRecord:
    """The record of a unit systemd runs but the state file lost, from its environment file."""
    env = runner.read_env(name)
    token = env.get("GPUHUB_LEASE_TOKEN", "")
    return UnitRecord(
        name=name,
        kind=name.split("-")[1],
        user=(await runner.status(name)).user or "",
        gpus=int(env.get("GPUHUB_KERNEL_GPUS", "0") or 0),
        kernel_id=env.get("GPUHUB_KERNEL_ID", ""),
        lease_token_sha256=sha256(token) if token else "",
        created_at=time.time(),
        connection=read_connection(runner, name),
        replica_id=int(env.get("GPUHUB_REPLICA_ID", "0") or 0),
        incarnation=env.get("GPUHUB_KERNEL_INCARNATION", ""),
    )


async def gone_for_good(runner: UnitRunner, name: str) -> bool:
    """systemd restarts crashed kernel units itself, and a reboot drops transient units: a unit
    that is gone or inactive will not come back (the scheduler replaces its replica)."""
    st = await runner.status(name)
    return not st.active and st.state in ("gone", "inactive")


def saved_leases(raw: list[dict]) -> list[Lease]:
    """Every lease the state file lists (those whose entry cannot be read are skipped)."""
    out = []
    for d in raw:
        try:
            out.append(Lease.from_dict(d))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def live_leases(leases: list[Lease], units: dict[str, UnitRecord]) -> list[Lease]:
    """The saved leases whose holder unit is still known and whose holder process still runs."""
    return [lease for lease in leases if lease.holder in units and pid_alive(lease.holder_pid)]


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return True  # no pid to check: the unit check decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
