"""Kernel ports: a kernel unit's Jupyter, Raft and blob ports, from the agent's ``kernel_ports``
range, never one that a unit of this agent has (running or not yet listening)."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterable

from gpuhub.agent.units import UnitError

JUPYTER_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
KERNEL_PORT_COUNT = len(JUPYTER_PORTS) + 2  # + raft_port, blob_port


def ports_taken(connections: Iterable[dict | None]) -> set[int]:
    """Every ``*_port`` of the units' connections."""
    return {p for conn in connections if conn for k, p in conn.items() if k.endswith("_port")}


def free_ports(ip: str, n: int, first: int, last: int, taken: set[int]) -> list[int]:
    """``n`` ports in [first, last] that no unit of this agent has and nothing listens on now.

    Starts at a random point so that agents sharing one host (dev clusters) seldom try the same
    port; a port is only tested by binding it, so a unit that has not bound its ports yet is
    protected by ``taken``, not by the test."""
    span = last - first + 1
    start = secrets.randbelow(span)
    ports: list[int] = []
    for i in range(span):
        port = first + (start + i) % span
        if port in taken:
            continue
        with socket.socket() as s:
            # as the replica's own binds do (ZeroMQ, pysyncobj, the blob server): a port whose
            # last connections are in TIME_WAIT (a kernel stopped a minute ago) is free for them
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ip, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise UnitError(f"no {n} free kernel ports left in {first}-{last} on {ip} (kernel_ports in the agent's config)")


def kernel_connection(ip: str, port_range: tuple[int, int], taken: set[int]) -> dict:
    """A new kernel unit's connection (without its key): ip, 5 Jupyter ports, raft_port, blob_port."""
    ports = free_ports(ip, KERNEL_PORT_COUNT, *port_range, taken)
    return {
        "ip": ip,
        "transport": "tcp",
        "signature_scheme": "hmac-sha256",
        **dict(zip(JUPYTER_PORTS, ports[:5], strict=True)),
        "kernel_name": "",
        "raft_port": ports[5],  # Raft (pysyncobj) between the kernel's replicas
        "blob_port": ports[6],  # large values, replica to replica
    }
