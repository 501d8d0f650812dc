"""Which kernels a user's server offers: its profile's own replicated kernel (the default for a new
notebook, for the CPU profile too) and the admin's short list of others, never every profile's."""

from __future__ import annotations

from gpuhub.hub.spawner import kernel_args


def test_a_gpu_profile_offers_its_own_kernel_first_and_the_others_listed():
    assert kernel_args({"name": "gpu2", "gpus": 2}, ["python3"]) == [
        "--MappingKernelManager.default_kernel_name=gpuhub-gpu2",
        "--KernelSpecManager.allowed_kernelspecs=gpuhub-gpu2",
        "--KernelSpecManager.allowed_kernelspecs=python3",
    ]


def test_the_cpu_profile_defaults_to_the_replicated_cpu_kernel_not_python3():
    args = kernel_args({"name": "cpu", "gpus": 0}, ["python3"])
    assert args[0] == "--MappingKernelManager.default_kernel_name=gpuhub-cpu"


def test_no_others_offers_only_the_profile_kernel():
    assert kernel_args({"name": "gpu1", "gpus": 1}, ["gpuhub-gpu1"])[1:] == [
        "--KernelSpecManager.allowed_kernelspecs=gpuhub-gpu1"]
