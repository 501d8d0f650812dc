"""GPU inventory: the fake and NVML backends behind one interface; backend choice; clear errors."""

from __future__ import annotations

import pytest

from gpuhub.gpus.base import GpuConfigError, NoGpus
from gpuhub.gpus.fake import FakeInventory, fake_uuid
from gpuhub.gpus.inventory import open_inventory
from gpuhub.gpus.nvml import NvmlInventory, NvmlUnavailable


def nvml_gpu_count() -> int:
    try:
        return NvmlInventory().count()
    except NvmlUnavailable:
        return 0


def test_fake_inventory_shape():
    inv = open_inventory("auto", [{"name": "Fake A100", "memory_mib": 40960}] * 2, node_name="gpu1")
    assert inv.backend == "fake" and inv.count() == 2
    gpus = inv.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].uuid == fake_uuid("gpu1", 0) and gpus[0].uuid.startswith("GPU-")
    assert len({g.uuid for g in gpus}) == 2
    assert fake_uuid("gpu2", 0) != gpus[0].uuid  # unique across nodes
    assert gpus[0].memory_total_bytes == 40960 * 1024 * 1024
    inv.leases_changed({1})
    assert inv.gpus()[1].utilization_percent == 100 and inv.gpus()[0].utilization_percent == 0


@pytest.mark.parametrize("fake,message", [
    ([{"name": "x", "memory_mib": -1}], "positive integer"),
    ([{"name": "x", "vram": 1}], "unknown key"),
    (["A100"], "must be a table"),
    ([{"name": "x", "device": "/tmp/gpu0"}], r"device must be a path under /dev/, not '/tmp/gpu0'"),
])
def test_fake_config_errors(fake, message):
    with pytest.raises(GpuConfigError, match=message):
        FakeInventory.from_config(fake, "n")


def test_backend_choice_and_errors():
    with pytest.raises(GpuConfigError, match="auto, nvml, fake or none"):
        open_inventory("cuda")
    with pytest.raises(GpuConfigError, match="lists no GPUs"):
        open_inventory("fake", [])
    assert isinstance(open_inventory("none"), NoGpus)
    if nvml_gpu_count() == 0:
        assert isinstance(open_inventory("auto"), NoGpus)  # neither → a CPU-only node
        with pytest.raises(GpuConfigError, match="NVML is unavailable"):
            open_inventory("nvml")


@pytest.mark.gpu
@pytest.mark.skipif(nvml_gpu_count() == 0, reason="no NVIDIA GPU found by NVML")
def test_nvml_backend_reads_real_gpus():
    inv = open_inventory("auto")
    assert inv.backend == "nvml"
    for g in inv.gpus():
        assert g.uuid.startswith(("GPU-", "MIG-")) and g.memory_total_bytes > 0
        assert 0 <= g.utilization_percent <= 100
        assert inv.device_paths(g.index)[0].startswith("/dev/nvidia")
