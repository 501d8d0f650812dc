"""Large buffer-backed values as a pickle stream plus their raw buffers, in one blob.

A changed 1 GiB numpy array used to cross replicas as one in-band pickle: the executor copied it
into the pickle, every follower copied it back out with ``pickle.loads`` (holding the GIL for
seconds, which starved the follower's Raft thread). With pickle protocol 5 the array's memory is
handed to a ``buffer_callback`` instead (out of band), and the blob becomes:

``header | buffer table | pickle stream | zero padding | buffer 0 | padding | buffer 1 | …``

- header (:data:`HEADER`, big-endian): :data:`MAGIC` (8 bytes), buffer count (u32), alignment
  (u32, always :data:`ALIGN`), stream length (u64), total blob length (u64);
- buffer table: one ``offset (u64) | length (u64)`` per buffer, in pickle order;
- every buffer starts at a multiple of :data:`ALIGN` (4096, the page size) from the blob's start,
  so a receiver that holds the blob in a file (a memfd) can map each buffer on its own, privately
  (copy-on-write), and a receiver holding it in memory gets page-aligned arrays;
- the blob ends where the last buffer ends; padding bytes are zero.

The blob's digest (``digest.digest``) covers all of these bytes: exactly what travels, header and
padding included. :func:`parse` checks the layout before anything is unpickled and raises
:class:`LayoutError` (a ``ValueError``) on any inconsistency: a wrong magic, a table or stream
past the end, a misaligned, overlapping or out-of-order buffer, or trailing bytes.

Values whose out-of-band buffers are all small (< :data:`OOB_MIN_BYTES`) stay plain in-band
pickles, byte for byte what they were before: an in-band pickle never starts with :data:`MAGIC`
(protocol 2+ pickles start with ``0x80``), so :func:`is_layout` tells the two apart.

Which values go out of band: whatever the pickler hands to ``buffer_callback`` as a contiguous
``PickleBuffer`` — numpy arrays of plain dtypes (C or Fortran order), wherever they sit in the
value, and a ``bytearray`` that *is* the value (:class:`_BytearrayOutOfBand`; a bytearray owns
its memory, so the receiver copies it once). Everything else is pickled in band as before.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass

import cloudpickle

__all__ = ["ALIGN", "MAGIC", "OOB_MIN_BYTES", "Layout", "LayoutError", "copy_into", "dumps",
           "is_layout", "loads", "parse"]

MAGIC = b"GPHOOB\x00\x01"
ALIGN = 4096
OOB_MIN_BYTES = 1 << 20
"""Buffers smaller than this stay in the pickle stream (framing them would not pay)."""
HEADER = struct.Struct("!8sIIQQ")
ENTRY = struct.Struct("!QQ")
MAX_BUFFERS = 1 << 20
COPY_STEP = 64 << 20  # copy in steps so another thread may take the GIL between them, if needed


class LayoutError(ValueError):
    """A blob that claims to be a layout but is not a valid one."""


@dataclass
class Layout:
    """A value ready to be written as a blob: the head (header, table, stream) and the raw
    buffers, each to be placed at ``offsets[i]``. Buffers still alias the value's memory."""

    head: bytes
    buffers: list[memoryview]
    offsets: list[int]
    nbytes: int

    def write_into(self, dest: memoryview) -> None:
        """Write the whole blob into ``dest`` (``nbytes`` long, writable): one copy of each
        buffer, made without holding the GIL when numpy is available."""
        self.write_range(dest, 0, self.nbytes)

    def write_range(self, dest: memoryview, lo: int, hi: int) -> None:
        """Write bytes ``lo:hi`` of the blob into the same range of ``dest``, so a caller can
        hash each part while the next one is written (``digest.fill_and_digest``)."""
        dest = dest.cast("B") if dest.format != "B" else dest
        if len(dest) != self.nbytes:
            raise ValueError(f"destination is {len(dest)} bytes, the layout {self.nbytes}")
        pieces = [(0, memoryview(self.head))]
        for buf, off in zip(self.buffers, self.offsets, strict=False):
            pieces.append((off, buf))
        end = 0
        for start, piece in pieces:
            _zero(dest, max(lo, end), min(hi, start))  # padding before this piece
            a, b = max(lo, start), min(hi, start + len(piece))
            if a < b:
                copy_into(dest[a:b], piece[a - start:b - start])
            end = start + len(piece)

    def to_bytes(self) -> bytes:
        out = bytearray(self.nbytes)
        self.write_into(memoryview(out))
        return bytes(out)


def _zero(dest: memoryview, lo: int, hi: int) -> None:
    if lo < hi:
        dest[lo:hi] = bytes(hi - lo)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def copy_into(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` for byte views, in GIL-free steps where numpy is importable (numpy's
    copy releases the GIL; a memoryview slice assignment would hold it for the whole copy)."""
    try:
        import numpy as np
    except ImportError:
        dest[:] = src
        return
    d = np.frombuffer(dest, dtype=np.uint8)
    s = np.frombuffer(src, dtype=np.uint8)
    if len(d) != len(s):
        raise ValueError(f"copy of {len(s)} bytes into {len(d)}")
    for i in range(0, len(s), COPY_STEP):
        np.copyto(d[i:i + COPY_STEP], s[i:i + COPY_STEP])


class _BytearrayOutOfBand:
    """Pickles as the bytearray it wraps, with its bytes out of band (the C pickler saves exact
    bytearrays in band and offers no hook for them, so only a top-level value is wrapped)."""

    def __init__(self, data: bytearray) -> None:
        self.data = data

    def __reduce_ex__(self, protocol):
        return bytearray, (pickle.PickleBuffer(self.data),)


def dumps(value, *, min_oob: int = OOB_MIN_BYTES) -> bytes | Layout:
    """Pickle ``value`` (cloudpickle, protocol 5). Buffers of at least ``min_oob`` bytes go out
    of band: the result is then a :class:`Layout` (still aliasing the value's memory: write it
    out before the value may change); otherwise the plain in-band pickle, as bytes."""
    buffers: list[memoryview] = []

    def take(pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()  # contiguous bytes of the buffer; BufferError if not contiguous
        except BufferError:
            return True  # in band
        if raw.nbytes < min_oob:
            return True
        buffers.append(raw)
        return False

    if type(value) is bytearray and len(value) >= min_oob:
        value = _BytearrayOutOfBand(value)
    out = io.BytesIO()
    cloudpickle.Pickler(out, protocol=5, buffer_callback=take).dump(value)
    stream = out.getvalue()
    if not buffers:
        return stream
    table_end = HEADER.size + ENTRY.size * len(buffers)
    offsets, pos = [], table_end + len(stream)
    for buf in buffers:
        pos = _align(pos)
        offsets.append(pos)
        pos += buf.nbytes
    head = b"".join([HEADER.pack(MAGIC, len(buffers), ALIGN, len(stream), pos),
                     *(ENTRY.pack(off, buf.nbytes) for off, buf in zip(offsets, buffers, strict=False)),
                     stream])
    return Layout(head, buffers, offsets, pos)


def is_layout(blob) -> bool:
    return bytes(memoryview(blob)[:len(MAGIC)]) == MAGIC


def parse(blob) -> tuple[memoryview, list[tuple[int, int]]]:
    """The pickle stream (a view into ``blob``) and each buffer's ``(offset, length)``, after
    checking the whole layout. Raises :class:`LayoutError`."""
    mv = memoryview(blob)
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    n = len(mv)
    if n < HEADER.size:
        raise LayoutError(f"blob of {n} bytes is shorter than the layout header")
    magic, count, align, stream_len, total = HEADER.unpack(mv[:HEADER.size])
    if magic != MAGIC:
        raise LayoutError("not an out-of-band layout (wrong magic)")
    if align != ALIGN:
        raise LayoutError(f"layout alignment {align} is not {ALIGN}")
    if total != n:
        raise LayoutError(f"layout says {total} bytes, the blob has {n}")
    if count > MAX_BUFFERS:
        raise LayoutError(f"layout claims {count} buffers (at most {MAX_BUFFERS})")
    stream_at = HEADER.size + ENTRY.size * count
    if stream_at + stream_len > n:
        raise LayoutError("buffer table or pickle stream runs past the end of the blob")
    spans, end = [], stream_at + stream_len
    for i in range(count):
        off, length = ENTRY.unpack_from(mv, HEADER.size + i * ENTRY.size)
        if off % ALIGN:
            raise LayoutError(f"buffer {i} at offset {off} is not aligned to {ALIGN} bytes")
        if off < end:
            raise LayoutError(f"buffer {i} at offset {off} overlaps what precedes it (ends at {end})")
        if off + length > n:
            raise LayoutError(f"buffer {i} ({length} bytes at {off}) runs past the end of the blob")
        spans.append((off, length))
        end = off + length
    if end != n:
        raise LayoutError(f"{n - end} stray bytes after the last buffer")
    return mv[stream_at:stream_at + stream_len], spans


def loads(blob, buffer_at: Callable[[int, int], object] | None = None):
    """Rebuild a value from a layout blob. ``buffer_at(offset, length)`` supplies each buffer
    (the default: views into ``blob`` itself, so the value shares that memory — the caller must
    know that is safe, see gpuhub/kernel/replica.py)."""
    stream, spans = parse(blob)
    mv = memoryview(blob).cast("B")
    if buffer_at is None:
        buffers = [mv[off:off + length] for off, length in spans]
    else:
        buffers = [buffer_at(off, length) for off, length in spans]
    return pickle.loads(stream, buffers=buffers)

