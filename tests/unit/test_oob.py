"""Out-of-band layouts (gpuhub/replication/oob.py) and copy-on-write loading from a file-backed
blob store: round trips, what the digest covers, corrupted and malformed layouts."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from gpuhub.replication import oob
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest
from gpuhub.replication.oob import ALIGN, ENTRY, HEADER, MAGIC, LayoutError

MIB = 1 << 20


def blob_of(value) -> bytes:
    layout = oob.dumps(value)
    assert isinstance(layout, oob.Layout)
    return layout.to_bytes()


def test_round_trip_of_arrays_anywhere_in_the_value():
    value = {"c": np.arange(MIB, dtype=np.float64),
             "f": np.asfortranarray(np.arange(2 * MIB, dtype=np.int32).reshape(1024, -1)),
             "small": np.arange(10), "text": "hi", "nested": [np.ones(MIB // 4, dtype=np.float32)]}
    blob = blob_of(value)
    back = oob.loads(bytearray(blob))
    assert back.keys() == value.keys()
    for k in ("c", "f", "small"):
        assert np.array_equal(back[k], value[k]) and back[k].dtype == value[k].dtype
    assert back["f"].flags.f_contiguous and back["text"] == "hi"
    assert np.array_equal(back["nested"][0], value["nested"][0])
    assert back["c"].flags.writeable  # built on the writable buffer it was given


def test_buffers_are_page_aligned_and_the_blob_ends_with_the_last_one():
    layout = oob.dumps([np.ones(MIB + 3, dtype=np.uint8), np.ones(MIB, dtype=np.uint8)])
    assert len(layout.buffers) == 2
    assert all(off % ALIGN == 0 for off in layout.offsets)
    assert layout.nbytes == layout.offsets[-1] + MIB
    stream, spans = oob.parse(layout.to_bytes())
    assert spans == [(off, len(b)) for off, b in zip(layout.offsets, layout.buffers, strict=False)]
    assert pickle.loads(stream, buffers=[bytes(b) for b in layout.buffers])[1].sum() == MIB


def test_top_level_bytearray_goes_out_of_band():
    data = bytearray(b"\x01\x02" * MIB)
    back = oob.loads(blob_of(data))
    assert type(back) is bytearray and back == data


def test_small_and_plain_values_stay_in_band_pickles():
    for value in (np.arange(100), {"a": 1}, bytearray(10), b"x" * (2 * MIB)):
        blob = oob.dumps(value)
        assert isinstance(blob, bytes) and not oob.is_layout(blob)
        assert pickle.loads(blob) == value if not isinstance(value, np.ndarray) else True


def test_layout_aliases_the_value_until_written_out():
    a = np.zeros(MIB, dtype=np.uint8)
    layout = oob.dumps(a)
    blob = bytearray(layout.nbytes)
    layout.write_into(memoryview(blob))
    a[:] = 7  # the written blob is a copy: it keeps the old bytes
    assert oob.loads(blob).max() == 0


def test_digest_covers_header_padding_and_buffers():
    blob = blob_of(np.arange(MIB, dtype=np.uint8))
    _, spans = oob.parse(blob)
    base = digest(blob)
    for where in (0, HEADER.size + 1, spans[0][0] - 1, spans[0][0], len(blob) - 1):
        bad = bytearray(blob)
        bad[where] ^= 1
        assert digest(bad) != base, where


def _layout_bytes(stream: bytes, spans: list[tuple[int, int]], total: int, *,
                  magic: bytes = MAGIC, align: int = ALIGN, count: int | None = None) -> bytearray:
    count = len(spans) if count is None else count
    head = HEADER.pack(magic, count, align, len(stream), total) + b"".join(ENTRY.pack(*s) for s in spans)
    return bytearray((head + stream).ljust(total, b"\0")[:total])


@pytest.mark.parametrize("make, message", [
    (lambda: b"GPHOOB", "shorter than the layout header"),
    (lambda: _layout_bytes(b"s", [(ALIGN, 8)], ALIGN + 8, magic=b"NOTOOB\0\1"), "wrong magic"),
    (lambda: _layout_bytes(b"s", [(ALIGN, 8)], ALIGN + 8, align=512), "alignment"),
    (lambda: _layout_bytes(b"s", [(ALIGN + 1, 8)], ALIGN + 9), "not aligned"),
    (lambda: _layout_bytes(b"s", [(0, 8)], ALIGN), "overlaps"),
    (lambda: _layout_bytes(b"s", [(ALIGN, 8), (ALIGN, 8)], ALIGN + 8), "overlaps"),
    (lambda: _layout_bytes(b"s", [(ALIGN, 100)], ALIGN + 8), "past the end"),
    (lambda: _layout_bytes(b"s" * 10_000, [(ALIGN, 8)], ALIGN + 8), "past the end"),
    (lambda: _layout_bytes(b"s", [(ALIGN, 8)], 2 * ALIGN), "stray bytes"),
    (lambda: _layout_bytes(b"s", [], ALIGN, count=1 << 30), "buffers"),
])
def test_malformed_layouts_are_refused_with_a_clear_error(make, message):
    blob = make()
    if len(blob) >= HEADER.size and blob[:len(MAGIC)] == MAGIC:
        # total must match for the later checks to be reached: patch it to the real length
        blob = bytearray(blob)
        struct.pack_into("!Q", blob, 24, len(blob))
    with pytest.raises(LayoutError, match=message):
        oob.loads(blob)


def test_length_mismatch_is_refused():
    blob = bytearray(blob_of(np.ones(MIB, dtype=np.uint8)))
    with pytest.raises(LayoutError, match="layout says"):
        oob.parse(blob + b"\0")


# --- file-backed store: values loaded copy-on-write ---------------------------------------------
def _store_layout(store: BlobStore, value) -> tuple[str, int]:
    layout = oob.dumps(value)
    buf = store.alloc(layout.nbytes)
    view = memoryview(buf)[:layout.nbytes]
    layout.write_into(view)
    d = digest(view)
    del view
    store.adopt(d, buf, layout.nbytes)
    return d, layout.nbytes


def test_a_value_mapped_copy_on_write_never_changes_the_stored_blob():
    store = BlobStore(file_backed=True)
    original = np.arange(MIB, dtype=np.float64)
    d, _ = _store_layout(store, original)
    value = oob.loads(store.get(d), lambda off, n: store.map_private(d, off, n))
    assert value.flags.writeable and np.array_equal(value, original)
    value += 1  # a CPU cell writing the loaded value in place
    value[-1] = -5
    assert digest(store.get(d)) == d
    again = oob.loads(store.get(d), lambda off, n: store.map_private(d, off, n))
    assert np.array_equal(again, original)
    store.retain(set())  # the stored file goes; the value's private mapping stays valid
    assert value[0] == 1 and value[-1] == -5


def test_map_private_refuses_what_is_not_file_backed():
    store = BlobStore(file_backed=False)
    d, n = _store_layout(store, np.ones(MIB, dtype=np.uint8))
    assert store.map_private(d, 0, n) is None
    assert store.map_private("0" * 64, 0, 1) is None


def test_file_backed_buffers_are_never_kept_as_spares():
    store = BlobStore(spare_bytes=64 * MIB, file_backed=True)
    _store_layout(store, np.ones(2 * MIB, dtype=np.uint8))
    store.retain(set())
    assert store.spare_nbytes == 0


def test_executor_copies_are_anonymous_and_reused_received_values_get_a_fresh_file():
    store = BlobStore(spare_bytes=64 * MIB, file_backed=True)
    copy = store.alloc(2 * MIB, anonymous=True)  # the executor's own copy of a changed value
    assert type(copy) is bytearray
    copy[:] = b"\1" * len(copy)
    store.adopt("a" * 64, copy, len(copy))
    del copy
    store.retain(set())  # the value changed again: its old copy becomes a spare
    assert store.spare_nbytes == 2 * MIB
    received = store.alloc(2 * MIB)  # a value from a peer: never into an anonymous spare
    assert type(received) is not bytearray and store.spare_nbytes == 2 * MIB
    assert type(store.alloc(2 * MIB, anonymous=True)) is bytearray and store.spare_nbytes == 0
