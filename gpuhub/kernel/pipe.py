"""Length-prefixed pickle frames over a pipe between a replica and its forked GPU-cell child."""

from __future__ import annotations

import os
import pickle
import select
import struct

HEADER = struct.Struct("!Q")


class FrameWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, *msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(HEADER.pack(len(data)) + data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]


class FrameReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def poll(self, timeout: float) -> list[tuple]:
        """Read what is available within ``timeout`` and return the complete frames."""
        if not self.eof:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if ready:
                chunk = os.read(self.fd, 1 << 20)
                if chunk:
                    self.buf += chunk
                else:
                    self.eof = True
        frames = []
        while len(self.buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + size:
                break
            frames.append(pickle.loads(bytes(self.buf[HEADER.size:HEADER.size + size])))
            del self.buf[:HEADER.size + size]
        return frames

    def recv_blocking(self) -> tuple | None:
        while True:
            frames = self.poll(1.0)
            if frames:
                return frames[0]
            if self.eof:
                return None
