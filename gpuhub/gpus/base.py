"""The GPU inventory interface: what the agent needs to know about this node's GPUs.

Two backends implement it: :mod:`gpuhub.gpus.nvml` (real GPUs through nvidia-ml-py) and
:mod:`gpuhub.gpus.fake` (GPUs described in the agent's config, for machines without GPUs and tests);
:mod:`gpuhub.gpus.inventory` picks one. This is the only place where real hardware and the fake
differ: the agent sees only this interface.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        return d


class GpuInventory(Protocol):
    backend: str

    def count(self) -> int: ...

    def gpus(self) -> list[GpuInfo]:
        """A fresh reading of every GPU (memory, utilisation, processes)."""
        ...

    def device_paths(self, index: int) -> list[str]:
        """Device nodes a cell using GPU ``index`` needs (for DeviceAllow=)."""
        ...

    def shared_device_paths(self) -> list[str]:
        """Device nodes every GPU user needs whichever GPU it was granted (the driver's control
        node): open to kernel units all the time; they give access to no GPU on their own."""
        ...

    def leases_changed(self, leased: set[int]) -> None:
        """The agent's leases now hold the GPUs ``leased``. Real GPUs report their own use and
        ignore this; the fake's readings follow it."""
        ...


class NoGpus:
    """A CPU-only node."""

    backend = "none"

    def count(self) -> int:
        return 0

    def gpus(self) -> list[GpuInfo]:
        return []

    def device_paths(self, index: int) -> list[str]:
        raise IndexError(index)

    def shared_device_paths(self) -> list[str]:
        return []

    def leases_changed(self, leased: set[int]) -> None:
        pass


class GpuConfigError(ValueError):
    pass
