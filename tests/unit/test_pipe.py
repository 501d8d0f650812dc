"""Frames between a replica and its GPU cell's child (gpuhub/kernel/pipe.py): small messages and
large out-of-band buffers, whatever way the pipe splits them."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest

from gpuhub.kernel.pipe import HEADER, FrameReader, FrameWriter, widen
from gpuhub.replication.blobstore import AnonBuffer, BlobStore, adoptable, reusable


def frame(msg: tuple) -> bytes:
    """The bytes FrameWriter.send writes for ``msg``."""
    oob: list[pickle.PickleBuffer] = []
    data = pickle.dumps(msg, protocol=5, buffer_callback=oob.append)
    raws = [b.raw() for b in oob]
    return (HEADER.pack(len(data), len(raws)) + b"".join(len(x).to_bytes(8, "big") for x in raws) + data
            + b"".join(bytes(x) for x in raws))


def read_all(reader: FrameReader, count: int) -> list[tuple]:
    got: list[tuple] = []
    while len(got) < count:
        got += reader.poll(5.0)
        assert not (reader.eof and len(got) < count), got
    return got


def test_messages_and_out_of_band_buffers_arrive_whole_and_in_order():
    r, w = os.pipe()
    widen(w)
    big = np.arange(3 << 20, dtype=np.float64)  # 24 MiB: many pipe-fulls
    sent = [("stream", "stdout", "hello\n"),
            ("image", [("d1", big.nbytes, pickle.PickleBuffer(big)), ("d2", 0, pickle.PickleBuffer(b"")),
                       ("d3", 5, None)], {"t": 1.5}),
            ("done", {"status": "ok"})]

    def write():
        writer = FrameWriter(w)
        for msg in sent:
            writer.send(*msg)
        os.close(w)

    t = threading.Thread(target=write)
    t.start()
    reader = FrameReader(r)
    got = read_all(reader, 3)
    t.join()
    assert got[0] == sent[0] and got[2] == sent[2]
    (d1, n1, mem1), (d2, n2, mem2), third = got[1][1]
    assert (d1, n1, d2, n2, third) == ("d1", big.nbytes, "d2", 0, ("d3", 5, None))
    assert type(mem1) is AnonBuffer and np.array_equal(np.frombuffer(mem1, dtype=np.float64), big)  # 2 MiB pages asked
    assert mem2 == bytearray()
    assert reader.poll(0.1) == [] and reader.eof and not reader.pending
    os.close(r)


def test_buffers_are_read_into_memory_from_the_readers_alloc():
    """A GPU replica reads its cell's values into its blob store's memfds (gpuhub/kernel/cell_process.py)."""
    r, w = os.pipe()
    big = np.arange(1 << 19, dtype=np.float64)  # 4 MiB
    store = BlobStore(file_backed=True)
    reader = FrameReader(r, alloc=store.alloc)
    t = threading.Thread(target=lambda: (FrameWriter(w).send("image", pickle.PickleBuffer(big)), os.close(w)))
    t.start()
    (_, mem), = read_all(reader, 1)
    t.join()
    os.close(r)
    assert not reusable(mem) and adoptable(mem) and np.array_equal(np.frombuffer(mem, dtype=np.float64), big)


@pytest.mark.parametrize("step", [1, 7, HEADER.size + 3, 4096])
def test_a_frame_split_anywhere_is_put_together(step):
    """The header, the pickle and each buffer may arrive in pieces of any size."""
    stream = b"".join(frame(msg) for msg in [("a", b"x" * 100), ("image", pickle.PickleBuffer(bytes(range(256)) * 40)),
                                             ("z",)])
    r, w = os.pipe()

    def trickle():
        for i in range(0, len(stream), step):
            os.write(w, stream[i:i + step])
        os.close(w)

    t = threading.Thread(target=trickle)
    t.start()
    got = read_all(FrameReader(r), 3)
    t.join()
    os.close(r)
    assert got[0] == ("a", b"x" * 100) and got[2] == ("z",)
    assert got[1][0] == "image" and bytes(got[1][1]) == bytes(range(256)) * 40


def test_a_writer_that_dies_mid_frame_leaves_it_pending():
    r, w = os.pipe()
    whole = frame(("image", pickle.PickleBuffer(b"y" * 1000)))
    os.write(w, whole[:-990])  # the buffer's first 10 bytes
    os.close(w)
    reader = FrameReader(r)
    frames = []
    while not reader.eof:
        frames += reader.poll(1.0)
    os.close(r)
    assert frames == [] and reader.pending


def test_threads_sending_at_once_never_mix_their_frames():
    """A cell's threads print and update widgets while the cell runs: each frame arrives whole."""
    r, w = os.pipe()
    writer = FrameWriter(w)
    payload = np.ones(1 << 16)  # out of band: several writes per frame
    threads = [threading.Thread(target=lambda n=n: [writer.send("comm", n, i, pickle.PickleBuffer(payload))
                                                    for i in range(40)]) for n in range(4)]
    for t in threads:
        t.start()
    reader = FrameReader(r)
    got: list[tuple] = []
    deadline = time.monotonic() + 60  # mixed frames would leave the reader waiting for bytes
    while len(got) < 160 and time.monotonic() < deadline:
        got += reader.poll(0.5)
    assert len(got) == 160 and not reader.pending
    for t in threads:
        t.join()
    os.close(w)
    os.close(r)
    assert sorted((n, i) for _, n, i, _ in got) == [(n, i) for n in range(4) for i in range(40)]
    assert all(np.array_equal(np.frombuffer(buf), payload) for *_, buf in got)
