"""A replica's large values on its own disk, so that they outlive its process (docs/architecture.md D4).

Large values (an image's stream over 16 KiB, a sealed output's of 16 KiB or more, every buffer of
1 MiB or more) travel beside the Raft log, and lived only in the replicas' memory: a kernel
whose replica processes all restarted at once (each killed for going over its unit's MemoryMax,
and started again by systemd) came back with a journal naming values no one held, and its
namespace was gone. Now each replica writes the large values of
the last committed image into its journal directory (``blobs/<digest>``), on a thread of its own
after the cell (a cell never waits for the disk), and removes those no committed image needs any
more. A replica loading an image reads them from there before it asks its peers.

A file is written as ``<digest>.part``, flushed to disk, then renamed, so a file named by a digest
holds the whole value; reading checks the digest anyway (disks rot). The files are sealed with the
kernel's key (:class:`gpuhub.replication.sealing.ValueSealer`): a buffer holds whatever the
notebook holds, a password included, and the log itself keeps its images sealed (an image's
stream that comes here, too large for the log, is sealed already and is sealed once more, as any
value: a small cost for one rule). A file of a release before that (the value as it is)
is still read, checked against its digest, and written again sealed by the next :meth:`persist`
that still wants it (from the store: the replica has loaded the value by then). These copies never take the
last part of the disk, which the Raft journals need (gpuhub/replication/journal_space.py): see
:func:`keep_free`. A value that does not fit, or another write error, is logged once and stays
where it was before: in the replicas' memory.

Until :meth:`BlobDisk.start` (the replica has caught up with its group), nothing is written or
removed: while the journal is replayed, older images are applied one by one, and the files of the
newest must not be taken for leftovers. "Caught up" can still be behind what the disk holds: Raft
saves its commit index once a second, so a replica killed within a second of a commit restarts,
and may be reported ready, with the image before it. The disk therefore records the version of
the image it follows (``image-version``, written as the images move on, before the files change)
and takes no order from an older one: its files stay until the replica's state reaches them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import threading

from gpuhub.replication.blobstore import BlobStore
from gpuhub.replication.digest import digest
from gpuhub.replication.sealing import VALUE_MAGIC, SealError, ValueSealer

log = logging.getLogger("gpuhub.replication")

WRITE_STEP = 8 << 20  # bytes per write() call: the thread holds no lock and the GIL only briefly
DIGEST_HEX = re.compile(r"[0-9a-f]{64}")
KEEP_FREE = 0.10  # of the filesystem, left for the Raft journals (a full disk stops a replica) ...
KEEP_FREE_CAP = 2 << 30  # ... but never more than this: journals are small, and 10% of a big shared disk is not
RETRY_S = 5.0  # a value not yet in the store (still arriving from the executor) is tried again after this
VERSION_FILE = "image-version"  # the version (KernelLog.image_version) of the image the files are for


def keep_free(disk_bytes: int) -> int:
    """The bytes of a filesystem of ``disk_bytes`` that large values leave free: :data:`KEEP_FREE`
    of it, capped at :data:`KEEP_FREE_CAP` (journald's keep-free rule has the same shape). Without
    the cap a server whose big disk other users had filled to 91% kept no values at all."""
    return min(int(KEEP_FREE * disk_bytes), KEEP_FREE_CAP)


class BlobDisk:
    def __init__(self, directory: str, store: BlobStore, *, key: bytes) -> None:
        self.directory = directory
        self.store = store
        self._sealer = ValueSealer(key)  # the kernel's key: the files are sealed with it
        self._sealed: set[str] = set()  # digests whose file here is known to be sealed
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in os.listdir(directory):  # what an interrupted write left
            if name.endswith(".part"):
                os.unlink(os.path.join(directory, name))
        # (version, digests) of the last committed image the replica applied
        self._wanted: tuple[int, set[str]] | None = None
        # The files here are for an image of this version at most: orders for older images are
        # ignored (the replica's state is catching up; within a process, versions only grow).
        self._recorded = self._read_version()
        self._handled: tuple[int, set[str]] | None = None  # the last order done
        self._started = False
        self._stopping = False
        self._failed_once = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="gpuhub-blobdisk", daemon=True)

    def path(self, d: str) -> str:
        if not DIGEST_HEX.fullmatch(d):  # a digest from the log: never a path
            raise ValueError(f"not a digest: {d!r}")
        return os.path.join(self.directory, d)

    # --- the replica's side ------------------------------------------------------------------------
    def persist(self, digests: set[str], version: int) -> None:
        """The last committed image (``version``: its KernelLog.image_version) needs these values:
        keep them on disk, and only them. Cheap (pysyncobj's thread calls it after each cell)."""
        with self._changed:
            self._wanted = (version, set(digests))
            self._changed.notify_all()

    def start(self) -> None:
        """The replica is caught up: from now on the disk follows :meth:`persist`."""
        with self._changed:
            if not self._started:
                self._started = True
                self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def read(self, d: str) -> memoryview | None:
        """Value ``d`` from disk (opened with the kernel's key, checked against its digest), or None
        when it is not there, is not whole, or does not open. A sealed one is decrypted into a buffer
        of the store (a memfd in a CPU kernel's: loads map it copy-on-write, no second copy) and kept
        there; one an earlier release wrote is returned as a mapping of the file."""
        try:
            with open(self.path(d), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self._sealed_file(f, size):
                    return self._open_sealed(d, f, ValueSealer.plain_size(size))
                data = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else b""
        except (OSError, ValueError):
            return None
        if digest(data) != d:
            log.warning("a stored value on disk does not match its digest %s…: ignored", d[:16])
            return None
        return memoryview(data)

    @staticmethod
    def _sealed_file(f, size: int) -> bool:
        sealed = ValueSealer.plain_size(size) is not None and f.read(len(VALUE_MAGIC)) == VALUE_MAGIC
        f.seek(0)
        return sealed

    def _open_sealed(self, d: str, f, n: int) -> memoryview | None:
        try:
            buf = self.store.alloc(n)
        except MemoryError:
            log.warning("no memory to read a stored value of %d bytes from disk: asking the peers", n)
            return None
        view = memoryview(buf)[:n]
        try:
            self._sealer.open_into(d, f, view)
            whole = digest(view) == d
        except SealError as exc:
            log.warning("a stored value on disk did not open: %s; ignored", exc)
            whole = False
        finally:
            view.release()
        if not whole:
            self.store.recycle(buf)
            return None
        with contextlib.suppress(OSError):  # read once: its pages need not stay in the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self.store.adopt(d, buf, n)
        del buf
        self._sealed.add(d)
        return self.store.get(d)

    def _is_sealed(self, d: str) -> bool:
        """Whether the file of ``d`` is sealed (remembered: files only change by being written here)."""
        if d not in self._sealed:
            try:
                with open(self.path(d), "rb") as f:
                    if not self._sealed_file(f, os.fstat(f.fileno()).st_size):
                        return False
            except (OSError, ValueError):
                return True  # gone: nothing to seal
            self._sealed.add(d)
        return True

    def on_disk(self) -> set[str]:
        """The digests of the values written here (whole files only)."""
        try:
            return {n for n in os.listdir(self.directory) if DIGEST_HEX.fullmatch(n)}
        except OSError:
            return set()

    def _read_version(self) -> int:
        try:
            with open(os.path.join(self.directory, VERSION_FILE)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return 0  # none yet (or unreadable): no image is older than the files

    # --- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopping and (self._wanted is None or self._wanted == self._handled):
                    self._changed.wait()
                if self._stopping:
                    return
                version, wanted = order = self._wanted[0], set(self._wanted[1])
            # An image older than the files: the replica's state is still catching up.
            done = self._sync(version, wanted) if version >= self._recorded else True
            with self._changed:
                if not done:
                    self._changed.wait(RETRY_S)
                else:
                    self._handled = order
                    self._changed.notify_all()

    def wait_handled(self, timeout_s: float) -> bool:
        """Until the last :meth:`persist` is handled: its values written and the others removed,
        or the order ignored as older than the files."""
        with self._changed:
            return self._changed.wait_for(lambda: self._wanted == self._handled, timeout_s)

    def _sync(self, version: int, wanted: set[str]) -> bool:
        """Write what ``wanted`` lacks on disk, remove the rest. False when not done (a value not
        in the store yet, or the version could not be recorded): tried again later."""
        present = self.on_disk()
        # Recorded whenever it moves on, even when the files stay: orders merge while the writer is
        # busy (5 {a}, 6 {}, 7 {a} is seen as 7 {a}), and a restart at 6 must not remove a.
        if version > self._recorded and (present or wanted):
            if not self._write_whole(os.path.join(self.directory, VERSION_FILE), [str(version).encode()]):
                return False
            # The new name on disk before any removal below: after a power cut, files removed under
            # an image version that the disk forgot would be files a restarted replica still needs.
            if not self._sync_directory():
                return False
            self._recorded = version
        missing = False
        # what lacks a file, and what an earlier release left here as it was (sealed now)
        for d in sorted((wanted - present) | {d for d in wanted & present if not self._is_sealed(d)}):
            data = self.store.get(d)
            if data is None:
                missing = True
                continue
            self._write(d, data)
            del data
        for d in present - wanted:
            self._sealed.discard(d)
            try:
                os.unlink(self.path(d))
            except (OSError, ValueError):
                pass
        return not missing

    def _room_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more leave the journals their share of the filesystem: these copies
        are a convenience, the Raft journals beside them are not, and they share the disk."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize - nbytes >= keep_free(st.f_blocks * st.f_frsize)

    def _write(self, d: str, data) -> None:
        if not self._room_for(memoryview(data).nbytes):
            self._failed(f"{memoryview(data).nbytes} bytes would leave less free than the Raft journals keep "
                         f"({KEEP_FREE:.0%} of the disk, at most {KEEP_FREE_CAP >> 30} GiB)")
            return
        if self._write_whole(self.path(d), self._sealer.seal(d, memoryview(data).cast("B"))):
            self._sealed.add(d)

    def _write_whole(self, final: str, pieces) -> bool:
        """Write ``final`` whole or not at all (a ``.part`` file, flushed to disk, then renamed);
        ``pieces``: its bytes, in turn (each sealed record of a value is written as it is made)."""
        part = final + ".part"
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    for i in range(0, len(view), WRITE_STEP):
                        chunk = view[i:i + WRITE_STEP]
                        while chunk:
                            chunk = chunk[os.write(fd, chunk):]
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.rename(part, final)
        except OSError as exc:
            try:
                os.unlink(part)
            except OSError:
                pass
            self._failed(str(exc))
            return False
        return True

    def _sync_directory(self) -> bool:
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOTSUP):
                return True  # a filesystem that cannot sync a directory (some network mounts): as before
            self._failed(str(exc))
            return False
        return True

    def _failed(self, why: str) -> None:
        if not self._failed_once:  # once: a full disk would say so after every cell
            self._failed_once = True
            log.warning("cannot keep a large value on disk (%s); it stays in the replicas' memory only, "
                        "and is lost if all of them restart at once", why)
