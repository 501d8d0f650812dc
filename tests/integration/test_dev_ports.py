"""Port blocks of the dev harness: agents sharing one host never hand out one port twice."""

from __future__ import annotations

import socket

import pytest

from gpuhub.dev import portblocks


def test_blocks_are_exclusive_across_processes_until_closed():
    held = []  # every block that is free now (other test runs on this machine may hold some)
    try:
        with pytest.raises(RuntimeError, match="held by other dev agents"):
            while True:
                held.append(portblocks.reserve_block())
        assert held and len({b.index for b in held}) == len(held)
        assert all(b.last < 32768 for b in held)  # below the ephemeral range
        with socket.socket() as s:  # another process's bind of a sentinel fails, SO_REUSEADDR or not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                s.bind(("127.0.0.1", held[0].first - 1))
        freed = held.pop()
        freed.close()
        held.append(portblocks.reserve_block())  # the one just freed
    finally:
        for b in held:
            b.close()


def test_a_block_hands_out_each_port_once():
    with portblocks.reserve_block() as block:
        a, b = block.take(5), block.take(5)
        assert not set(a) & set(b) and a[0] == block.first
        with pytest.raises(RuntimeError, match="used up"):
            block.take(portblocks.BLOCK_SIZE)
