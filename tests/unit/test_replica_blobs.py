"""Which blobs a replica keeps after each image (Replica._forget_old_blobs): the current image's,
and blobs that may belong to a cell not committed yet; not the blobs of older images, nor blobs
that stayed unused through a whole image (pushed for a cell whose commit lost)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from gpuhub.kernel import image as images
from gpuhub.kernel.replica import Replica, Settings
from gpuhub.replication.blobstore import BlobStore, new_buffer
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
    return r


def as_a_cells_process_sends_it(ns: dict) -> tuple[bytes, list[str], list]:
    """A GPU cell's image as its process hands it over: the buffers in memory of their own."""
    cap = images.capture(ns, set())
    handed = []
    for d, n, mv in cap.sized_buffers():
        buf = new_buffer(n)
        buf[:] = mv.cast("B")
        handed.append((d, n, buf))
    return cap.stream, cap.names, handed


def test_a_gpu_replica_builds_a_value_on_the_buffer_its_cells_process_sent_without_a_copy():
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: a buffer of its own
    stream, names, handed = as_a_cells_process_sends_it({"big": big, "twin": big.copy()})
    r = a_replica(cells_in_process=False)
    entry = r.store_image(stream, names, handed, live=False)
    assert entry.buffers[0][0] == entry.buffers[1][0]  # the same bytes: one blob
    stored = r.store.get(entry.buffers[0][0])
    loaded = r.load_image(entry)
    value, twin = loaded["big"], loaded["twin"]
    assert np.array_equal(value, big) and np.shares_memory(value, np.frombuffer(stored, dtype=np.uint8))
    assert np.array_equal(twin, big) and not np.shares_memory(twin, value)  # once per load, as on the executor


def test_a_value_loaded_where_cells_run_never_shares_the_stored_buffer():
    big = np.arange(1 << 20, dtype=np.float64)
    stream, names, handed = as_a_cells_process_sends_it({"big": big})
    r = a_replica(cells_in_process=True)  # a cell here may write the value in place
    entry = r.store_image(stream, names, handed, live=False)
    stored = r.store.get(entry.buffers[0][0])
    value = r.load_image(entry)["big"]
    assert np.array_equal(value, big) and not np.shares_memory(value, np.frombuffer(stored, dtype=np.uint8))
    value += 1
    assert digest(stored) == entry.buffers[0][0]
