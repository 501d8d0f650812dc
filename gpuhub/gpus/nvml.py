"""Real GPUs through NVML (nvidia-ml-py)."""

from __future__ import annotations

import threading

from gpuhub.gpus.base import GpuInfo, GpuProcess

# The control node every CUDA process opens, and unified memory's nodes by their driver's name
# (systemd's char-<driver>): nvidia-uvm registers its major when CUDA first loads it, after the
# agent started, and the agent's list is applied again at every grant. MIG's /dev/nvidia-caps are
# not handed out yet.
SHARED_DEVICES = ("/dev/nvidiactl", "char-nvidia-uvm")


class NvmlUnavailable(RuntimeError):
    pass


class NvmlInventory:
    backend = "nvml"
    _lock = threading.Lock()

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from exc
        self._count = pynvml.nvmlDeviceGetCount()

    def count(self) -> int:
        return self._count

    def device_paths(self, index: int) -> list[str]:
        minor = self._nvml.nvmlDeviceGetMinorNumber(self._nvml.nvmlDeviceGetHandleByIndex(index))
        return [f"/dev/nvidia{minor}"]

    def shared_device_paths(self) -> list[str]:
        return list(SHARED_DEVICES)

    def leases_changed(self, leased: set[int]) -> None:
        pass  # NVML reads the GPUs' real use

    def gpus(self) -> list[GpuInfo]:
        nv = self._nvml
        out = []
        with self._lock:
            for i in range(self._count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                try:
                    util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                except nv.NVMLError:
                    util = 0
                try:
                    procs = tuple(
                        GpuProcess(p.pid, p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                    )
                except nv.NVMLError:
                    procs = ()
                name = nv.nvmlDeviceGetName(h)
                uuid = nv.nvmlDeviceGetUUID(h)
                out.append(
                    GpuInfo(
                        index=i,
                        uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                        name=name.decode() if isinstance(name, bytes) else name,
                        memory_total_bytes=mem.total,
                        memory_used_bytes=mem.used,
                        utilization_percent=int(util),
                        processes=procs,
                    )
                )
        return out
