"""The user's Jupyter server sends kernel messages over a websocket with Nagle's algorithm off
(gpuhub/server/websocket.py): a real Jupyter Server, a real ipykernel, a real websocket client."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket

from gpuhub.server.websocket import NoDelayChannelsConnection

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.integration.test_server_websocket.ProbedConnection"


class ProbedConnection(NoDelayChannelsConnection):
    """gpuhub's connection, which also writes its socket's TCP_NODELAY to $NODELAY_PROBE once connected."""

    def connect(self):
        done = super().connect()
        sock = self.websocket_handler.ws_connection.stream.socket
        Path(os.environ["NODELAY_PROBE"]).write_text(str(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        return done


@pytest.fixture
def server(tmp_path):
    token = secrets.token_hex(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = tmp_path / "nodelay"
    env = dict(os.environ, JUPYTER_TOKEN=token, NODELAY_PROBE=str(probe), PYTHONPATH=str(ROOT),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", f"--port={port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
         f"--ServerApp.root_dir={tmp_path}", f"--ServerApp.kernel_websocket_connection_class={PROBE}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    base, headers = f"http://127.0.0.1:{port}", {"Authorization": f"token {token}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/api", headers=headers, timeout=5).ok:
                    break
            except requests.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"jupyter server did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)  # polling a server that is starting: no event to wait on
        yield base, headers, probe
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_kernel_websocket_runs_cells_with_nagle_off(server):
    base, headers, probe = server
    kid = requests.post(f"{base}/api/kernels", headers=headers, json={"name": "python3"}, timeout=60).json()["id"]
    ws = websocket.create_connection(f"{base.replace('http', 'ws')}/api/kernels/{kid}/channels",
                                     header=[f"Authorization: token {headers['Authorization'].split()[1]}"], timeout=60)
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "u", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                       "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": "print(6 * 7)", "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        printed, reply = "", None
        while reply is None:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["header"]["msg_type"] == "stream":
                printed += msg["content"]["text"]
            elif msg["header"]["msg_type"] == "execute_reply":
                reply = msg["content"]
    finally:
        ws.close()
        requests.delete(f"{base}/api/kernels/{kid}", headers=headers, timeout=60)
    assert reply["status"] == "ok" and printed == "42\n"
    assert probe.read_text() != "0"  # the server's end of this websocket sends each message at once
