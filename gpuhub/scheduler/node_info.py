"""What a server's heartbeat may say about it, checked before the scheduler keeps any of it.

A heartbeat is kept in the books and read by placement, the pool, quotas, ``gpuhub nodes`` and the
metrics; one malformed field (``"gpu_count": "x"``) would break all of them for as long as the
record lives. So a heartbeat is parsed whole here and refused whole (400) when it does not fit, and
books written before this check are checked again when they are loaded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gpuhub.platform.schema import Body, BodyError, invalid, parse

NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$"
# More GPUs, leases or units than any server has: a heartbeat saying so is not a server's.
MAX_GPUS = 1024
MAX_ITEMS = 100_000


class LeaseInfo(Body):
    """One GPU lease as an agent reports it (gpuhub/agent/leases.py ``Lease.to_dict``)."""

    lease_id: str = Field(max_length=128)
    holder: str = Field(max_length=256)
    gpus: list[int] = Field(max_length=MAX_GPUS)
    granted_at: float
    holder_pid: int | None = None
    expires_at: float | None = None
    user: str = Field("", max_length=256)
    kernel_id: str = Field("", max_length=128)
    # lingering: no cell runs under it (its kernel's last cell's process keeps the GPUs warm)
    lingering_pid: int | None = None
    lingering_since: float | None = None


class NodeCounts(Body):
    """A server's GPU counts, in a heartbeat or in the agent's ``GET /api/v1/node`` answer."""

    gpu_count: int = Field(0, ge=0, le=MAX_GPUS)
    pending: int = Field(0, ge=0)
    committed: int = Field(0, ge=0, le=MAX_GPUS)
    lingering: int = Field(0, ge=0, le=MAX_GPUS)  # held between a kernel's cells, taken back on demand


class NodeInfo(NodeCounts):
    """A heartbeat's fields (gpuhub/agent/service.py ``Agent.node_info``), without its usage batch."""

    node: str = Field(pattern=NODE_NAME_PATTERN)
    url: str = Field(max_length=2048)
    roles: list[Literal["gpu", "notebook"]] = Field(default_factory=lambda: ["gpu"], max_length=2)
    gpu_backend: str = Field("", max_length=64)
    gpus: list[dict] = Field(default_factory=list, max_length=MAX_GPUS)
    leases: list[LeaseInfo] = Field(default_factory=list, max_length=MAX_ITEMS)
    units: int = Field(0, ge=0, le=MAX_ITEMS)
    version: str = Field("", max_length=128)
    release: str = Field("", max_length=256)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or any(c.isspace() for c in v):
            raise invalid(f"field 'url' must be an http(s) URL, not {v[:80]!r}")
        return v


def parse_node_info(info: object) -> dict:
    """The heartbeat ``info`` as the books keep it (unknown fields dropped); ValueError naming the
    first field that is wrong."""
    try:
        return parse(NodeInfo, info).model_dump()
    except BodyError as exc:
        raise ValueError(f"malformed heartbeat: {exc}") from None


def parse_counts(info: dict) -> dict:
    """The GPU counts a ``GET /api/v1/node`` answer gives ({} when one of them is malformed)."""
    try:
        return parse(NodeCounts, info).model_dump(exclude_unset=True)
    except BodyError:
        return {}
