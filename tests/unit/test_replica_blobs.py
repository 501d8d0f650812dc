"""Which blobs a replica keeps after each image (Replica._forget_old_blobs): the current image's,
and blobs that may belong to a cell not committed yet; not the blobs of older images, nor blobs
that stayed unused through a whole image (pushed for a cell whose commit lost)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from gpuhub.kernel.replica import Replica
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.log import ImageEntry


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
