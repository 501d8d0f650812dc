"""What the agent remembers about a unit it started (the part systemd cannot tell it, docs/architecture.md D5)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

CONNECTION_FILE = "connection.json"
PEERS_FILE = "peers.json"  # written by PUT /api/v1/units/{name}/peers once all replicas have ports


@dataclass
class UnitRecord:
    name: str
    kind: str
    user: str
    gpus: int
    kernel_id: str = ""
    lease_token_sha256: str = ""
    created_at: float = 0.0
    connection: dict | None = None  # kernels: ip, 5 Jupyter ports, raft_port, blob_port, transport… (no key)
    replica_id: int = 0  # kernels: this replica's id in its kernel's Raft group
    key_sha256: str = ""  # kernels: a start under the same name must bring the same key
    tls: bool = False  # servers: serves https (the agent gave it this host's servers' certificate)
    # kernels: which creation of the kernel id this replica belongs to (the scheduler's nonce): a
    # kernel restarted under its id is a new one, and must not get an earlier one's unit or journal
    incarnation: str = ""


def units_to_books(units: dict[str, UnitRecord]) -> tuple[dict, dict]:
    """The state file's ``units`` and ``incarnations``. The incarnation is kept beside the records,
    not in them: releases before it read each record with ``UnitRecord(**entry)``, and a rollback
    to one must not stop its agent."""
    records, incarnations = {}, {}
    for name, u in units.items():
        records[name] = asdict(u)
        if records[name].pop("incarnation"):
            incarnations[name] = u.incarnation
    return records, incarnations


def units_from_books(records: dict, incarnations: dict) -> dict[str, UnitRecord]:
    """The records :func:`units_to_books` wrote; fields a later release added are left out (after
    a rollback), so that release's state file does not stop this agent either."""
    known = {f.name for f in fields(UnitRecord)}
    units = {}
    for name, raw in records.items():
        u = UnitRecord(**{k: v for k, v in raw.items() if k in known})
        u.incarnation = str(incarnations.get(name, u.incarnation))
        units[name] = u
    return units


def raft_addr(conn: dict | None) -> str | None:
    """``ip:raft_port`` of a kernel unit (None for units started before replication)."""
    return f"{conn['ip']}:{conn['raft_port']}" if conn and "raft_port" in conn else None


def blob_addr(conn: dict | None) -> str | None:
    return f"{conn['ip']}:{conn['blob_port']}" if conn and "blob_port" in conn else None


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()
