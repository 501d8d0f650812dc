"""One replica's part in its kernel's Raft group: who runs a cell, and keeping the namespace equal.

Where replicas agree on the executor: the lease (:meth:`Replica.lease`), else :meth:`Replica.elect`.
Where the executor publishes what a cell changed: :meth:`Replica.commit_cell`. Where the others
take it: :meth:`Replica.wait_for_end`, then :meth:`Replica.sync_namespace`.

The protocol per cell (the cell's key is the ``execute_request``'s msg_id, the same on every
replica because the router forwards one message to all):

0. the executor of the last cell holds the lease (:meth:`Replica.lease`): when it gets the GPUs
   now it runs the cell without an election, and the others wait for its end
   (:meth:`Replica.wait_for_holder`); it yields (an election begins) when it cannot, and the others
   begin the election when the router says it did not get the cell. A replica the router skipped
   for the last cell catches up first (:meth:`Replica.catch_up`);
1. otherwise every replica asks its own agent for the GPUs now (CPU kernels: always able) and
   proposes LEAD or YIELD; the log decides the executor (gpuhub/replication/election.py); losers
   give back their grant at once;
2. the executor (having loaded every committed image first: :meth:`Replica.up_to_date`) runs the
   cell and commits ``complete`` with the namespace image (gpuhub/kernel/image.py): a small
   stream inline (sealed), large parts pushed to the other replicas first and named by digest
   (docs/architecture.md D4); an unchanged namespace commits no image;
3. the others wait for that entry (or an ``abort``, when the executor is lost, no GPU came in
   time, or the user interrupted the wait), then load the image. The kernel replies only then,
   so no replica starts cell n+1 before the image of cell n is committed.

**Large buffers without copies, and who may write them.** An image's large buffers are blobs of
their own. A CPU executor copies a buffer the store lacks into new memory the store keeps (one
copy, hashed while it is made). Every replica receives blobs into memfds
(``BlobStore(file_backed=True)``), a GPU executor also those its cell's process sends back
(:class:`~gpuhub.kernel.cell_process.CellProcess` reads them with the store's ``alloc``), and
builds loaded values on them: each buffer is mapped
``MAP_PRIVATE`` from its file (:meth:`Replica._buffer_for`), so a value costs no copy and no
``pickle.loads`` of a gigabyte, and the Raft thread keeps getting the GIL. The rule that keeps
this sound, *the bytes stored under a digest never change while stored*, holds because

- the executor's store entry is its own copy, never the live value that a later in-process cell
  may write in place;
- a loaded value shares the stored pages only until something writes them: a write (this
  replica becomes the executor of a CPU cell and runs ``big += 1``) copies that page into the
  process's private memory, the memfd keeps the old bytes, and peers or a replacement replica
  fetching that digest from here still get them (fetch re-hashes, so a violation would show);
- memfds are never reused for another value (a private mapping of a reused file would see it);
- memory of this process that already holds a digest's bytes (:attr:`Replica.resident`: the
  buffers of the last image it captured or loaded) is reused for the next image only while
  nothing can have written it (it is emptied when a cell starts in this process), and once per
  image, so that two values never share memory they did not share on the executor;
- where a blob sits in the store without a file (a store entry this process wrote itself),
  loading copies it rather than aliasing it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpuhub.kernel import hugepages
from gpuhub.kernel import image as images
from gpuhub.replication import blobclient
from gpuhub.replication.blobdisk import BlobDisk
from gpuhub.replication.blobserver import BlobServer
from gpuhub.replication.blobstore import BlobStore, adoptable, copy_into, new_buffer
from gpuhub.replication.digest import digest, fill_and_digest
from gpuhub.replication.election import FAILED, local_choice
from gpuhub.replication.log import CellOutcome, ImageEntry, KernelLog, RaftGroup, RaftUnavailable
from gpuhub.replication.sealing import Sealer

log = logging.getLogger("gpuhub.replica")

# Larger streams travel beside the log, as blobs (sealed, like inline ones, before they are named).
# pysyncobj pickles, compresses and encrypts every message once per follower: a 30-48 KB image cost
# 7-10 ms more a cell inline than as a blob on kept connections (docs/benchmarks.md).
INLINE_MAX_BYTES = 16 * 1024
LOAD_ERROR_CHARS = 300  # of a load's exception, in the cell's error (it also enters the log)
EXECUTOR_SPARE_BYTES = 4 << 30  # a CPU executor's dropped copies kept for the next (peak unchanged:
# the old copy is held until the new one is committed anyway)


@dataclass
class Settings:
    """Timeouts, from the unit's environment (GPUHUB_*), so admins can tune them per site."""

    election_timeout_s: float = 1.0  # after the first proposal, stop waiting for silent replicas
    executor_lost_s: float = 2.0  # the executor's replica unreachable this long → abort the cell
    grant_timeout_s: float = 300.0  # all replicas busy: how long a cell waits for a GPU
    # GPU kernels: how long a cell's process, its CUDA context and GPU memory stay for the next
    # cell while no other kernel asks for its GPUs (a lingering lease); 0: each cell's ends with it
    gpu_linger_s: float = 30.0
    ready_timeout_s: float = 120.0  # joining the group and catching up at start
    blob_wait_s: float = 30.0  # a value still arriving from the executor's push: wait this long for it
    inline_max_bytes: int = INLINE_MAX_BYTES
    # How a CPU kernel learns which large buffers a cell wrote: "pages" reads page bits
    # (gpuhub/kernel/dirty.py: userfaultfd write-protection, else soft-dirty, else a dormant
    # sentinel child forked per cell; a GiB written costs ~0.4 s of faults, ~0.56 s and its pages
    # held twice with the sentinel); "hash" hashes every large buffer once per cell instead
    # (~0.12 s/GiB, against ~5 ms/GiB for the page check). "sentinel" is the old name of "pages".
    write_tracking: str = "pages"

    @classmethod
    def from_env(cls) -> Settings:
        s = cls()
        for name, env in (("election_timeout_s", "GPUHUB_ELECTION_TIMEOUT_S"),
                          ("executor_lost_s", "GPUHUB_EXECUTOR_LOST_S"),
                          ("grant_timeout_s", "GPUHUB_GRANT_TIMEOUT_S"),
                          ("ready_timeout_s", "GPUHUB_READY_TIMEOUT_S"),
                          ("gpu_linger_s", "GPUHUB_GPU_LINGER_S")):
            if os.environ.get(env):
                value = float(os.environ[env])
                if not 0.0 <= value < float("inf"):  # also NaN
                    raise RuntimeError(f"gpuhub: {env} is {os.environ[env]!r}; use a number of seconds, 0 or more")
                setattr(s, name, value)
        tracking = os.environ.get("GPUHUB_WRITE_TRACKING", "").strip()
        if tracking:
            if tracking not in ("pages", "sentinel", "hash"):
                raise RuntimeError(f"gpuhub: GPUHUB_WRITE_TRACKING is {tracking!r}; use 'pages' or 'hash'")
            s.write_tracking = "pages" if tracking == "sentinel" else tracking
        return s


@dataclass
class Peer:
    id: int
    node: str
    raft: str
    blob: str


@dataclass
class Decision:
    """How this replica takes part in one cell."""

    cell: str
    attempt: int
    executor: int | None  # None: the cell ended without an executor (see outcome)
    outcome: CellOutcome | None = None  # set when the cell already ended (abort)


def read_peers(path: str, timeout_s: float) -> list[Peer]:
    """The scheduler writes peers.json once every replica has its ports; wait for it."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gpuhub: no peers file {path} after {timeout_s:g} s; "
                               "the scheduler did not finish placing this kernel")
        time.sleep(0.05)
    doc = json.loads(Path(path).read_text())
    return [Peer(int(r["id"]), r.get("node", ""), r["raft"], r["blob"]) for r in doc["replicas"]]


def reachable(addr: str, timeout_s: float = 0.5) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class Replica:
    def __init__(self, replica_id: int, peers: list[Peer], key: bytes, journal_dir: str | None,
                 settings: Settings | None = None, *, cells_in_process: bool = False) -> None:
        self.id = replica_id
        self.peers = {p.id: p for p in peers}
        # Members that left the group (moved or replaced), kept so that a cell elected to one of
        # them is known to be lost (see _watch): their results can no longer be committed.
        self.departed: dict[int, Peer] = {}
        if replica_id not in self.peers:
            raise RuntimeError(f"gpuhub: replica {replica_id} is not in its own peers list")
        self.me = self.peers[replica_id]
        self.key = key
        self.sealer = Sealer(key)  # small images sit in the log, which pysyncobj writes to disk
        self.settings = settings or Settings.from_env()
        # CPU kernels run cells in this process: values are loaded copy-on-write from the store's
        # files (see load_value), so a cell writing them in place never changes a stored blob.
        self.cells_in_process = cells_in_process
        # The executor's copies are reused (spares) once dropped: up to EXECUTOR_SPARE_BYTES.
        self.store = BlobStore(spare_bytes=EXECUTOR_SPARE_BYTES if cells_in_process else 0,
                               file_backed=True, keep_from_forks=cells_in_process)
        # Memory of this process known to hold a blob's bytes, unwritten since: the buffers of the
        # image this replica loaded or captured last (see _buffer_for). Emptied when a cell starts
        # in this process, since the cell may write any of it.
        self.resident: dict[str, memoryview] = {}
        self.loaded_version = 0  # the log's image_version this replica's namespace holds
        self.load_error: str | None = None  # why the last image could not be loaded here (for the user)
        # (plain stream digest, buffers, names) of that image: an unchanged namespace is not committed
        self._image_key: tuple | None = None
        self._prepared: tuple | None = None  # (entry, what _build made of it): see prepare_image
        self._preparing = False  # an image was built since the last load, maybe on resident memory
        self._pending_key: tuple | None = None
        # (plain digest, blob digest) of the last stream sealed or loaded as a blob here: sealing
        # takes a random nonce, so an unchanged stream (a cell that only wrote an array in place)
        # reuses its sealed blob rather than pushing and writing a new one (see store_image)
        self._stream_blob: tuple[str, str] | None = None
        self._referenced: set[str] = set()  # blobs of the images loaded or committed here
        self._unreferenced: set[str] = set()  # blobs here but in no image at the last image
        # The last image's large values on this server's disk, to outlive this process: created
        # before the group, whose journal replays images as soon as it starts.
        self.disk = BlobDisk(os.path.join(journal_dir, "blobs"), self.store, key=key) if journal_dir else None
        host, port = self.me.blob.rsplit(":", 1)
        self.blob_server = BlobServer(self.store, key, host, int(port), log=log, name=self.me.blob)
        self.blob_server.start()
        others = [p.raft for p in peers if p.id != replica_id]
        self.raft = RaftGroup(self.me.raft, others, key, journal_dir, members=len(peers))
        self.state: KernelLog = self.raft.log
        self.state.on_apply = self._on_apply
        self.interrupted = threading.Event()
        self._closing = threading.Event()
        # Processes that fork for every cell (GPU kernels; CPU kernels tracking writes with a
        # sentinel, gpuhub/kernel/dirty.py) keep large values and blobs in 2 MiB pages so the
        # fork stays cheap (hugepages.collapse_later). The kernel sets it.
        self.huge_pages = False
        self._peers_file: str | None = None
        self._peers_mtime = 0

    @classmethod
    def from_env(cls, key: bytes, *, cells_in_process: bool = False) -> Replica | None:
        peers_file = os.environ.get("GPUHUB_PEERS_FILE")
        if not peers_file:
            return None
        settings = Settings.from_env()
        peers = read_peers(peers_file, settings.ready_timeout_s)
        replica = cls(int(os.environ.get("GPUHUB_REPLICA_ID", "0")), peers, key,
                      os.environ.get("GPUHUB_JOURNAL_DIR") or None, settings,
                      cells_in_process=cells_in_process)
        replica.watch_peers(peers_file)
        return replica

    def _on_apply(self, kind: str, cell: str) -> None:
        """On the Raft thread, after each entry. When a cell completed on another replica, the
        leader hands leadership to that executor: the executor's commits then take one round trip
        and apply locally at once, and since executors are sticky, an idle replica is seldom the
        leader, so losing one needs no Raft election before the next cell."""
        if kind != "complete":
            return
        self._persist_last_image()
        outcome = self.state.outcomes.get(cell)
        peer = self.peers.get(outcome.by) if outcome is not None else None
        if peer is not None and peer.id != self.id:
            self.raft.transfer_leadership_to(peer.raft)

    def wait_ready(self) -> None:
        if not self.raft.wait_ready(self.settings.ready_timeout_s):
            raise RuntimeError(f"gpuhub: replica {self.id} could not join its group within "
                               f"{self.settings.ready_timeout_s:g} s (is a majority of replicas running?)")
        if self.disk is not None:  # caught up: the disk may now follow the committed images
            with self.state.changed:
                self._persist_last_image()
            self.disk.start()

    def _persist_last_image(self) -> None:
        """Have the disk keep the large values of the last committed image, and only those."""
        if self.disk is not None:
            image = self.state.image
            self.disk.persist(image.blob_digests() if image is not None else set(), self.state.image_version)

    def other_blob_addrs(self) -> list[str]:
        return [p.blob for p in self.peers.values() if p.id != self.id]

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        self._closing.set()
        self.raft.destroy()
        self.blob_server.stop()
        if self.disk is not None:
            self.disk.stop()

    # --- membership: the scheduler replaced a lost replica ----------------------------
    def watch_peers(self, path: str, interval_s: float = 0.25) -> None:
        """Follow the peers file: when the scheduler replaces a replica (its node was lost) it
        rewrites every replica's file; the Raft leader then removes the old member and adds the
        new one, which catches up from a snapshot plus the log (pysyncobj)."""
        self._peers_file = path
        self._peers_mtime = os.stat(path).st_mtime_ns
        threading.Thread(target=self._membership_loop, args=(interval_s,), name="gpuhub-membership",
                         daemon=True).start()

    def _membership_loop(self, interval_s: float) -> None:
        while not self._closing.wait(interval_s):
            try:
                self.reload_peers()
                if self.raft.ready:  # whoever leads next sends newcomers its snapshot: keep it current
                    self.raft.snapshot_members()
                # One change at a time (remove, then add), each as soon as the last committed: a
                # cell may be waiting for the new member (a migration).
                while self.raft.is_leader and not self._closing.is_set():
                    done = self.raft.change_membership(
                        {p.raft for p in self.peers.values() if p.id != self.id})
                    if not done:
                        break
                    log.info("replica %d (leader): membership change committed: %s", self.id, done)
            except Exception as exc:
                log.warning("replica %d: membership update failed (will retry): %s", self.id, exc)

    def reload_peers(self) -> bool:
        """Re-read the peers file if it changed; True if it did."""
        if self._peers_file is None:
            return False
        mtime = os.stat(self._peers_file).st_mtime_ns
        if mtime == self._peers_mtime:
            return False
        peers = read_peers(self._peers_file, 0)
        self._peers_mtime = mtime
        if self.id not in {p.id for p in peers}:
            log.warning("replica %d is no longer in its kernel's group (replaced); it stays passive", self.id)
            return True
        old = set(self.peers)
        new = {p.id: p for p in peers}
        self.departed.update((i, p) for i, p in self.peers.items() if i not in new)
        self.peers = new  # one assignment: readers see the old or the new map
        log.info("replica %d: group is now %s (was %s)", self.id, sorted(self.peers), sorted(old))
        return True

    # --- 1. election -------------------------------------------------------------
    def _wait(self, predicate, timeout_s: float):
        with self.state.changed:
            return self.state.changed.wait_for(predicate, timeout_s)

    def elect(self, cell: str, attempt: int, lead: bool) -> Decision:
        """Propose, then wait until the log says who runs this attempt (or the cell ended)."""
        self.raft.propose(cell, attempt, self.id, lead)
        first_seen = time.monotonic()
        voted = False
        while True:
            timed_out = time.monotonic() - first_seen >= self.settings.election_timeout_s
            choice = None
            with self.state.changed:  # the Raft thread changes elections while it applies entries
                ended = self.state.outcomes.get(cell)
                if ended is not None:
                    return Decision(cell, attempt, None, ended)
                e = self.state.elections.get((cell, attempt))
                if e is not None and e.outcome is not None:
                    return Decision(cell, attempt, None if e.outcome == FAILED else e.outcome)
                if timed_out and not voted and e is not None:
                    choice = local_choice(e, timed_out=True)
            if choice is not None:
                self.raft.vote(cell, attempt, self.id, choice)
                voted = True
                continue
            self._wait(lambda: cell in self.state.outcomes or (
                (cell, attempt) in self.state.elections
                and self.state.elections[(cell, attempt)].outcome is not None), 0.1)

    def next_attempt(self, cell: str, attempt: int) -> int:
        """The attempt to take part in after ``attempt`` failed: the next one, or a later one the
        others have already begun (a replica handed the cell late, when it joined the group
        while the cell waited for a GPU, goes straight to where the others are)."""
        with self.state.changed:
            return max(attempt + 1, self.state.latest_attempt(cell))

    def group_whole(self) -> bool:
        """Whether this replica reaches every other member of its group now (Raft connections)."""
        return all(self.raft.connected(p.raft) for p in self.peers.values() if p.id != self.id)

    def wait_for_later_attempt(self, cell: str, attempt: int, timeout_s: float, interrupted) -> None:
        """Wait ``timeout_s`` before the next attempt at ``cell``, less when another replica has
        begun a later one (one that joined the group may be able to run it), when the cell ended,
        or when ``interrupted`` (a threading.Event) is set."""
        deadline = time.monotonic() + timeout_s
        while not interrupted.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with self.state.changed:
                if self.state.latest_attempt(cell) > attempt or cell in self.state.outcomes:
                    return
                self.state.changed.wait(min(left, 0.1))

    # --- 1'. the executor lease: most cells need no election -----------------------------
    def lease(self, cell: str) -> tuple[CellOutcome | None, int | None, bool]:
        """What this replica's log says of ``cell`` now: its outcome if it ended, the lease holder
        (the executor of the last completed cell, unless its lease was revoked), and whether an
        election for it has begun."""
        with self.state.changed:
            return self.state.outcomes.get(cell), self.state.previous_executor, self.state.election_begun(cell)

    def catch_up(self) -> None:
        """Apply everything committed so far: commit a barrier and wait until it is applied here.
        A replica the router skipped for a cell may not have applied that cell's end yet, and must
        not act on an older lease holder (a stale view could make it run a cell under a lease it
        lost, beside the real holder)."""
        token = time.monotonic_ns()
        self.raft.barrier(self.id, token)
        if not self._wait(lambda: self.state.barriers.get(self.id) == token, 30):
            raise RaftUnavailable(f"replica {self.id} did not apply its own barrier within 30 s")

    def wait_for_holder(self, cell: str, holder: int, execution_count: int, handed_to) -> CellOutcome | None:
        """Wait while the lease holder runs ``cell``. Returns the cell's outcome; or None when an
        election for it began (the holder yielded: it cannot get the GPUs now) or must begin here:
        the router did not hand the cell to the holder (``handed_to()``, the replicas that got it
        as the router told, or None when it said nothing: then every live replica got it), so the
        holder cannot run it and the lease is revoked by this replica's proposal. A holder that
        got the cell and stops answering may have started it: the cell is aborted, as when an
        elected executor is lost (a cell runs at most once)."""
        def moved() -> bool:
            to = handed_to()
            return (cell in self.state.outcomes or self.state.election_begun(cell)
                    or (to is not None and holder not in to))

        return self._watch(cell, holder, execution_count, moved, "that was to run this cell")

    def abort(self, cell: str, attempt: int, reason: str, detail: str, execution_count: int) -> CellOutcome:
        """Propose ending the cell without a result; the first ending committed wins."""
        self.raft.abort(cell, attempt, self.id, reason, detail, execution_count)
        self._wait(lambda: cell in self.state.outcomes, 30)
        return self.state.outcomes[cell]

    # --- 2. the executor's end of a cell ----------------------------------------------
    def store_image(self, stream: bytes, names: list[str], buffers: list[tuple[str | None, int, object]], *,
                    live: bool) -> ImageEntry | None:
        """Keep an image's blobs here, push the new ones to the other replicas, and return its log
        entry. ``buffers``: per out-of-band buffer, its digest when known, its size and its memory
        (None when the digest is known and stored here). ``live``: the memory is that of live
        values (an in-process cell's namespace), so a buffer the store lacks is copied in, hashed
        while it is copied; otherwise the memory is handed over and kept as it is (a GPU cell's
        child sent it, see gpuhub/kernel/child.py)."""
        refs: list[tuple[str, int]] = []
        new: dict[str, object] = {}
        resident: dict[str, memoryview] = {}
        for i, (known, n, mem) in enumerate(buffers):
            if known is not None and self.store.has(known):
                d = known
            elif mem is None:
                raise ValueError(f"buffer {i} of the image ({n} bytes) is neither stored here nor given")
            elif live:
                d, kept = self._copy_in(mem)
                if kept is not None:
                    new[d] = kept
            else:
                d = known or digest(mem)
                if not self.store.has(d):
                    self._keep(d, mem)
                    new[d] = mem
            refs.append((d, n))
            if live:
                resident.setdefault(d, mem)
                if self.huge_pages:
                    hugepages.collapse_later(mem)  # the live value: the next sentinel's fork copies less
        if live:
            self.resident = resident
        key = (digest(stream), tuple(refs), tuple(names))
        if key == self._image_key and self.up_to_date():
            return None  # the namespace is what the group has: nothing to commit
        self._pending_key = key
        small = len(stream) <= self.settings.inline_max_bytes
        # sealed first, then named: a digest of the plain bytes could be checked against a guess
        if small:
            stream = self.sealer.seal(stream)
            sd = digest(stream)
        elif self._stream_blob is not None and self._stream_blob[0] == key[0] and self.store.has(self._stream_blob[1]):
            sd = self._stream_blob[1]  # the stream the group has: its blob again
            stream = self.store.get(sd)
        else:
            stream = self.sealer.seal_stream(stream)
            sd = digest(stream)
            self.store.put(sd, stream)
            new[sd] = stream
            self._stream_blob = (key[0], sd)
        if new:
            # Done once a majority holds the new values (this replica and enough peers), as a
            # commit is: the other pushes go on meanwhile, and a replica that loads a value still
            # arriving waits for it (_blob). Best effort: one that missed it fetches it from a peer.
            peers = self.other_blob_addrs()
            late = functools.partial(self._push_failed, count=len(new))
            pushed = blobclient.push_all(peers, self.key, new, enough=len(self.peers) // 2, on_late=late)
            for addr, err in pushed.items():
                self._push_failed(addr, err, len(new))
        return ImageEntry(sd, stream if small else None, memoryview(stream).nbytes, tuple(refs), tuple(names),
                          stream_sealed=not small)

    def _push_failed(self, addr: str, err: str | None, count: int) -> None:
        if err:
            log.warning("replica %d could not push %d blob(s) to %s: %s", self.id, count, addr, err)

    def _copy_in(self, mv: memoryview) -> tuple[str, object | None]:
        """Copy a live buffer into the store (its digest computed while copying); returns the
        digest and the stored copy, or None when the store already had those bytes."""
        n = mv.nbytes
        buf = self.store.alloc(n, anonymous=True)
        view = memoryview(buf)[:n]
        d = fill_and_digest(view, lambda lo, hi: copy_into(view[lo:hi], mv[lo:hi]))
        if self.store.has(d):
            view.release()
            self.store.recycle(buf)
            return d, None
        self._keep(d, view if len(buf) != n else buf)
        if self.huge_pages:
            hugepages.collapse_later(buf)
        return d, view

    def commit_cell(self, cell: str, attempt: int, status: str, image: ImageEntry | None,
                    execution_count: int) -> bool:
        """Publish the cell's end (and the namespace image, None when unchanged); False if the
        cell had already been ended, or (a cell run under the lease) the lease was revoked first."""
        self.raft.complete(cell, attempt, self.id, status, image, execution_count)
        # The call returns when the leader applied it; wait until this replica did too.
        self._wait(lambda: cell in self.state.outcomes or self.state.refused.get(cell) == self.id, 30)
        outcome = self.state.outcomes.get(cell)
        won = outcome is not None and outcome.kind == "complete" and outcome.by == self.id
        if won and self.cells_in_process:  # the live namespace is the committed image already
            self.loaded_version = self.state.image_version
            if image is not None:
                self._image_key = self._pending_key
            self._forget_old_blobs()
        return won

    def _keep(self, d: str, data) -> None:
        """Store a blob this replica produced. A buffer from the store's :meth:`BlobStore.alloc`
        is adopted: an executor's copy, once dropped, can take the next copy (already mapped memory
        instead of a fresh gigabyte of page faults); a memfd a GPU cell's value was read into loads
        copy-on-write (:meth:`_buffer_for`), as one received from a peer does."""
        owner = data.obj if isinstance(data, memoryview) else data
        if adoptable(owner):
            self.store.adopt(d, owner, memoryview(data).nbytes)
        else:
            self.store.put(d, data)

    # --- 3. the others ------------------------------------------------------------
    def wait_for_end(self, cell: str, executor: int, execution_count: int) -> CellOutcome:
        """Wait for the executor's result; abort the cell if its replica is gone."""
        return self._watch(cell, executor, execution_count, lambda: cell in self.state.outcomes,
                           "running this cell")

    def _watch(self, cell: str, runner: int, execution_count: int, done, role: str) -> CellOutcome | None:
        """Wait until ``done()`` (then: the cell's outcome, if it ended), while ``runner``'s replica
        answers and is a member; abort the cell once it has not for ``executor_lost_s``. A runner
        that left the group (a migration moved it, its server was replaced) counts as lost even
        while it still answers: the Raft group no longer takes its entries, so its result could
        never be committed and the cell would wait for good."""
        unreachable_since = None
        while True:
            if self._wait(done, 0.5):
                with self.state.changed:
                    return self.state.outcomes.get(cell)
            peer = self.peers.get(runner)
            if peer is not None and reachable(peer.blob):
                unreachable_since = None
                continue
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since < self.settings.executor_lost_s:
                continue
            if peer is not None:
                detail = f"the replica {role} (on {peer.node or peer.raft}) stopped"
            else:
                gone = self.departed.get(runner)
                where = f" (on {gone.node or gone.raft})" if gone else ""
                detail = (f"the replica {role}{where} left this kernel's group (it was moved to another server) "
                          "before the cell ended")
            log.warning("cell %s: %s; proposing to abort it", cell, detail)
            return self.abort(cell, -1, "executor-lost", detail, execution_count)

    def _blob(self, d: str):
        data = self.store.get(d)
        if data is None and self.store.wait_incoming(d, self.settings.blob_wait_s):
            data = self.store.get(d)  # the executor's push was still arriving
        if data is None and self.disk is not None:
            data = self.disk.read(d)  # this replica kept it before it restarted
            if data is not None:
                self.store.put(d, data)
        if data is None:
            data = blobclient.fetch(self.other_blob_addrs(), self.key, d, store=self.store)
        return data

    def _buffer_for(self, d: str, n: int, used: set[str]):
        """Writable memory holding blob ``d`` for a value being loaded (the aliasing rule, see the
        module docstring): memory of this process that holds those bytes unwritten (at most once
        per load: two values must never share it), else a copy-on-write mapping of the stored
        file, else a private copy."""
        if d not in used and d in self.resident and self.resident[d].nbytes == n and not self.resident[d].readonly:
            used.add(d)
            return self.resident[d]
        data = self._blob(d)
        if n:
            try:
                mapped = self.store.map_private(d, 0, n)
            except OSError as exc:  # e.g. vm.max_map_count reached: copy instead
                log.warning("replica %d: cannot map a buffer of %s…: %s", self.id, d[:16], exc)
                mapped = None
            if mapped is not None:
                return memoryview(mapped)
        copy = new_buffer(n)
        copy_into(memoryview(copy), memoryview(data).cast("B"))
        return memoryview(copy)

    def prepare_image(self, entry: ImageEntry, namespace: dict) -> None:
        """Build ``entry``'s values now, before it is committed (a GPU replica and its own cell's
        image): an image this replica cannot load is found while the cell can still commit without
        it, and the load once it is committed takes these values (:meth:`load_image`). Raises
        what loading raised. If it is not installed after all, call :meth:`drop_prepared`."""
        self._prepared = None
        self._preparing = True
        self._prepared = (entry, self._build(entry, namespace))

    def drop_prepared(self) -> None:
        """The image :meth:`prepare_image` built will not be installed (it failed, or the cell did
        not commit it). Its values may share memory with this replica's own values (the resident
        buffers, see :meth:`_buffer_for`), which code run as they loaded may have written: that
        memory is given up and the namespace is loaded again, from the store, before the next cell."""
        self._prepared = None
        if self._preparing:
            self._preparing = False
            self.resident = {}
            self.loaded_version = -1

    def _build(self, entry: ImageEntry, namespace: dict | None) -> tuple[dict, list, str]:
        if entry.inline is not None:
            stream = self.sealer.open(entry.inline)
        elif entry.stream_sealed:
            stream = self.sealer.open_stream(self._blob(entry.stream_digest))
        else:  # an earlier release's entry
            stream = bytes(self._blob(entry.stream_digest))
        used: set[str] = set()
        buffers = [self._buffer_for(d, n, used) for d, n in entry.buffers]
        # outputs stay pending until something may read them (gpuhub/kernel/sealed_outputs.py)
        return images.load(stream, buffers, namespace, defer_outputs=True), buffers, digest(stream)

    def load_image(self, entry: ImageEntry, namespace: dict | None = None) -> dict:
        """The ``{name: value}`` of a committed image, built on this replica's memory, for
        ``namespace`` (notebook functions' globals, see gpuhub/kernel/image.py)."""
        prepared, self._prepared, self._preparing = self._prepared, None, False
        if prepared is not None and prepared[0] == entry:
            value, buffers, stream_digest = prepared[1]
        else:
            value, buffers, stream_digest = self._build(entry, namespace)
        self._image_key = (stream_digest, entry.buffers, entry.names)
        if entry.stream_sealed:
            self._stream_blob = (stream_digest, entry.stream_digest)
        self.resident = {}
        for (d, _), mv in zip(entry.buffers, buffers, strict=True):
            self.resident.setdefault(d, mv)
        if self.huge_pages:
            for mv in buffers:
                hugepages.collapse_later(mv)
        return value

    def install_image(self, ns: dict, hidden, entry: ImageEntry) -> None:
        """Load ``entry`` and make it ``ns``'s replicated part (names the previous image did not
        have, i.e. values that could not be replicated, stay)."""
        known = self._image_key[2] if self._image_key is not None else None
        images.install(ns, hidden, self.load_image(entry, ns), known)

    def _forget_old_blobs(self) -> None:
        """Drop the blobs no image needs any more: those of images older than the committed one,
        and blobs that were already here, unused, when the last image came (pushed for a cell
        whose commit lost: an abort won, or the majority was lost). Not a blob that arrived since:
        it may be for a cell not committed yet (its executor pushes before it commits), which this
        replica will need. Dropping one too early would cost a fetch from a peer, never data."""
        with self.state.changed:
            current = self.state.image
        keep = current.blob_digests() if current is not None else set()
        present = self.store.digests()
        orphans = self._unreferenced & present
        self.store.discard((self._referenced | orphans) - keep)
        self._referenced = keep
        self._unreferenced = present - keep - orphans

    def up_to_date(self) -> bool:
        """This replica's namespace holds the last committed image."""
        return self.loaded_version == self.state.image_version

    def sync_namespace(self, ns: dict, hidden, *, force: bool = False) -> bool:
        """Make ``ns`` hold the last committed image (nothing to do when it already does, unless
        ``force``). False (and ``ns`` unchanged) when it could not be loaded."""
        with self.state.changed:
            entry, version = self.state.image, self.state.image_version
        if entry is None or (version == self.loaded_version and not force):
            return True
        try:
            self.install_image(ns, hidden, entry)
        except Exception as exc:
            log.error("replica %d cannot load the namespace image: %s: %s", self.id, type(exc).__name__, exc)
            self.load_error = f"{type(exc).__name__}: {exc}"[:LOAD_ERROR_CHARS]
            return False
        self.load_error = None
        self.loaded_version = version
        self._forget_old_blobs()
        return True
