"""Sealed images: what the Raft log keeps on disk is encrypted with the kernel's key.

A small namespace image travels inside the log (gpuhub/replication/log.py), and pysyncobj writes
the log to its journal and snapshot files. Those images hold whatever the notebook holds, a
password typed into ``getpass()`` included, so they are sealed (AES-256-GCM, a random 96-bit
nonce per image) with a key derived from the kernel's connection key, which only the user's
server and the replicas hold, in memory. The journal's directory is also private to the user
(0700, files 0600: see :class:`gpuhub.replication.log.RaftGroup`).
"""

from __future__ import annotations

import hmac
import os

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
