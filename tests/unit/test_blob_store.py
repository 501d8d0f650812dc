"""Large values beside the Raft log (DESIGN D4): the digest and the store, in memory.

The network half (BlobServer, push, fetch on 127.0.0.1) is tests/integration/test_blobs.py."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhub.replication import blobs
from gpuhub.replication.blobs import BlobStore, digest


# --- digest --------------------------------------------------------------------------------------
def reference_digest(data: bytes, chunk: int) -> str:
    leaves = b"".join(hashlib.sha256(data[i:i + chunk]).digest()
                      for i in range(0, len(data), chunk))
    return hashlib.sha256(blobs.TAG + len(data).to_bytes(8, "big") + leaves).hexdigest()


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=600), chunk=st.sampled_from([1, 7, 64, 1000]))
def test_digest_is_the_tree_hash_whatever_the_buffer_type(data, chunk):
    saved, blobs.CHUNK = blobs.CHUNK, chunk  # small chunks: many leaves, hashed in the pool
    try:
        d = digest(data)
        assert d == reference_digest(data, chunk)
        assert d == digest(bytearray(data)) == digest(memoryview(data)) == digest(data)
    finally:
        blobs.CHUNK = saved
    assert len(d) == 64 and int(d, 16) >= 0


def test_digest_of_a_numpy_array_is_that_of_its_bytes():
    a = np.arange(1000, dtype=np.float64).reshape(10, 100)
    assert digest(a) == digest(a.tobytes()) != digest(a[:, :50].copy())
    assert digest(b"") == reference_digest(b"", blobs.CHUNK)


# --- store ---------------------------------------------------------------------------------------
def test_store_put_get_retain():
    s = BlobStore()
    a, b = b"a" * 10, b"b" * 20
    s.put(digest(a), a)
    s.put(digest(b), b)
    s.put(digest(b), b)  # idempotent
    assert s.get(digest(a)) == a and s.has(digest(b)) and s.get("0" * 64) is None
    assert s.nbytes == 30 and len(s) == 2
    s.retain({digest(b)})
    assert not s.has(digest(a)) and s.get(digest(b)) == b and s.nbytes == 20
    s.retain(set())
    assert len(s) == 0 and s.nbytes == 0


def test_store_reuses_dropped_buffers_only_when_nothing_references_them():
    s = BlobStore(spare_bytes=10_000)
    buf = s.alloc(1000)
    buf[:] = b"x" * 1000
    s.adopt("a" * 64, buf, 1000)
    del buf
    view = s.get("a" * 64)
    assert bytes(view) == b"x" * 1000 and view.readonly
    s.retain(set())
    assert s.spare_nbytes == 0  # a view is alive: the buffer must not be reused
    del view

    buf = s.alloc(900)
    s.adopt("b" * 64, buf, 900)
    del buf
    assert len(s.get("b" * 64)) == 900 and s.nbytes == 900
    s.retain(set())
    assert s.spare_nbytes >= 900
    again = s.alloc(800)  # the 900-byte spare fits within n + n/4
    assert len(again) == 900 and s.spare_nbytes == 0
    s.recycle(again)
    assert s.spare_nbytes == 900
    assert s.alloc(10) is not again and s.spare_nbytes == 900  # far smaller: fresh, spare kept
