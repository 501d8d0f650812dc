"""Fake GPUs described in the agent's config: the same interface as the NVML backend.

Nothing executes on them. Memory and utilisation readings follow the leases the agent reports
(``leases_changed``), so dashboards and tests see a GPU "working" while a cell holds it. A fake GPU
may name a device node (``device``, e.g. a character device of a major no driver serves): the
agent then opens and closes it per grant as it does ``/dev/nvidiaN``, so device access can be
tested without a GPU (opening it gives ENXIO where allowed, EPERM where the unit's cgroup refuses).
"""

from __future__ import annotations

import hashlib
import uuid as uuidlib

from gpuhub.gpus.base import GpuConfigError, GpuInfo

MIB = 1024 * 1024


def fake_uuid(node_name: str, index: int) -> str:
    """Stable, node-unique, NVML-shaped UUID (``GPU-xxxxxxxx-…``)."""
    digest = hashlib.sha256(f"gpuhub-fake:{node_name}:{index}".encode()).digest()[:16]
    return "GPU-" + str(uuidlib.UUID(bytes=digest))


class FakeInventory:
    backend = "fake"

    def __init__(self, specs: list[tuple[str, int, str]], node_name: str) -> None:
        self._specs = specs
        self._node = node_name
        self._busy: set[int] = set()

    @classmethod
    def from_config(cls, fake: list[dict], node_name: str) -> FakeInventory:
        specs = []
        for i, entry in enumerate(fake):
            if not isinstance(entry, dict):
                raise GpuConfigError(f"gpus.fake[{i}] must be a table like {{ name = \"…\", memory_mib = 40960 }}")
            unknown = set(entry) - {"name", "memory_mib", "device"}
            if unknown:
                raise GpuConfigError(f"gpus.fake[{i}]: unknown key(s) {sorted(unknown)}")
            mem = entry.get("memory_mib", 16384)
            if not isinstance(mem, int) or mem <= 0:
                raise GpuConfigError(f"gpus.fake[{i}].memory_mib must be a positive integer, not {mem!r}")
            device = entry.get("device", "")
            if not isinstance(device, str) or (device and not device.startswith("/dev/")):
                raise GpuConfigError(f"gpus.fake[{i}].device must be a path under /dev/, not {device!r}")
            specs.append((str(entry.get("name", "Fake GPU")), mem, device))
        return cls(specs, node_name)

    def count(self) -> int:
        return len(self._specs)

    def device_paths(self, index: int) -> list[str]:
        device = self._specs[index][2]  # IndexError for a GPU that does not exist
        return [device] if device else []

    def shared_device_paths(self) -> list[str]:
        return []

    def leases_changed(self, indices: set[int]) -> None:
        self._busy = set(indices)

    def gpus(self) -> list[GpuInfo]:
        return [
            GpuInfo(
                index=i,
                uuid=fake_uuid(self._node, i),
                name=name,
                memory_total_bytes=mem * MIB,
                memory_used_bytes=(mem * MIB) // 4 if i in self._busy else 0,
                utilization_percent=100 if i in self._busy else 0,
            )
            for i, (name, mem, _device) in enumerate(self._specs)
        ]
