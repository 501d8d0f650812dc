"""Pickle frames over a pipe between a replica and its forked GPU-cell child.

A frame is a header (the pickle's length, how many out-of-band buffers follow and each one's size),
the pickle (protocol 5), then each buffer's raw bytes. Large values (a changed array of the
namespace image) travel out of band: the writer hands the kernel the memory they live in, and the
reader reads them straight into the buffer they are unpickled over, so a gigabyte crosses once
each way through the pipe instead of being copied into a pickle, a frame and a bytes object too.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import select
import struct
import threading
from collections.abc import Callable

from gpuhub.replication.blobstore import new_buffer

HEADER = struct.Struct("!QQ")  # pickle length, number of out-of-band buffers
SIZE = struct.Struct("!Q")
# Reads of the small parts; out-of-band buffers are read into their own memory.
CHUNK = 1 << 20
# A pipe holds 64 KiB unless asked: 1 MiB (the unprivileged maximum by default) means 16× fewer
# wake-ups per gigabyte for the reader.
PIPE_SIZE = 1 << 20


def widen(fd: int) -> None:
    """Ask for a larger pipe buffer; the default size works too."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (OSError, AttributeError):
        pass


class FrameWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        # a cell's threads send too (output, widget messages): one frame's writes at a time
        self._lock = threading.Lock()

    def send(self, *msg) -> None:
        raws: list[memoryview] = []
        data = pickle.dumps(msg, protocol=5, buffer_callback=lambda b: raws.append(b.raw()))
        head = memoryview(HEADER.pack(len(data), len(raws)) + b"".join(SIZE.pack(r.nbytes) for r in raws) + data)
        with self._lock:
            self._write(head)
            for raw in raws:
                self._write(raw)

    def _write(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view)
            view = view[n:]


class FrameReader:
    """``alloc(n)``: a writable buffer of n bytes to read an out-of-band buffer into (the replica
    passes its blob store's, so that a GPU cell's changed values land where the store keeps them)."""

    def __init__(self, fd: int, alloc: Callable[[int], object] = new_buffer) -> None:
        self.fd = fd
        self.alloc = alloc
        self.buf = bytearray()  # bytes read and not yet part of a frame
        self.eof = False
        self._frame: tuple[bytes, list] | None = None  # a pickle whose buffers are being read
        self._filling = 0  # which of its buffers
        self._filled = 0  # bytes of it read

    def poll(self, timeout: float) -> list[tuple]:
        """Read what is available within ``timeout`` and return the complete frames."""
        if not self.eof:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if ready:
                self._read()
        return self._frames()

    @property
    def pending(self) -> bool:
        """Bytes of a frame not complete yet are held."""
        return bool(self.buf) or self._frame is not None

    def _read(self) -> None:
        if self._frame is not None and not self.buf:
            target = memoryview(self._frame[1][self._filling])[self._filled:]
            n = os.readv(self.fd, [target])
            self._filled += n
        else:
            chunk = os.read(self.fd, CHUNK)
            n = len(chunk)
            self.buf += chunk
        if n == 0:
            self.eof = True

    def _frames(self) -> list[tuple]:
        frames = []
        while True:
            if self._frame is None:
                if len(self.buf) < HEADER.size:
                    break
                size, count = HEADER.unpack_from(self.buf)
                start = HEADER.size + SIZE.size * count
                if len(self.buf) < start + size:
                    break
                sizes = [SIZE.unpack_from(self.buf, HEADER.size + SIZE.size * i)[0] for i in range(count)]
                data = bytes(self.buf[start:start + size])
                del self.buf[:start + size]
                self._frame, self._filling, self._filled = (data, [self.alloc(n) for n in sizes]), 0, 0
            data, buffers = self._frame
            while self._filling < len(buffers):
                target = buffers[self._filling]
                if self.buf and self._filled < len(target):  # read along with the header
                    n = min(len(self.buf), len(target) - self._filled)
                    target[self._filled:self._filled + n] = self.buf[:n]
                    del self.buf[:n]
                    self._filled += n
                if self._filled < len(target):
                    return frames
                self._filling, self._filled = self._filling + 1, 0
            frames.append(pickle.loads(data, buffers=buffers))
            self._frame = None
        return frames

    def recv_blocking(self) -> tuple | None:
        while True:
            frames = self.poll(1.0)
            if frames:
                return frames[0]
            if self.eof:
                return None
