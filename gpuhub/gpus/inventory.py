"""Which GPU inventory backend an agent uses (see :mod:`gpuhub.gpus.base` for the interface)."""

from __future__ import annotations

import logging

from gpuhub.gpus.base import GpuConfigError, GpuInventory, NoGpus
from gpuhub.gpus.fake import FakeInventory
from gpuhub.gpus.nvml import NvmlInventory, NvmlUnavailable

log = logging.getLogger(__name__)


def open_inventory(backend: str = "auto", fake: list[dict] | None = None, node_name: str = "node") -> GpuInventory:
    """Pick the backend: NVML when it finds GPUs, the fake only when configured, else none."""

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
    if backend == "none":  # a host that serves notebooks only
        log.info("no GPU inventory on this node (gpus.backend is 'none')")
    else:
        log.warning("no GPUs on this node: serving CPU-only kernels")
    return NoGpus()
