"""Which blobs a replica keeps after each image (Replica._forget_old_blobs): the current image's,
and blobs that may belong to a cell not committed yet; not the blobs of older images, nor blobs
that stayed unused through a whole image (pushed for a cell whose commit lost)."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from gpuhub.kernel import image as images
from gpuhub.kernel.replica import Replica, Settings
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest
from gpuhub.replication.log import ImageEntry
from gpuhub.replication.sealing import Sealer


def image(*digests: str) -> ImageEntry:
    return ImageEntry(stream_digest="s", inline=b"stream", stream_size=6, buffers=tuple((d, 1) for d in digests))


class FakeReplica(SimpleNamespace):
    """What _forget_old_blobs uses of a replica: its log's image, its store, its two sets."""

    def __init__(self) -> None:
        super().__init__(state=SimpleNamespace(changed=threading.Condition(), image=None),
                         store=BlobStore(), _referenced=set(), _unreferenced=set())

    def arrive(self, *digests: str) -> None:
        for d in digests:
            self.store.put(d, b"x")

    def commit(self, entry: ImageEntry) -> set[str]:
        self.state.image = entry
        Replica._forget_old_blobs(self)
        return self.store.digests()


def test_old_images_go_the_current_one_stays():
    r = FakeReplica()
    r.arrive("a", "b")
    assert r.commit(image("a", "b")) == {"a", "b"}
    r.arrive("c")
    assert r.commit(image("a", "c")) == {"a", "c"}


def test_a_blob_pushed_before_its_cell_commits_survives_the_image_before():
    r = FakeReplica()
    r.arrive("a")
    r.arrive("next")  # pushed for the next cell before this replica applied the current image
    assert r.commit(image("a")) == {"a", "next"}
    assert r.commit(image("next")) == {"next"}


def test_a_blob_of_a_cell_whose_commit_lost_goes_after_one_more_image():
    r = FakeReplica()
    r.arrive("a")
    r.commit(image("a"))
    r.arrive("lost")  # the executor pushed it; then an abort won: no image names it
    assert r.commit(image("a")) == {"a", "lost"}  # still unknown whether a cell needs it
    r.arrive("b")
    assert r.commit(image("b")) == {"b"}  # unused through a whole image: dropped


# --- where a loaded value's memory comes from (the module docstring of gpuhub/kernel/replica.py) ---
def a_replica(*, cells_in_process: bool) -> Replica:
    """A replica with a store and no group: what store_image and load_image use."""
    r = Replica.__new__(Replica)
    r.store, r.resident, r.disk, r.peers = BlobStore(file_backed=True), {}, None, {}
    r.cells_in_process, r.huge_pages, r.settings, r.sealer = cells_in_process, False, Settings(), Sealer(b"k" * 32)
    r._image_key, r.loaded_version, r.state, r.key = None, 0, SimpleNamespace(image_version=1), b"k" * 32
    r._prepared, r._preparing, r._stream_blob = None, False, None
    return r


def as_a_cells_process_sends_it(r: Replica, ns: dict) -> tuple[bytes, list[str], list]:
    """A GPU cell's image as the replica gets it from the cell's process: each buffer read into
    memory from the store's ``alloc`` (gpuhub/kernel/cell_process.py)."""
    cap = images.capture(ns, set())
    handed = []
    for d, n, mv in cap.sized_buffers():
        buf = r.store.alloc(n)
        memoryview(buf)[:n] = mv.cast("B")
        handed.append((d, n, buf))
    return cap.stream, cap.names, handed


def mapping_of(value: np.ndarray) -> str:
    """The /proc/self/maps line of the mapping that holds ``value``."""
    addr = value.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if lo <= addr < hi:
                return line
    raise AssertionError("no mapping holds the value")


class HalvedOnLoad:
    """A value whose unpickling writes its array in place (user code that runs in the replica)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.a /= 2


def test_a_gpu_cells_value_loads_copy_on_write_from_the_file_it_was_read_into():
    r = a_replica(cells_in_process=False)
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: a buffer of its own
    stream, names, handed = as_a_cells_process_sends_it(r, {"big": big, "twin": big.copy()})
    entry = r.store_image(stream, names, handed, live=False)
    assert entry.buffers[0][0] == entry.buffers[1][0]  # the same bytes: one blob
    loaded = r.load_image(entry)
    value, twin = loaded["big"], loaded["twin"]
    assert np.array_equal(value, big) and np.array_equal(twin, big) and not np.shares_memory(twin, value)
    assert "gpuhub-blob" in mapping_of(value)  # a mapping of the stored memfd: no copy was made
    value += 1  # what a write in this process does: a private page
    assert digest(r.store.get(entry.buffers[0][0])) == entry.buffers[0][0]


def test_an_image_prepared_before_its_commit_is_the_one_loaded_after_it_and_a_failing_one_changes_nothing():
    """A GPU replica builds its own cell's values before it commits the image (an image no
    process but the cell's can load is then never committed) and installs those very values after
    the commit, not a second load of them."""
    r = a_replica(cells_in_process=False)
    big = np.arange(1 << 20, dtype=np.float64)
    stream, names, handed = as_a_cells_process_sends_it(r, {"big": big})
    entry = r.store_image(stream, names, handed, live=False)
    r.prepare_image(entry, {})
    built = r._prepared[1][0]
    committed = pickle.loads(pickle.dumps(entry))  # what the log gives back: an equal copy
    assert r.load_image(committed) is built and r._prepared is None
    key, resident = r._image_key, r.resident
    stream, names, handed = as_a_cells_process_sends_it(r, {"bad": Unloadable()})
    bad = r.store_image(stream, names, handed, live=False)
    with pytest.raises(RuntimeError, match="not here"):
        r.prepare_image(bad, {})
    assert (r._image_key, r.resident, r._prepared) == (key, resident, None)
    # the values built may have shared the resident memory (and written it as they loaded): it is
    # given up, and the namespace loaded again before the next cell
    r.drop_prepared()
    assert r.resident == {} and r.loaded_version == -1


def test_code_that_writes_a_value_while_it_loads_leaves_the_stored_bytes():
    r = a_replica(cells_in_process=False)
    a = np.arange(1 << 20, dtype=np.float64)
    stream, names, handed = as_a_cells_process_sends_it(r, {"h": HalvedOnLoad(a)})
    entry = r.store_image(stream, names, handed, live=False)
    assert np.array_equal(r.load_image(entry)["h"].a, a / 2)
    assert digest(r.store.get(entry.buffers[0][0])) == entry.buffers[0][0]  # peers fetching it get a


def _refuse_to_load():
    raise RuntimeError("not here")


class Unloadable:
    """Pickles, but its unpickling raises (as a value tied to the process that made it)."""

    def __reduce__(self):
        return _refuse_to_load, ()


# --- an image's stream too large for the log (Replica.store_image, gpuhub/replication/sealing.py) ---
def test_a_stream_too_large_for_the_log_is_sealed_before_it_is_named_and_loads_back():
    """A stream over the inline limit becomes a blob named by its digest, which enters the log and
    the replicas' disks: named by the sealed bytes, it tells nothing of the plain ones (a small
    namespace's digest could be checked against a guess), and the blob holds no password."""
    r = a_replica(cells_in_process=True)
    ns = {"pw": "secret-horse", "words": [f"word{i}" for i in range(5000)]}
    cap = images.capture(ns, set())
    assert len(cap.stream) > r.settings.inline_max_bytes and not cap.sized_buffers()
    entry = r.store_image(cap.stream, cap.names, [], live=True)
    assert entry.inline is None and entry.stream_sealed
    blob = bytes(r.store.get(entry.stream_digest))
    assert digest(blob) == entry.stream_digest != digest(cap.stream) and entry.stream_size == len(blob)
    assert b"secret-horse" not in blob and b"word4999" not in blob
    assert a_replica(cells_in_process=True).sealer.open_stream(blob) == cap.stream
    other = a_replica(cells_in_process=True)
    other.store.put(entry.stream_digest, blob)
    loaded = other.load_image(entry)
    assert {k: loaded[k] for k in ns} == ns


def test_an_entry_of_an_earlier_release_with_a_plain_stream_blob_still_loads():
    r = a_replica(cells_in_process=True)
    cap = images.capture({"words": [f"word{i}" for i in range(5000)]}, set())
    old = object.__new__(ImageEntry)  # as pickled by a release whose ImageEntry had no stream_sealed
    old.__dict__.update(stream_digest=digest(cap.stream), inline=None, stream_size=len(cap.stream),
                        buffers=(), names=tuple(cap.names))
    entry = pickle.loads(pickle.dumps(old))
    assert entry.stream_sealed is False
    r.store.put(entry.stream_digest, cap.stream)
    assert r.load_image(entry)["words"][-1] == "word4999"


def test_a_sealed_stream_spans_records_and_refuses_any_change(monkeypatch):
    from gpuhub.replication import sealing

    monkeypatch.setattr(sealing, "VALUE_CHUNK", 1000)  # records of 1000 bytes: six for this stream
    plain = bytes(range(256)) * 20
    sealer = Sealer(b"k" * 32)
    sealed = bytes(sealer.seal_stream(plain))
    assert sealer.open_stream(sealed) == plain and plain[:64] not in sealed
    assert bytes(sealer.seal_stream(plain)) != sealed  # a fresh nonce prefix each time
    head, record = len(sealing.STREAM_MAGIC) + 8, 1000 + sealing.TAG_BYTES
    first, second = sealed[head:head + record], sealed[head + record:head + 2 * record]
    changed = {
        "cut short": sealed[:-1], "cut at a record's end": sealed[:head + 5 * record],
        "a byte after its end": sealed + b"x", "a byte changed": sealed[:40] + bytes([sealed[40] ^ 1]) + sealed[41:],
        "two records swapped": sealed[:head] + second + first + sealed[head + 2 * record:],
    }
    for what, bad in changed.items():
        with pytest.raises(sealing.SealError):
            sealer.open_stream(bad)
            pytest.fail(f"{what}: opened")
    with pytest.raises(sealing.SealError):
        Sealer(b"j" * 32).open_stream(sealed)  # another kernel's key
    # the same kernel's key for values on disk (its header made the stream's, so the key is what refuses)
    at_rest = sealing.ValueSealer(b"k" * 32, magic=sealing.STREAM_MAGIC)
    with pytest.raises(sealing.SealError, match="did not open"):
        at_rest.open_view("image-stream", memoryview(sealed), memoryview(bytearray(len(plain))))


def test_a_gpu_cells_image_with_a_large_stream_is_prepared_and_installed_from_its_sealed_blob():
    r = a_replica(cells_in_process=False)
    ns = {"big": np.arange(1 << 20, dtype=np.float64), "words": [f"word{i}" for i in range(5000)]}
    stream, names, handed = as_a_cells_process_sends_it(r, ns)
    entry = r.store_image(stream, names, handed, live=False)
    assert entry.inline is None and entry.stream_sealed and len(entry.buffers) == 1
    r.prepare_image(entry, {})
    loaded = r.load_image(pickle.loads(pickle.dumps(entry)))
    assert np.array_equal(loaded["big"], ns["big"]) and loaded["words"] == ns["words"]


def test_an_unchanged_stream_keeps_its_sealed_blob_on_the_executor_and_on_a_replica_that_loaded_it():
    """Sealing takes a random nonce: sealed again, an unchanged stream would be a new blob every
    cell (pushed to both peers, written to each disk) where a cell only wrote an array in place."""
    r = a_replica(cells_in_process=False)
    ns = {"big": np.arange(1 << 20, dtype=np.float64), "words": [f"word{i}" for i in range(5000)]}
    stream, names, handed = as_a_cells_process_sends_it(r, ns)
    first = r.store_image(stream, names, handed, live=False)
    ns["big"][0] = -1  # written in place: the buffer changes, the stream does not
    stream2, names, handed = as_a_cells_process_sends_it(r, ns)
    assert stream2 == stream
    second = r.store_image(stream2, names, handed, live=False)
    assert second.stream_digest == first.stream_digest and second.buffers != first.buffers
    follower = a_replica(cells_in_process=False)
    follower.store.put(first.stream_digest, r.store.get(first.stream_digest))
    for d, _ in second.buffers:
        follower.store.put(d, r.store.get(d))
    follower.load_image(second)  # it runs the next cell: its unchanged stream is the same blob
    stream3, names, handed = as_a_cells_process_sends_it(follower, ns)
    assert follower.store_image(stream3, names, handed, live=False).stream_digest == first.stream_digest
    ns["words"].append("new")  # a changed stream: sealed anew
    stream4, names, handed = as_a_cells_process_sends_it(follower, ns)
    assert follower.store_image(stream4, names, handed, live=False).stream_digest != first.stream_digest
