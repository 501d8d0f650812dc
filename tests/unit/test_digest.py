"""The one content hash (gpuhub/replication/digest.py): the tree hash whatever the buffer, and the
incremental forms (fill, receive) give the same digest."""

from __future__ import annotations

import numpy as np
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuhub.replication.digest as digest_module
from gpuhub.replication.digest import digest, fill_and_digest, receive_and_digest


def reference_digest(data: bytes, chunk: int) -> str:
    leaves = b"".join(blake3(data[i:i + chunk]).digest() for i in range(0, len(data), chunk))
    return blake3(digest_module.TAG + len(data).to_bytes(8, "big") + leaves).hexdigest()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=600), chunk=st.sampled_from([1, 7, 64, 1000]))
def test_digest_is_the_tree_hash_whatever_the_buffer_type(data, chunk):
    saved, digest_module.CHUNK = digest_module.CHUNK, chunk  # small chunks: many leaves, hashed in the pool
    try:
        d = digest(data)
        assert d == reference_digest(data, chunk)
        assert d == digest(bytearray(data)) == digest(memoryview(data)) == digest(data)
    finally:
        digest_module.CHUNK = saved
    assert len(d) == 64 and int(d, 16) >= 0


def test_digest_of_a_numpy_array_is_that_of_its_bytes():
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    assert digest(a) == digest(a.tobytes()) != digest(a[:, :50].copy())
    assert digest(b"") == reference_digest(b"", digest_module.CHUNK)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=600), chunk=st.sampled_from([1, 7, 64, 1000]))
def test_filling_or_receiving_a_buffer_gives_its_digest(data, chunk):
    saved, digest_module.CHUNK = digest_module.CHUNK, chunk  # many parts, hashed in the pool
    try:
        dest = bytearray(len(data))

        def write(lo: int, hi: int) -> None:
            dest[lo:hi] = data[lo:hi]

        assert fill_and_digest(dest, write) == reference_digest(data, chunk)
        assert bytes(dest) == data
        got, pos = bytearray(len(data)), 0

        def receive(part: memoryview) -> None:
            nonlocal pos
            part[:] = data[pos:pos + len(part)]
            pos += len(part)

        assert receive_and_digest(memoryview(got), receive, verify=True) == reference_digest(data, chunk)
        assert bytes(got) == data
        assert receive_and_digest(memoryview(bytearray(len(data))), lambda part: None, verify=False) is None
    finally:
        digest_module.CHUNK = saved
