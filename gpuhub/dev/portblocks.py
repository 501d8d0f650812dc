"""Blocks of kernel ports for dev agents that share one host.

On a real server one agent hands out its ``kernel_ports`` and knows every port it gave. On a dev
machine several agents (one cluster's, and those of test runs or benchmarks side by side) share
127.0.0.1; two that hand out the same port to replicas starting at the same moment make one
replica's bind fail (its heartbeat thread, say, which ipykernel lets die quietly).

So each dev agent owns a block of ports for as long as it lives, and the ownership is held by the
operating system, across processes: the block's first port is kept bound and listening by the
process that reserved it, and the agent's range is the rest of the block. A process that dies
frees its blocks with its sockets. The blocks lie below Linux's ephemeral range (32768 and up), so
no outgoing connection takes a port between the agent's choice and the replica's bind.
"""

from __future__ import annotations

import secrets
import socket

FIRST_PORT = 20000
BLOCK_SIZE = 700
BLOCKS = 18  # 20000-32599: below the ephemeral range


class PortBlock:
    """Ports ``first``..``last`` for one process's exclusive use, held while the block is open."""

    def __init__(self, index: int, sentinel: socket.socket) -> None:
        self.index = index
        self._sentinel: socket.socket | None = sentinel
        self.first = FIRST_PORT + BLOCK_SIZE * index + 1  # the port before is the sentinel
        self.last = FIRST_PORT + BLOCK_SIZE * (index + 1) - 1
        self._next = self.first

    def take(self, n: int) -> list[int]:
        """``n`` ports of the block never taken before (for kernels started without an agent)."""
        if self._next + n - 1 > self.last:
            raise RuntimeError(f"port block {self.first}-{self.last} is used up")
        ports = list(range(self._next, self._next + n))
        self._next += n
        return ports

    def close(self) -> None:
        if self._sentinel is not None:
            self._sentinel.close()
            self._sentinel = None

    def __enter__(self) -> PortBlock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reserve_block() -> PortBlock:
    """A block no other process on this host holds now."""
    start = secrets.randbelow(BLOCKS)  # from a random block: reservations seldom race
    for i in range(BLOCKS):
        index = (start + i) % BLOCKS
        sentinel = socket.socket()
        try:
            sentinel.bind(("127.0.0.1", FIRST_PORT + BLOCK_SIZE * index))
            sentinel.listen(1)  # listening: no other socket may bind it, SO_REUSEADDR or not
        except OSError:
            sentinel.close()
            continue
        return PortBlock(index, sentinel)
    raise RuntimeError(f"all {BLOCKS} dev port blocks ({FIRST_PORT}-{FIRST_PORT + BLOCK_SIZE * BLOCKS - 1}) "
                       "are held by other dev agents on this machine: stop some dev clusters or test runs")
