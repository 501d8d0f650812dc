"""A replica's blob store (gpuhub/replication/blobstore.py): keep, drop, reuse dropped buffers."""

from __future__ import annotations

from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest


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
