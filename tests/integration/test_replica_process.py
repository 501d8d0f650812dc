"""The replica process (``python -m gpuhub.kernel``) alone: it never runs on half its sockets."""

from __future__ import annotations

import socket
import subprocess
import sys

from jupyter_client.connect import write_connection_file

from gpuhub.dev.portblocks import reserve_block
from gpuhub.server.router import PORT_KEYS


def test_a_replica_whose_heartbeat_port_is_taken_exits_with_the_reason(tmp_path):
    """ipykernel binds the heartbeat port in a thread of its own and lets that thread die when the
    bind fails; the kernel then runs on, never seen alive by its router. A replica must exit."""
    with reserve_block() as block:
        ports = dict(zip(PORT_KEYS, block.take(len(PORT_KEYS)), strict=True))
        taken = socket.create_server(("127.0.0.1", ports["hb_port"]))  # someone else's, meanwhile
        conn = tmp_path / "kernel.json"
        write_connection_file(str(conn), ip="127.0.0.1", key=b"k" * 32, **ports)
        try:
            proc = subprocess.run([sys.executable, "-m", "gpuhub.kernel", "-f", str(conn)],
                                  capture_output=True, timeout=120, cwd=tmp_path)
        finally:
            taken.close()
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 3, err
    assert "heartbeat thread failed" in err and "Address already in use" in err
