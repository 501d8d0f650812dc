"""A local Jupyter Server with one plain ipykernel and a websocket to it, spoken to as JupyterLab
does (an ``execute_request`` in, messages until the reply and the idle status out): for the tests
and the benchmark of the user's server's kernel websocket (gpuhub/server/websocket.py)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
import websocket

from gpuhub.dev.portblocks import reserve_block

START_TIMEOUT_S = 60


class LocalJupyterServer:
    """``connection_class``: a dotted name for ``ServerApp.kernel_websocket_connection_class``
    ("" keeps Jupyter Server's own); ``env``: more environment for the server (and its kernel)."""

    def __init__(self, root: Path, connection_class: str = "", env: dict[str, str] | None = None) -> None:
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.ws = None
        self.log = root / "jupyter-server.log"  # a file, not a pipe nobody reads while the server runs
        self.ports = reserve_block()  # held while the server lives: no other dev process takes the port
        try:
            port = self.ports.take(1)[0]
            argv = [sys.executable, "-m", "jupyter_server", f"--port={port}", "--ServerApp.port_retries=0",
                    "--ip=127.0.0.1", "--no-browser", "--allow-root", f"--ServerApp.root_dir={root}"]
            if connection_class:
                argv.append(f"--ServerApp.kernel_websocket_connection_class={connection_class}")
            # the token through the environment, never on a command line; the runtime files (they hold
            # the token and the kernel's key) under root, not in the home directory
            env = {**os.environ, **(env or {}), "JUPYTER_TOKEN": self.token,
                   "JUPYTER_RUNTIME_DIR": str(root / "runtime")}
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(argv, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
            self.base = f"http://127.0.0.1:{port}"
            self.headers = {"Authorization": f"token {self.token}"}
            self._wait_ready()
            self.kernel_id = self._api("POST", "/api/kernels", json={"name": "python3"})["id"]
            self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{self.kernel_id}/channels",
                                                  header=[f"Authorization: token {self.token}"], timeout=60)
        except BaseException:
            self.close()
            raise
        self.session = uuid.uuid4().hex

    def _api(self, method: str, path: str, **kw) -> dict:
        r = requests.request(method, f"{self.base}{path}", headers=self.headers, timeout=60, **kw)
        r.raise_for_status()
        return r.json() if r.content else {}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if requests.get(f"{self.base}/api", headers=self.headers, timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"jupyter server did not start: {tail}")
            time.sleep(0.1)  # a server starting up has no event to wait on

    def execute(self, code: str) -> tuple[float, dict, str]:
        """Run ``code``: seconds from sending it to its reply and idle status, the reply's content,
        and what it printed on stdout."""
        msg_id = uuid.uuid4().hex
        t0 = time.perf_counter()
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "dev", "session": self.session,
                       "msg_type": "execute_request", "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        reply, idle, printed = None, False, ""
        while reply is None or not idle:
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "execute_reply":
                reply = msg["content"]
            elif kind == "status":
                idle = msg["content"]["execution_state"] == "idle"
            elif kind == "stream" and msg["content"]["name"] == "stdout":
                printed += msg["content"]["text"]
        return time.perf_counter() - t0, reply, printed

    def close(self) -> None:
        try:
            if self.ws is not None:
                self.ws.close()
        finally:
            try:
                if self.proc is not None and self.proc.poll() is None:
                    self.proc.terminate()
                    try:
                        self.proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
            finally:
                self.ports.close()

    def __enter__(self) -> LocalJupyterServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
