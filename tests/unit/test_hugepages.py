"""Which values a GPU replica collapses into 2 MiB pages (gpuhub/kernel/hugepages.py)."""

from __future__ import annotations

import ctypes

import numpy as np

from gpuhub.kernel import hugepages
from gpuhub.replication.blobstore import new_buffer


def test_the_buffers_a_replica_reads_values_into_are_collapsible():
    for buf in (new_buffer(4 << 20), bytearray(4 << 20)):  # a GPU cell's value, a follower's copy
        addr = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
        assert hugepages._buffer_range(buf) == (addr, 4 << 20)
        assert hugepages._buffer_range(memoryview(buf)[:10]) == (addr, 4 << 20)  # the whole exporter
    a = np.ones(1 << 19)
    assert hugepages._buffer_range(a) == (a.ctypes.data, a.nbytes)
    assert hugepages._buffer_range(a[::2]) is None  # not contiguous
