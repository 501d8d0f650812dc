"""Sealed images and values: what a replica keeps on disk is encrypted with the kernel's key.

A small namespace image travels inside the log (gpuhub/replication/log.py), and pysyncobj writes
the log to its journal and snapshot files. Those images hold whatever the notebook holds, a
password typed into ``getpass()`` included, so they are sealed (AES-256-GCM, a random 96-bit
nonce per image, :class:`Sealer`) with a key derived from the kernel's connection key, which only
the user's server and the replicas hold, in memory. A larger image's stream, and the large values,
travel beside the log as blobs named by their digests: such a stream is sealed before it is named
(:meth:`Sealer.seal_stream`), as an inline one is, since a digest of the plain bytes of a small
namespace could be checked against a guess. Each replica keeps the last image's blobs on its disk
(gpuhub/replication/blobdisk.py), sealed there too (:class:`ValueSealer`, another key derived from
the same one). The journal's directory is also private to the user (0700, files
0600: see :class:`gpuhub.replication.log.RaftGroup`).
"""

from __future__ import annotations

import hmac
import io
import os
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed image that this key cannot open (wrong key, or bytes changed)."""


class Sealer:
    """A kernel's images: :meth:`seal` for a stream small enough to travel inside the log,
    :meth:`seal_stream` for one that travels beside it as a blob (any size: in records)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(hmac.new(key, b"gpuhub-image-seal-v1", "sha256").digest())
        self._streams = ValueSealer(key, purpose=b"gpuhub-image-stream-v1", magic=STREAM_MAGIC)

    def seal(self, data: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, None)

    def open(self, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], None)
        except (InvalidTag, ValueError) as exc:
            raise SealError("a sealed namespace image did not open with this kernel's key") from exc

    def seal_stream(self, data: bytes) -> bytearray:
        # one AES-GCM call takes at most 2**31 - 1 bytes: a large stream goes in records, each
        # copied into one buffer as it is made (a stream may be hundreds of megabytes: the sealed
        # copy and one record at a time, not a list of records and then their join)
        view = memoryview(data).cast("B")
        sealed = bytearray(ValueSealer.sealed_size(view.nbytes))
        at = 0
        for piece in self._streams.seal(_STREAM, view):
            sealed[at:at + len(piece)] = piece
            at += len(piece)
        return sealed

    def open_stream(self, sealed) -> bytearray:
        view = memoryview(sealed).cast("B")
        n = ValueSealer.plain_size(view.nbytes)
        if n is None:
            raise SealError("a sealed namespace image of a size no sealed image has")
        plain = bytearray(n)
        self._streams.open_view(_STREAM, view, memoryview(plain))
        return plain


VALUE_MAGIC = b"gpuhub-sealed-value-v1\n"
STREAM_MAGIC = b"gpuhub-sealed-image-v1\n"  # a blob stream: never taken for a value's file at rest
VALUE_CHUNK = 8 << 20
"""Plaintext bytes per sealed record of a value on disk (each is decrypted and checked on its own)."""
TAG_BYTES = 16
_PREFIX_BYTES = 8  # random per file; the record's number makes up the rest of the 96-bit nonce


class ValueSealer:
    """Values at rest: ``VALUE_MAGIC``, an 8-byte random nonce prefix, then the value in records of
    :data:`VALUE_CHUNK` bytes, each AES-256-GCM with the prefix and its number (4 bytes) as nonce
    and, as associated data, the value's digest, its number and whether it is the last. So a record
    cannot be moved to another place, another file or another digest, nor the file cut short,
    without failing its tag."""

    def __init__(self, key: bytes, *, purpose: bytes = b"gpuhub-value-at-rest-v1", magic: bytes = VALUE_MAGIC) -> None:
        if len(magic) != len(VALUE_MAGIC):
            raise ValueError("a sealed value's magic has VALUE_MAGIC's length (one size rule: plain_size)")
        self._aead = AESGCM(hmac.new(key, purpose, "sha256").digest())
        self.magic = magic

    @staticmethod
    def _records(n: int) -> int:
        return max(1, -(-n // VALUE_CHUNK))

    @staticmethod
    def _about(d: str, i: int, last: bool) -> bytes:
        return d.encode("ascii") + i.to_bytes(4, "big") + (b"L" if last else b"M")

    def seal(self, d: str, view: memoryview) -> Iterator[bytes]:
        """The sealed file of value ``d`` (``view``: its bytes), in pieces to write in turn."""
        prefix = os.urandom(_PREFIX_BYTES)
        yield self.magic + prefix
        count = self._records(len(view))
        for i in range(count):
            chunk = view[i * VALUE_CHUNK:(i + 1) * VALUE_CHUNK]
            yield self._aead.encrypt(prefix + i.to_bytes(4, "big"), chunk, self._about(d, i, i == count - 1))

    @staticmethod
    def sealed_size(n: int) -> int:
        return len(VALUE_MAGIC) + _PREFIX_BYTES + n + ValueSealer._records(n) * TAG_BYTES

    @staticmethod
    def plain_size(sealed_size: int) -> int | None:
        """The value's length in a sealed file of ``sealed_size`` bytes (None: not one)."""
        body = sealed_size - len(VALUE_MAGIC) - _PREFIX_BYTES
        if body < TAG_BYTES:
            return None
        count = -(-body // (VALUE_CHUNK + TAG_BYTES))
        n = body - count * TAG_BYTES
        return n if n >= 0 and ValueSealer._records(n) == count else None

    def open_into(self, d: str, f: io.BufferedIOBase, dest: memoryview) -> None:
        """Decrypt the sealed file ``f`` (read from its start) of value ``d`` into ``dest``, its
        whole length. Raises :class:`SealError` if it is not one, or a record fails its tag."""
        record = bytearray(min(len(dest), VALUE_CHUNK) + TAG_BYTES)

        def read(size: int) -> memoryview:
            sealed = memoryview(record)[:size]
            if f.readinto(sealed) != size:
                raise SealError("a sealed value cut short")
            return sealed

        self._open(d, f.read(len(VALUE_MAGIC) + _PREFIX_BYTES), read, dest)
        if f.read(1):
            raise SealError("a sealed value with bytes after its end")

    def open_view(self, d: str, view: memoryview, dest: memoryview) -> None:
        """As :meth:`open_into`, from sealed bytes in memory (no copy of them)."""
        at = len(VALUE_MAGIC) + _PREFIX_BYTES

        def read(size: int) -> memoryview:
            nonlocal at
            at += size
            if at > view.nbytes:
                raise SealError("a sealed value cut short")
            return view[at - size:at]

        self._open(d, bytes(view[:at]), read, dest)
        if at != view.nbytes:
            raise SealError("a sealed value with bytes after its end")

    def _open(self, d: str, head: bytes, read, dest: memoryview) -> None:
        if head[:len(self.magic)] != self.magic or len(head) != len(self.magic) + _PREFIX_BYTES:
            raise SealError("not a sealed value")
        prefix, n = head[len(self.magic):], len(dest)
        count = self._records(n)
        for i in range(count):
            size = min(VALUE_CHUNK, n - i * VALUE_CHUNK)
            sealed = read(size + TAG_BYTES)
            try:
                self._aead.decrypt_into(prefix + i.to_bytes(4, "big"), sealed, self._about(d, i, i == count - 1),
                                        dest[i * VALUE_CHUNK:i * VALUE_CHUNK + size])
            except (InvalidTag, ValueError) as exc:
                raise SealError(f"a sealed value of {d[:16]}… did not open with this kernel's key") from exc


_STREAM = "image-stream"  # what a stream's records are bound to (its blob's name is the digest of them)
