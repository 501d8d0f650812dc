"""What the agent remembers about a unit it started (the part systemd cannot tell it, docs/architecture.md D5)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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


def raft_addr(conn: dict | None) -> str | None:
    """``ip:raft_port`` of a kernel unit (None for units started before replication)."""
    return f"{conn['ip']}:{conn['raft_port']}" if conn and "raft_port" in conn else None


def blob_addr(conn: dict | None) -> str | None:
    return f"{conn['ip']}:{conn['blob_port']}" if conn and "blob_port" in conn else None


def sha256(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()
