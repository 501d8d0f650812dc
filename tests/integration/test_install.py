"""gpuhub installed as a user installs it: ``pip install .`` into a clean virtual environment (no
editable install, no development requirements, nothing of this checkout on the path), then that
environment's ``gpuhub local-kernel`` answers a real Jupyter client. A runtime dependency missing
from pyproject.toml makes the replicas fail at start, and so this test.

It needs a package index (PyPI, or the mirror pip is configured with) and skips without one; pip's
cache is used. About 20 s with a warm cache on a 2-core VM, most of it pip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient

from tests.helpers import wait_for
from tests.integration.test_local_kernel import processes_using, running

ROOT = Path(__file__).resolve().parents[2]
PIP_TIMEOUT_S = 900  # a cold cache downloads every dependency


def clean_env() -> dict[str, str]:
    """This process's environment without anything that would put this checkout or another
    environment on the new one's path."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")}


def run(argv: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_pip_install_then_local_kernel_answers_a_jupyter_client(tmp_path):
    # The sources a wheel is built from, copied: pip builds in the tree it is given.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "gpuhub", src / "gpuhub", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", venv], tmp_path, 120)
    assert made.returncode == 0, made.stderr
    python, pip = venv / "bin" / "python", [venv / "bin" / "python", "-m", "pip"]
    probe = run([*pip, "download", "--no-deps", "--dest", tmp_path / "probe", "pysyncobj==0.3.17"], tmp_path, 300)
    if probe.returncode != 0:
        pytest.skip("pip cannot reach a package index (PyPI or its configured mirror) to install gpuhub's "
                    f"dependencies: {probe.stderr.strip().splitlines()[-1:]}")
    installed = run([*pip, "install", src], tmp_path, PIP_TIMEOUT_S)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    where = run([python, "-c", "import gpuhub; print(gpuhub.__file__)"], tmp_path, 60)
    assert where.stdout.startswith(str(venv)), where  # the installed copy, not this checkout

    workdir, out, err = tmp_path / "work", tmp_path / "local-kernel.out", tmp_path / "local-kernel.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        lk = subprocess.Popen(
            [str(venv / "bin" / "gpuhub"), "local-kernel", "--replicas", "3", "--connection-file",
             str(tmp_path / "kernel.json"), "--workdir", str(workdir)],
            cwd=tmp_path, env=clean_env(), stdout=o, stderr=e, stdin=subprocess.DEVNULL, start_new_session=True)
    kc = None
    try:
        line = wait_for(lambda: out.read_text().strip() or lk.poll() is not None, timeout=180,
                        what="local-kernel's ready line")
        assert isinstance(line, str), f"local-kernel exited {lk.returncode}:\n{err.read_text()}"
        ready = json.loads(line)
        for r in ready["replicas"]:  # the replicas run the installed environment's Python
            assert Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")[0] == str(python).encode()
        kc = BlockingKernelClient()
        kc.load_connection_file(ready["connection_file"])
        kc.start_channels()
        info = kc.kernel_info(reply=True, timeout=60)
        assert info["content"]["status"] == "ok" and info["content"]["implementation"] == "gpuhub"
        msg_id = kc.execute("x = 21 * 2; x")
        results = []
        while True:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "execute_result":
                results.append(msg["content"]["data"]["text/plain"])
            elif msg["msg_type"] == "error":
                pytest.fail("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert results == ["42"]
        assert kc.get_shell_msg(timeout=60)["content"]["status"] == "ok"
    finally:
        if kc is not None:
            kc.stop_channels()
        if lk.poll() is None:
            os.killpg(lk.pid, signal.SIGTERM)
            lk.wait(60)
        left = processes_using(workdir)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert lk.returncode == 0, err.read_text()
    assert left == {} and not any(running(r["pid"]) for r in ready["replicas"])
