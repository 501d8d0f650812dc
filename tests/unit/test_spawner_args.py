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


def test_the_form_shows_each_profiles_description_escaped():
    from gpuhub.hub.spawner import GpuhubSpawner

    form = GpuhubSpawner(profiles=[
        {"name": "cpu", "display": "CPU only", "gpus": 0, "description": "pandas <b>and</b> friends"},
        {"name": "gpu1", "display": "1 GPU", "gpus": 1},
    ])._options_form_default()
    assert "pandas &lt;b&gt;and&lt;/b&gt; friends" in form and "<b>" not in form
    assert form.count("<small") == 1  # no empty line under a profile without one


def test_the_notebook_host_a_server_went_to_survives_a_hub_restart():
    """JupyterHub keeps the spawner's state in its database: a restarted hub asks the same host."""
    from gpuhub.hub.spawner import GpuhubSpawner

    first = GpuhubSpawner(agent_url="http://10.0.0.1:8601")
    first.job_id, first.job_agent = "gpuhub-server-alice", "http://10.0.0.2:8601"
    again = GpuhubSpawner(agent_url="http://10.0.0.1:8601")
    again.load_state(first.get_state())
    assert again.state_gethost() == "10.0.0.2"
    again.clear_state()
    assert again.state_gethost() == "10.0.0.1"  # nothing running: the default host


def test_the_servers_websocket_class_is_importable_as_named():
    """A typo in the dotted name would stop every user's server at start."""
    from importlib import import_module

    from jupyter_server.services.kernels.connection.base import BaseKernelWebsocketConnection

    from gpuhub.hub.spawner import SERVER_ARGS

    (arg,) = [a for a in SERVER_ARGS if a.startswith("--ServerApp.kernel_websocket_connection_class=")]
    module, _, name = arg.split("=", 1)[1].rpartition(".")
    assert issubclass(getattr(import_module(module), name), BaseKernelWebsocketConnection)


def test_servers_never_add_ipykernels_own_python3_kernelspec(tmp_path):
    """Only the python3 kernelspec the kernelspecs role writes (ipykernel without its debugger) is
    offered, or none: jupyter_client would otherwise add ipykernel's own where the role hid it."""
    from jupyter_client.kernelspec import KernelSpecManager
    from traitlets.config.loader import KVArgParseConfigLoader

    from gpuhub.hub.spawner import SERVER_ARGS

    config = KVArgParseConfigLoader([a for a in SERVER_ARGS if a.startswith("--KernelSpecManager.")]).load_config()
    assert KernelSpecManager(kernel_dirs=[str(tmp_path)]).find_kernel_specs() != {}  # the default adds it
    assert KernelSpecManager(config=config, kernel_dirs=[str(tmp_path)]).find_kernel_specs() == {}


async def test_the_forms_profile_is_checked_before_the_spawn_and_not_reported_unhandled(caplog):
    """JupyterHub 5.3+ runs apply_user_options first; without one it logged "Received unhandled
    user_options ... profile" on every spawn."""
    import logging

    import pytest

    from gpuhub.hub.spawner import GpuhubSpawner

    spawner = GpuhubSpawner()
    spawner.user_options = {"profile": "gpu1"}
    with caplog.at_level(logging.WARNING):
        await spawner._run_apply_user_options(spawner.user_options)
    assert not [r for r in caplog.records if "unhandled" in r.getMessage()]
    spawner.user_options = {"profile": "gpu99"}
    with pytest.raises(Exception, match="gpu99"):
        await spawner._run_apply_user_options(spawner.user_options)
