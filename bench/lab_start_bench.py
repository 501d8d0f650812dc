"""Kernel start as JupyterLab meets it: a replicated CPU kernel (3 replicas, gpuhub's provisioner,
placed by a dev cluster's scheduler) vs a plain ipykernel, both started by one real Jupyter Server.
Run: `.venv/bin/python -m bench lab-start`.

Each start does what JupyterLab does when a notebook opens: ``POST /api/sessions`` (the server
starts the kernel; gpuhub's provisioner returns once the kernel answers kernel_info), then the
kernel websocket, a ``kernel_info_request`` on it, and the kernel's ``idle`` status for that
request: the moment JupyterLab shows the kernel as Idle. Kinds alternate so machine noise hits both.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests
import websocket

from gpuhub.admin.kernelspecs import kernelspec
from gpuhub.dev.cluster import DevCluster, free_port

STARTS = 6
KINDS = {"gpuhub-cpu": "gpuhub CPU kernel, 3 replicas (provisioner)", "python3": "plain ipykernel"}


class JupyterServer:
    """A jupyter_server process on 127.0.0.1 whose kernelspecs include gpuhub's CPU kernel."""

    def __init__(self, tmp: Path, cluster: DevCluster) -> None:
        spec_dir = tmp / "share" / "jupyter" / "kernels" / "gpuhub-cpu"
        spec_dir.mkdir(parents=True)
        spec = kernelspec(0, 3, sys.executable)
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        self.port, self.token = free_port(), secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JUPYTER_PATH=str(tmp / "share" / "jupyter"), JUPYTER_TOKEN=self.token,
                   GPUHUB_SCHEDULER_URL=cluster.scheduler.url, GPUHUB_SCHEDULER_TOKEN=cluster.user_token,
                   JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
        self.log = open(tmp / "jupyter-server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", f"--ServerApp.root_dir={tmp}", "--ServerApp.port_retries=0",
             *(["--allow-root"] if os.geteuid() == 0 else [])],  # the dev VM runs benchmarks as root
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                tail = (tmp / "jupyter-server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"jupyter server exited:\n{tail}")
            try:
                if requests.get(f"{self.url}/api/status", headers=self.headers, timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError("jupyter server did not answer within 60 s")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"token {self.token}"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_until_idle(server: JupyterServer, kind: str, n: int) -> tuple[float, float]:
    """(seconds until the session exists, seconds until the kernel_info's idle), from the POST."""
    t0 = time.monotonic()
    r = requests.post(f"{server.url}/api/sessions", headers=server.headers, timeout=180, json={
        "path": f"bench-{kind}-{n}.ipynb", "type": "notebook", "name": "", "kernel": {"name": kind}})
    r.raise_for_status()
    session = r.json()
    created = time.monotonic() - t0
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{server.port}/api/kernels/{session['kernel']['id']}/channels"
        f"?session_id={uuid.uuid4().hex}", header=[f"Authorization: token {server.token}"], timeout=120)
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({"channel": "shell", "buffers": [], "metadata": {}, "content": {}, "parent_header": {},
                            "header": {"msg_id": msg_id, "msg_type": "kernel_info_request", "username": "bench",
                                       "session": uuid.uuid4().hex, "date": "", "version": "5.4"}}))
        while True:
            msg = json.loads(ws.recv())
            if (msg.get("channel") == "iopub" and msg["header"]["msg_type"] == "status"
                    and msg["parent_header"].get("msg_id") == msg_id
                    and msg["content"]["execution_state"] == "idle"):
                idle = time.monotonic() - t0
                break
    finally:
        ws.close()
        requests.delete(f"{server.url}/api/sessions/{session['id']}", headers=server.headers, timeout=60)
    return created, idle


def main() -> str:
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="gpuhub-bench-") as tmp:
        cluster = DevCluster(Path(tmp) / "cluster", nodes=3, gpus_per_node=1).start()
        server = None
        try:
            server = JupyterServer(Path(tmp) / "server", cluster)
            for kind in KINDS:  # a first start of each warms caches (bytecode, the kernelspec cache)
                start_until_idle(server, kind, -1)
            for n in range(STARTS):
                for kind in KINDS:
                    results[kind].append(start_until_idle(server, kind, n))
        finally:
            if server is not None:
                server.stop()
            cluster.stop()
    med = {kind: statistics.median(t[1] for t in results[kind]) for kind in KINDS}
    lines = ["## Kernel start in a Jupyter Server (issue #10)", "",
             f"Command: `.venv/bin/python -m bench lab-start` ({STARTS} starts each after one warm-up, alternating; "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end).", "",
             "| kernel | POST /api/sessions done, median | kernel_info answered and idle, median | all (idle) |",
             "|---|---|---|---|"]
    for kind, label in KINDS.items():
        lines.append(f"| {label} | {statistics.median(t[0] for t in results[kind]):.2f} s | {med[kind]:.2f} s "
                     f"| {', '.join(f'{t[1]:.2f}' for t in results[kind])} |")
    lines += ["", f"Ratio (idle): {med['gpuhub-cpu'] / med['python3']:.2f}× (goal ≤ 1.5×).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
