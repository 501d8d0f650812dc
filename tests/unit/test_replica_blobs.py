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
    r._prepared, r._preparing = None, False
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
