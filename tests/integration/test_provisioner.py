"""The Jupyter side: a kernel manager with a gpuhub kernelspec gets a kernel placed by the scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager, start_new_kernel

from gpuhub.admin.kernelspecs import install
from gpuhub.dev.cluster import DevCluster, free_port
from gpuhub.platform.http_client import ApiClientError, call_json_sync
from gpuhub.server.provisioner import KernelLaunchFailed
from tests.helpers import debugpy_adapters, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernelspecs(tmp_path, monkeypatch, cluster):
    install(str(tmp_path / "prefix"), [("cpu", 0), ("gpu1", 1)], replicas=3)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "prefix" / "share" / "jupyter"))
    monkeypatch.setenv("GPUHUB_SCHEDULER_URL", cluster["scheduler"].url)
    monkeypatch.setenv("GPUHUB_SCHEDULER_TOKEN", cluster["user_token"])
    return KernelSpecManager()


async def test_gpu_kernel_through_provisioner(kernelspecs, cluster, tmp_path):
    km = AsyncKernelManager(kernel_name="gpuhub-gpu1", kernel_spec_manager=kernelspecs)
    await km.start_kernel(cwd=str(tmp_path))
    try:
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=30)
        out = []
        reply = await kc.execute_interactive(
            "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPUHUB_NODE'])",
            output_hook=lambda m: out.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None,
            timeout=30)
        assert reply["content"]["status"] == "ok"
        uuid, node = "".join(out).split()
        agent = next(a for a in cluster["agents"] if a.name == node)
        assert uuid in [g["uuid"] for g in agent.call("GET", "/api/v1/node")[1]["gpus"]]
        assert await km.is_alive()
        # restart: the same router and ports, fresh replicas, an empty namespace everywhere
        await kc.execute_interactive("kept = 1", timeout=30)
        await km.restart_kernel(now=True)
        await kc.wait_for_ready(timeout=60)
        after = []
        reply = await kc.execute_interactive(
            "print('kept' in dir())", timeout=30,
            output_hook=lambda m: after.append(m["content"]["text"]) if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok" and "".join(after).strip() == "False"
        kc.stop_channels()
    finally:
        await km.shutdown_kernel(now=True)
    # all units gone after shutdown
    for a in cluster["agents"]:
        assert a.call("GET", "/api/v1/units")[1]["units"] == []


async def started_cpu_kernel(kernelspecs, tmp_path) -> tuple[AsyncKernelManager, object]:
    """A gpuhub CPU kernel through the provisioner, with a client whose channels answer."""
    km = AsyncKernelManager(kernel_name="gpuhub-cpu", kernel_spec_manager=kernelspecs)
    await km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=30)
    except BaseException:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
        raise
    return km, kc


async def run(kc, code: str) -> str:
    """The cell's stdout; it must succeed."""
    out = []
    reply = await kc.execute_interactive(
        code, timeout=30,
        output_hook=lambda m: out.append(m["content"]["text"]) if m["msg_type"] == "stream" else None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out)


async def test_a_kernel_shut_down_from_jupyterlab_leaves_nothing_behind(kernelspecs, cluster, tmp_path):
    """JupyterLab's "Shut Down Kernel" asks the kernel to exit (shutdown_request) and does not kill
    it when it does. Its replicas exit cleanly; the scheduler must still forget the kernel and its
    agents drop the units (and the kernel's journals, which hold the user's values) at once."""
    km, kc = await started_cpu_kernel(kernelspecs, tmp_path)
    try:
        await run(kc, "secret = 42")
    finally:
        kc.stop_channels()
    kernel_id = km.kernel_id
    # Poll the scheduler afresh each time: the kernel is then seen to have exited within
    # jupyter_client's wait, and is never killed (the path where it was left behind).
    km.provisioner.poll_cache_s = 0.0
    await km.shutdown_kernel(now=False)
    dev = cluster["dev"]
    status, _ = dev.scheduler_call("GET", f"/api/v1/kernels/{kernel_id}")
    assert status == 404
    for a in cluster["agents"]:
        assert a.call("GET", "/api/v1/units")[1]["units"] == [], a.name
        assert not list((a.dir / "state" / "journals").glob(f"*{kernel_id}*")), a.name


async def test_a_kernel_restarted_from_jupyterlab_starts_afresh(kernelspecs, cluster, tmp_path):
    """JupyterLab's "Restart Kernel" asks the kernel to exit (shutdown_request with restart) and
    starts it again under the same id once it has. The exited replicas must not be taken for the
    new kernel's (the restart failed with "3 of its 3 replicas exited")."""
    km, kc = await started_cpu_kernel(kernelspecs, tmp_path)
    try:
        await run(kc, "kept = 1")
        km.provisioner.poll_cache_s = 0.0  # the replicas are seen to exit: nothing is killed
        await km.restart_kernel(now=False)
        await kc.wait_for_ready(timeout=60)
        assert (await run(kc, "print('kept' in dir())")).strip() == "False"
        _, after = cluster["dev"].scheduler_call("GET", f"/api/v1/kernels/{km.kernel_id}")
        assert [r["state"] for r in after["replicas"]] == ["active"] * 3, after
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


def test_the_notebook_hosts_plain_kernel_has_no_debugger(tmp_path, monkeypatch):
    """The plain "python3" kernel runs on the notebook host, which every user's server shares:
    ipykernel's debugger would start debugpy there, listening on 127.0.0.1 without authentication."""
    prefix = tmp_path / "prefix"
    install(str(prefix), [("cpu", 0)], replicas=3, plain_python3=True)
    (prefix / "bin").mkdir()
    python = prefix / "bin" / "python"  # this environment's (a symlink would lose the venv)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        info = kc.kernel_info(reply=True, timeout=30)["content"]
        assert "debugger" not in info["supported_features"], info
        before = debugpy_adapters()
        for seq, command in enumerate(("initialize", "attach"), 1):  # what JupyterLab sends first
            kc.control_channel.send(kc.session.msg("debug_request", {
                "type": "request", "seq": seq, "command": command, "arguments": {"adapterID": "python"}}))
            debug = kc.control_channel.get_msg(timeout=30)["content"]
            assert debug["success"] is False and "no debugger" in debug["message"], debug
        assert debugpy_adapters() <= before  # ipykernel's starts one before it answers "initialize"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_bad_user_token_is_refused(cluster):
    with pytest.raises(ApiClientError) as exc:
        call_json_sync("POST", cluster["scheduler"].url + "/api/v1/kernels", "wrong",
                       {"kernel_id": "abc", "key": "k"}, timeout=5)
    assert exc.value.status == 401


async def test_a_replica_start_error_fails_the_launch_with_that_error(tmp_path, monkeypatch):
    """Replicas that exit at start (here: a module the kernel imports raises ImportError, as a
    missing dependency would) make the launch fail with their error, which JupyterLab shows in its
    kernel-start dialog, instead of a kernel that never answers."""
    broken = tmp_path / "broken" / "pysyncobj"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated: pysyncobj needs cryptography')\n")
    # The agents hand PYTHONPATH to their replicas; only the kernel imports pysyncobj.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(broken.parent), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    dev = DevCluster(tmp_path / "cluster").start()
    try:
        install(str(tmp_path / "prefix"), [("cpu", 0)], replicas=3)
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "prefix" / "share" / "jupyter"))
        monkeypatch.setenv("GPUHUB_SCHEDULER_URL", dev.scheduler.url)
        monkeypatch.setenv("GPUHUB_SCHEDULER_TOKEN", dev.user_token)
        km = AsyncKernelManager(kernel_name="gpuhub-cpu", kernel_spec_manager=KernelSpecManager())
        with pytest.raises(KernelLaunchFailed) as failed:
            await km.start_kernel(cwd=str(tmp_path))
        message = str(failed.value)
        assert "gpuhub could not start the kernel" in message
        assert "ImportError: simulated: pysyncobj needs cryptography" in message
        assert dev.user_token not in message
        # the launch stopped what it started
        assert call_json_sync("GET", dev.scheduler.url + "/api/v1/kernels", dev.user_token)[1]["kernels"] == []
        for a in dev.agents:
            assert a.call("GET", "/api/v1/units")[1]["units"] == []
    finally:
        dev.stop()


def test_a_jupyter_server_user_is_told_why_a_kernel_did_not_start(tmp_path):
    """Through a real Jupyter Server, as JupyterLab starts a kernel: the answer carries gpuhub's
    reason. (Jupyter Server turns an exception that is not an HTTPError into a bare "Unhandled
    error", which is all a user saw of a failed start before.)"""
    install(str(tmp_path / "prefix"), [("gpu1", 1)], replicas=3)
    token, port = os.urandom(16).hex(), free_port()
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "prefix" / "share" / "jupyter"),
           "JUPYTER_TOKEN": token, "GPUHUB_MAX_GPUS": "0", "GPUHUB_SCHEDULER_URL": "http://127.0.0.1:9",
           "GPUHUB_SCHEDULER_TOKEN": "unused", "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", "--ServerApp.open_browser=False", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.allow_root=True"],  # CI runs the tests as root
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}

        def answering():
            assert server.poll() is None, server.stderr.read().decode(errors="replace")[-2000:]
            return requests.get(f"{url}/api/status", headers=auth, timeout=5).ok

        wait_for(answering, timeout=60, what="the Jupyter server", interval=0.2, ignore=(requests.ConnectionError,))
        r = requests.post(f"{url}/api/kernels", json={"name": "gpuhub-gpu1"}, headers=auth, timeout=60)
        assert r.status_code == 400, r.text
        assert "your server's profile allows 0" in r.json()["message"], r.text
    finally:
        server.terminate()
        server.wait(timeout=30)
