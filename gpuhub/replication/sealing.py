"""Sealed images and values: what a replica keeps on disk is encrypted with the kernel's key.

A small namespace image travels inside the log (gpuhub/replication/log.py), and pysyncobj writes
the log to its journal and snapshot files. Those images hold whatever the notebook holds, a
password typed into ``getpass()`` included, so they are sealed (AES-256-GCM, a random 96-bit
nonce per image, :class:`Sealer`) with a key derived from the kernel's connection key, which only
the user's server and the replicas hold, in memory. A larger image's stream, and the large values,
travel beside the log and each replica keeps those of the last image on its disk
(gpuhub/replication/blobdisk.py): they are sealed there too (:class:`ValueSealer`, another key
derived from the same one). The journal's directory is also private to the user (0700, files
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
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(hmac.new(key, b"gpuhub-image-seal-v1", "sha256").digest())

    def seal(self, data: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, None)

    def open(self, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], None)
        except (InvalidTag, ValueError) as exc:
            raise SealError("a sealed namespace image did not open with this kernel's key") from exc


VALUE_MAGIC = b"gpuhub-sealed-value-v1\n"
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

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(hmac.new(key, b"gpuhub-value-at-rest-v1", "sha256").digest())

    @staticmethod
    def _records(n: int) -> int:
        return max(1, -(-n // VALUE_CHUNK))

    @staticmethod
    def _about(d: str, i: int, last: bool) -> bytes:
        return d.encode("ascii") + i.to_bytes(4, "big") + (b"L" if last else b"M")

    def seal(self, d: str, view: memoryview) -> Iterator[bytes]:
        """The sealed file of value ``d`` (``view``: its bytes), in pieces to write in turn."""
        prefix = os.urandom(_PREFIX_BYTES)
        yield VALUE_MAGIC + prefix
        count = self._records(len(view))
        for i in range(count):
            chunk = view[i * VALUE_CHUNK:(i + 1) * VALUE_CHUNK]
            yield self._aead.encrypt(prefix + i.to_bytes(4, "big"), chunk, self._about(d, i, i == count - 1))

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
        head = f.read(len(VALUE_MAGIC) + _PREFIX_BYTES)
        if head[:len(VALUE_MAGIC)] != VALUE_MAGIC or len(head) != len(VALUE_MAGIC) + _PREFIX_BYTES:
            raise SealError("not a sealed value")
        prefix, n = head[len(VALUE_MAGIC):], len(dest)
        count = self._records(n)
        record = bytearray(min(n, VALUE_CHUNK) + TAG_BYTES)
        for i in range(count):
            size = min(VALUE_CHUNK, n - i * VALUE_CHUNK)
            sealed = memoryview(record)[:size + TAG_BYTES]
            if f.readinto(sealed) != len(sealed):
                raise SealError("a sealed value cut short")
            try:
                self._aead.decrypt_into(prefix + i.to_bytes(4, "big"), sealed, self._about(d, i, i == count - 1),
                                        dest[i * VALUE_CHUNK:i * VALUE_CHUNK + size])
            except (InvalidTag, ValueError) as exc:
                raise SealError(f"a sealed value of {d[:16]}… did not open with this kernel's key") from exc
        if f.read(1):
            raise SealError("a sealed value with bytes after its end")
