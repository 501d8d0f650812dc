"""The user's Jupyter server sends kernel messages over a websocket with Nagle's algorithm off
(gpuhub/server/websocket.py): a real Jupyter Server, a real ipykernel, a real websocket client."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gpuhub.dev.jupyter_server import LocalJupyterServer
from gpuhub.server.websocket import NoDelayChannelsConnection

ROOT = Path(__file__).resolve().parents[2]


class ProbedConnection(NoDelayChannelsConnection):
    """gpuhub's connection, which also writes its socket's TCP_NODELAY to $NODELAY_PROBE once connected."""

    def connect(self):
        done = super().connect()
        sock = self.websocket_handler.ws_connection.stream.socket
        Path(os.environ["NODELAY_PROBE"]).write_text(str(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        return done


def test_a_kernel_websocket_runs_cells_with_nagle_off(tmp_path):
    probe = tmp_path / "nodelay"
    with LocalJupyterServer(tmp_path, f"{__name__}.ProbedConnection",
                            env={"NODELAY_PROBE": str(probe), "PYTHONPATH": str(ROOT)}) as server:
        _, reply, printed = server.execute("print(6 * 7)")
    assert reply["status"] == "ok" and printed == "42\n"
    assert probe.read_text() != "0"  # the server's end of this websocket sends each message at once
