"""The GPU inventory interface: what the agent needs to know about this node's GPUs.

Two backends implement it: :mod:`gpuhub.gpus.nvml` (real GPUs through nvidia-ml-py) and
:mod:`gpuhub.gpus.fake` (GPUs described in the agent's config, for machines without GPUs and tests).
This is the only place where real hardware and the fake differ (DESIGN D8).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


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


class NoGpus:
    """A CPU-only node."""

    backend = "none"

    def count(self) -> int:
        return 0

    def gpus(self) -> list[GpuInfo]:
        return []

    def device_paths(self, index: int) -> list[str]:
        raise IndexError(index)


class GpuConfigError(ValueError):
    pass


def open_inventory(backend: str = "auto", fake: list[dict] | None = None, node_name: str = "node") -> GpuInventory:
    """Pick the backend: NVML when it finds GPUs, the fake only when configured, else none."""
    from gpuhub.gpus.fake import FakeInventory
    from gpuhub.gpus.nvml import NvmlInventory, NvmlUnavailable

    if backend not in ("auto", "nvml", "fake", "none"):
        raise GpuConfigError(f"gpus.backend must be auto, nvml, fake or none, not {backend!r}")
    if backend == "fake" or (backend == "auto" and fake):
        if not fake:
            raise GpuConfigError("gpus.backend is 'fake' but gpus.fake lists no GPUs")
        return FakeInventory.from_config(fake, node_name=node_name)
    if backend in ("auto", "nvml"):
        try:
            inv = NvmlInventory()
            if inv.count() > 0:
                return inv
            log.info("NVML found no GPUs")
        except NvmlUnavailable as exc:
            if backend == "nvml":
                raise GpuConfigError(f"gpus.backend is 'nvml' but NVML is unavailable: {exc}") from exc
            log.info("NVML unavailable (%s)", exc)
    log.warning("no GPUs on this node: serving CPU-only kernels")
    return NoGpus()
