"""A replica's large values on disk (gpuhub/replication/blobdisk.py)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

from gpuhub.replication import blobdisk, sealing
from gpuhub.replication.blobdisk import BlobDisk
from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest
from tests.helpers import wait_for

KEY = b"k" * 32


def value(seed: int, n: int = 300_000) -> bytes:
    return bytes((seed + i) % 251 for i in range(n))


@pytest.fixture
def store():
    s = BlobStore()
    values = {digest(v): v for v in (value(1), value(2), value(3))}
    for d, v in values.items():
        s.put(d, v)
    s.values = values
    return s


@pytest.fixture
def disk(tmp_path, store, monkeypatch):
    # How full the machine's disk is (other work shares it) must not decide these tests: the rule
    # has its own test below.
    monkeypatch.setattr(blobdisk, "keep_free", lambda disk_bytes: 0)
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / ("0" * 64 + ".part")).write_bytes(b"half a value")  # an interrupted write
    d = BlobDisk(str(tmp_path / "blobs"), store, key=KEY)
    yield d
    d.stop()


def test_the_disk_follows_the_last_image_once_started(disk, store):
    first, second, third = store.values
    assert disk.on_disk() == set() and not os.listdir(disk.directory)  # the half-written file is gone
    disk.persist({first, second}, 1)
    assert disk.on_disk() == set()  # not before the replica has caught up (the journal is replayed)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first, second}, 30, "the image's values on disk")
    assert bytes(disk.read(first)) == store.values[first]
    assert oct(os.stat(disk.path(first)).st_mode & 0o777) == "0o600"

    disk.persist({second, third}, 2)  # the next cell's image
    wait_for(lambda: disk.on_disk() == {second, third}, 30, "the old value removed, the new one written")
    disk.persist(set(), 3)  # an empty namespace
    wait_for(lambda: disk.on_disk() == set(), 30, "nothing kept")


def test_values_are_sealed_on_disk_and_open_only_with_the_kernels_key(disk, store, caplog):
    first, second, _ = store.values
    password = b"correct-horse-battery-staple"
    secret = password + value(9, 1000)  # an image's stream holds what the notebook holds
    store.put(digest(secret), secret)
    disk.persist({first, digest(secret)}, 1)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first, digest(secret)}, 30, "the image's values on disk")
    for d, v in ((first, store.values[first]), (digest(secret), secret)):
        on_disk = Path(disk.path(d)).read_bytes()
        assert v[:64] not in on_disk and password not in on_disk  # sealed
        assert bytes(BlobDisk(disk.directory, BlobStore(), key=KEY).read(d)) == v  # a restarted replica
    with caplog.at_level(logging.WARNING, logger="gpuhub.replication"):
        assert BlobDisk(disk.directory, BlobStore(), key=b"x" * 32).read(first) is None  # another kernel's key
    assert "did not open" in caplog.text and KEY.decode() not in caplog.text
    sealed = bytearray(Path(disk.path(first)).read_bytes())
    sealed[len(sealed) // 2] ^= 1
    Path(disk.path(first)).write_bytes(bytes(sealed))
    assert disk.read(first) is None  # a byte changed on disk
    Path(disk.path(second)).write_bytes(store.values[second])  # a file of a release that did not seal
    assert bytes(disk.read(second)) == store.values[second]
    Path(disk.path(second)).write_bytes(store.values[first])  # ... under the wrong name
    assert disk.read(second) is None


def is_sealed(path) -> bool:
    return Path(path).read_bytes().startswith(sealing.VALUE_MAGIC)


def test_a_file_an_earlier_release_left_as_it_was_is_sealed_by_the_next_image_that_wants_it(disk, store):
    first, second, _ = store.values
    Path(disk.path(first)).write_bytes(store.values[first])  # written before values were sealed
    assert bytes(disk.read(first)) == store.values[first]  # still read
    disk.persist({first, second}, 1)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first, second} and is_sealed(disk.path(first)) and is_sealed(disk.path(second)),
             30, "both values on disk, sealed")
    assert bytes(disk.read(first)) == store.values[first]


def test_a_sealed_value_is_read_into_the_stores_memory_that_loads_map_copy_on_write(disk, store, tmp_path):
    first = next(iter(store.values))
    big = value(4, 3 << 20)  # a memfd's worth (file-backed stores keep values from 1 MiB so)
    store.put(digest(big), big)
    disk.persist({first, digest(big)}, 1)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first, digest(big)}, 30, "the values on disk")
    restarted = BlobStore(file_backed=True)  # a CPU kernel's replica after its restart
    got = BlobDisk(disk.directory, restarted, key=KEY).read(digest(big))
    assert bytes(got) == big and restarted.has(digest(big))  # kept: no second copy in the store
    assert restarted.map_private(digest(big), 0, len(big)) is not None  # a memfd: loads map it


def test_a_restarted_replica_behind_its_files_removes_none_of_them(disk, store, tmp_path):
    """Raft saves its commit index once a second: a replica killed within a second of a commit
    restarts, and may be reported ready, with the image before it. That image's order must not
    remove the newer one's values, the only copy left if every replica restarted at once."""
    first, second, third = store.values
    disk.persist({first, second}, 2)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first, second}, 30, "the image's values on disk")
    disk.stop()

    again = BlobDisk(disk.directory, BlobStore(), key=KEY)  # the restarted process: nothing in memory
    try:
        again.persist(set(), 1)  # the state it came back with: the image before
        again.start()
        assert again.wait_handled(30)
        assert again.on_disk() == {first, second}
        assert bytes(again.read(first)) == store.values[first]
        again.persist({first, second}, 2)  # caught up
        again.store.put(third, store.values[third])
        again.persist({third}, 3)  # the next cell's image
        wait_for(lambda: again.on_disk() == {third}, 30, "the disk following the images again")
        assert (tmp_path / "blobs" / blobdisk.VERSION_FILE).read_text() == "3"
    finally:
        again.stop()


def test_the_version_moves_on_with_the_images_even_when_the_files_stay(disk, store):
    """Orders merge while the writer is busy: images 2 {a}, 3 {} and 4 {a} may reach it as 2 and
    4. A replica restarted at 3 must still keep a, which image 4 (the committed one) needs."""
    first = next(iter(store.values))
    disk.persist({first}, 2)
    disk.start()
    assert disk.wait_handled(30) and disk.on_disk() == {first}
    disk.persist({first}, 4)
    assert disk.wait_handled(30)
    disk.stop()

    again = BlobDisk(disk.directory, BlobStore(), key=KEY)
    try:
        again.persist(set(), 3)
        again.start()
        assert again.wait_handled(30)
        assert again.on_disk() == {first}
    finally:
        again.stop()


def test_a_version_that_could_not_be_recorded_is_tried_again(disk, store, monkeypatch):
    """Nothing is removed before the version is recorded; once it can be, the order is carried out."""
    monkeypatch.setattr(blobdisk, "RETRY_S", 0.05)
    first, second, _ = store.values
    disk.persist({first, second}, 1)
    disk.start()
    assert disk.wait_handled(30) and disk.on_disk() == {first, second}
    blocker = os.path.join(disk.directory, blobdisk.VERSION_FILE + ".part")
    os.mkdir(blocker)  # the version file cannot be written (as on a full disk)
    disk.persist({first}, 2)
    assert not disk.wait_handled(0.5)
    assert disk.on_disk() == {first, second}
    os.rmdir(blocker)
    assert disk.wait_handled(30)
    assert disk.on_disk() == {first}


def test_the_new_version_is_synced_to_the_directory_before_a_file_is_removed(disk, store, monkeypatch):
    """A power cut must not leave the removals on disk without the version they were made for."""
    first, second, _ = store.values
    disk.persist({first, second}, 1)
    disk.start()
    assert disk.wait_handled(30)
    events = []
    fsync, unlink = os.fsync, os.unlink

    def recorded_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("directory synced", Path(disk.directory, blobdisk.VERSION_FILE).read_text()))
        fsync(fd)

    def recorded_unlink(path, *args, **kwargs):
        events.append(("removed", os.path.basename(path)))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "unlink", recorded_unlink)
    disk.persist({first}, 2)
    assert disk.wait_handled(30)
    assert events == [("directory synced", "2"), ("removed", second)]


def test_a_filesystem_that_cannot_sync_a_directory_still_gets_the_values(disk, store, monkeypatch):
    first, second, _ = store.values
    fsync = os.fsync

    def no_directory_sync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_directory_sync)
    disk.persist({first, second}, 1)
    disk.start()
    assert disk.wait_handled(30) and disk.on_disk() == {first, second}
    disk.persist({first}, 2)
    assert disk.wait_handled(30) and disk.on_disk() == {first}


def test_a_value_that_does_not_match_its_digest_is_not_read(disk, store):
    first = next(iter(store.values))
    disk.persist({first}, 1)
    disk.start()
    wait_for(lambda: disk.on_disk() == {first}, 30, "the value on disk")
    with open(disk.path(first), "r+b") as f:
        f.write(b"rot")
    assert disk.read(first) is None
    assert disk.read("f" * 64) is None  # never written
    with pytest.raises(ValueError):
        disk.path("../raft.journal")


def test_the_copies_leave_the_journals_their_share_of_the_disk(disk, store, monkeypatch, caplog):
    monkeypatch.setattr(blobdisk, "keep_free", lambda disk_bytes: disk_bytes)  # no room at all
    disk.persist(set(store.values), 1)
    with caplog.at_level(logging.WARNING, logger="gpuhub.replication"):
        disk.start()
        wait_for(lambda: "cannot keep a large value on disk" in caplog.text, 30, "the warning")
    assert disk.on_disk() == set()
    assert caplog.text.count("cannot keep a large value on disk") == 1  # once, not per value


def test_the_journals_share_is_a_tenth_of_the_disk_at_most_two_gib():
    gib = 1 << 30
    assert blobdisk.keep_free(10 * gib) == gib
    assert blobdisk.keep_free(20 * gib) == 2 * gib
    # A big shared disk that other users filled to 91%: 22 GiB free is room enough for values.
    assert blobdisk.keep_free(252 * gib) == 2 * gib
