"""A kernel's replicated log: the Raft state machine its replicas share (pysyncobj, docs/architecture.md D4).

The log carries small things only: executor proposals and votes, and for each finished cell the
namespace image it produced (gpuhub/kernel/image.py: a small pickle stream inline, large parts
as content digests whose bytes travel beside the log, see :mod:`gpuhub.replication.blobclient`).
The state below is what a snapshot holds, so a replica that restarts, or a new one, rebuilds the
namespace from it plus the blobs.

Entries are applied on pysyncobj's thread; waiters on the kernel's thread sleep on ``changed``.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.syncobj import SyncObjException

from gpuhub.replication import journal_space, raft_guard
from gpuhub.replication.election import Election, local_choice

log = logging.getLogger("gpuhub.replication")
# A commit still retrying after this long is logged once (a cell that hangs leaves a trace).
SLOW_COMMIT_S = 5.0

KEEP_OUTCOMES = 256  # finished cells remembered, to ignore late entries for them
# The most bytes of entries one AppendEntries message carries; a single entry this large or larger
# would be split (see RaftGroup.__init__). A catch-up sends the log in messages this large, each
# compressed and encrypted on the leader's tick thread (tens of milliseconds at 4 MiB).
APPEND_ENTRIES_BATCH_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ImageEntry:
    """The kernel's namespace after a cell, as the log knows it (gpuhub/kernel/image.py): the
    sealed pickle stream (inline when small, else a blob named by its digest) and the digest and
    size of each out-of-band buffer, in pickle order. The bytes of blobs travel beside the log."""

    stream_digest: str  # of the sealed stream
    inline: bytes | None  # None: the stream is a blob, fetched by digest
    stream_size: int  # of the sealed stream
    buffers: tuple[tuple[str, int], ...] = ()
    names: tuple[str, ...] = ()
    # A blob stream is sealed (gpuhub/replication/sealing.py). False: an entry of a release that
    # did not have this field (its log or snapshot read after an upgrade): its blob stream is plain.
    stream_sealed: bool = False

    def blob_digests(self) -> set[str]:
        """What a replica must keep (or fetch) to load this image."""
        blobs = {d for d, _ in self.buffers}
        if self.inline is None:
            blobs.add(self.stream_digest)
        return blobs

    def nbytes(self) -> int:
        return self.stream_size + sum(n for _, n in self.buffers)


@dataclass(frozen=True)
class CellOutcome:
    kind: str  # "complete" or "abort"
    attempt: int
    by: int  # the executor (complete) or the replica whose abort committed first
    status: str = "ok"  # complete: the cell's reply status; abort: a short reason
    detail: str = ""
    execution_count: int = 0  # the kernel's prompt number after this cell


class KernelLog(SyncObjConsumer):
    """The replicated state of one kernel. Only ``@replicated`` methods change it: a replica
    commits them through :class:`RaftGroup`, and pysyncobj applies each committed entry on every
    replica; :meth:`apply` applies one to this copy alone."""

    def __init__(self, members: int) -> None:
        # Set before the base __init__: pysyncobj leaves these out of snapshots.
        self.changed = threading.Condition()
        self.on_apply = None  # optional callable(kind, cell) for metrics/logging
        super().__init__()
        self.members = members
        self.image: ImageEntry | None = None  # None: no cell has completed yet
        self.image_version = 0  # counts committed images: a replica compares it with what it loaded
        self.execution_count = 0  # IPython's next prompt number; 0 = no cell yet
        self.previous_executor: int | None = None
        self.elections: dict[tuple[str, int], Election] = {}
        self.outcomes: OrderedDict[str, CellOutcome] = OrderedDict()
        # cell -> the replica whose complete was refused (it ran under a lease it had lost)
        self.refused: OrderedDict[str, int] = OrderedDict()
        self.barriers: dict[int, int] = {}  # replica -> its last barrier's token

    # --- helpers (not replicated) ---------------------------------------------
    def _election(self, cell: str, attempt: int, first: int | None = None) -> Election | None:
        """The election of this attempt at ``cell``, begun by this entry if it is the first
        (``first``: the replica whose proposal begins it)."""
        if cell in self.outcomes:
            return None  # late entry for a finished cell
        key = (cell, attempt)
        if key not in self.elections:
            previous = self.previous_executor
            if attempt == 0 and first is not None and first != previous:
                # The executor lease (docs/architecture.md, "One commit per cell"): the lease
                # holder runs the next cell without any election, and only it begins one at
                # attempt 0, when it cannot run the cell (it yields). Another replica begins it
                # only when the router did not hand the cell to the holder: that revokes the
                # holder's lease for this cell (an election for it exists now, see holds_lease),
                # in log order, before the holder could complete it; nobody waits for the holder.
                previous = None
            # Proposals for a cell this replica has not reached yet are kept here: buffered.
            self.elections[key] = Election(cell, attempt, previous, self.members)
        return self.elections[key]

    def election_begun(self, cell: str) -> bool:
        """Whether an election (any attempt) for ``cell`` has an entry (whether or not the cell ended)."""
        return any(key[0] == cell for key in self.elections)

    def latest_attempt(self, cell: str) -> int:
        """The highest attempt at ``cell`` that has an entry here; -1 when none has."""
        return max((attempt for c, attempt in self.elections if c == cell), default=-1)

    def holds_lease(self, cell: str, replica: int) -> bool:
        """Whether ``replica`` may run ``cell`` under the executor lease: it executed the last
        completed cell, nothing has ended ``cell`` and no election for it has begun."""
        return (self.previous_executor == replica and cell not in self.outcomes
                and not self.election_begun(cell))

    def _finish(self, cell: str, outcome: CellOutcome) -> None:
        self.outcomes[cell] = outcome
        while len(self.outcomes) > KEEP_OUTCOMES:
            self.outcomes.popitem(last=False)
        for key in [k for k in self.elections if k[0] == cell]:
            del self.elections[key]

    def _applied(self, kind: str, cell: str) -> None:
        self.changed.notify_all()
        if self.on_apply is not None:
            self.on_apply(kind, cell)

    def apply(self, entry: str, *args):
        """Apply one entry (``"propose"``, ``"vote"``, ``"complete"``, ``"abort"``, ``"barrier"``) to this copy
        only, as pysyncobj does once it is committed: replays and tests, no group needed."""
        return getattr(self, entry)(*args, _doApply=True)  # pysyncobj's flag for "apply, do not replicate"

    # --- replicated entries -----------------------------------------------------
    # pysyncobj numbers these by sorted name, and journals and peers carry the numbers: adding,
    # removing or renaming one changes the format (replicas of one kernel must run the same one).
    @replicated
    def propose(self, cell: str, attempt: int, replica: int, lead: bool) -> None:
        with self.changed:
            e = self._election(cell, attempt, first=replica)
            if e is not None:
                e.add_proposal(replica, lead)
                if e.outcome is None:
                    # A choice every replica would make without a timeout is the same everywhere:
                    # the log decides it here, saving a vote round trip on the common path.
                    choice = local_choice(e, timed_out=False)
                    if choice is not None:
                        e.add_vote(choice)
            self._applied("propose", cell)

    @replicated
    def vote(self, cell: str, attempt: int, voter: int, choice: int) -> None:
        """An explicit vote, cast after a replica's election timeout (a member may be dead)."""
        with self.changed:
            e = self._election(cell, attempt)
            if e is not None:
                e.add_vote(choice)
            self._applied("vote", cell)

    @replicated
    def barrier(self, replica: int, token: int) -> None:
        """Nothing but a place in the log: a replica that applied its own barrier has applied
        everything committed before it (how a replica that missed cells catches up, see
        ``Replica.catch_up``)."""
        with self.changed:
            self.barriers[replica] = token
            self._applied("barrier", "")

    @replicated
    def complete(self, cell: str, attempt: int, executor: int, status: str, image: ImageEntry | None,
                 execution_count: int) -> bool:
        """The executor's end of a cell (``image`` None: the namespace did not change). Loses
        (returns False) if another end committed first, or if ``executor`` was not entitled to
        run the cell: elected for this attempt, or (no election for the cell) the lease holder."""
        with self.changed:
            if cell in self.outcomes:
                self._applied("complete-late", cell)
                return False
            e = self.elections.get((cell, attempt))
            if not (self.holds_lease(cell, executor) if e is None and attempt == 0 else
                    e is not None and e.outcome == executor):
                self.refused[cell] = executor
                while len(self.refused) > KEEP_OUTCOMES:
                    self.refused.popitem(last=False)
                self._applied("complete-refused", cell)
                return False
            if image is not None:
                self.image = image
                self.image_version += 1
            self.execution_count = execution_count
            self.previous_executor = executor
            self._finish(cell, CellOutcome("complete", attempt, executor, status,
                                           execution_count=self.execution_count))
            self._applied("complete", cell)
            return True

    @replicated
    def abort(self, cell: str, attempt: int, reporter: int, reason: str, detail: str,
              execution_count: int) -> bool:
        """A cell ends without a result (its executor was lost, no GPU in time, interrupted)."""
        with self.changed:
            if cell in self.outcomes:
                self._applied("abort-late", cell)
                return False
            self.execution_count = execution_count
            if reason == "executor-lost":
                self.previous_executor = None  # do not wait for a dead replica in the next election
            self._finish(cell, CellOutcome("abort", attempt, reporter, reason, detail, self.execution_count))
            self._applied("abort", cell)
            return True


def raft_password(key: bytes) -> str:
    """The Raft group's password, derived from the kernel's connection key (which only the user's
    server and the replicas hold): pysyncobj encrypts its pickle wire format with it."""
    return hmac.new(key, b"gpuhub-raft-v1", "sha256").hexdigest()


class RaftGroup:
    """One replica's membership in its kernel's Raft group: the typed API callers use.

    Modelled on pysyncobj's batteries: :class:`KernelLog` is the replicated implementation,
    this class the thin wrapper around it and the ``SyncObj`` that replicates it. Entries are
    committed with typed methods (:meth:`propose`, :meth:`vote`, :meth:`complete`,
    :meth:`abort`), each blocking until the leader applied it and retrying while a leader is
    being elected; the state itself is read from :attr:`log`. Every use of pysyncobj's internals
    is in this module.
    """

    def __init__(self, self_addr: str, peer_addrs: list[str], key: bytes, journal_dir: str | None,
                 members: int, *, connection_retry_s: float = 0.5) -> None:
        self.log = KernelLog(members)
        if journal_dir:
            _private_journal(journal_dir)
        conf = SyncObjConf(
            appendEntriesUseBatch=False,  # else every commit waits for the batch tick (~100 ms)
            # pysyncobj (0.3.17) sends an entry of this size or more in parts, and marks the wrong
            # part as the last: a follower's tick fails on the truncated pickle and takes the entry
            # only with a later part, slowly. Entries here are far smaller (images inline up to
            # 16 KiB, about 1.7 times that pickled), so each goes whole, in one message.
            appendEntriesBatchSizeBytes=APPEND_ENTRIES_BATCH_BYTES,
            password=raft_password(key),
            journalFile=f"{journal_dir}/raft.journal" if journal_dir else None,
            fullDumpFile=f"{journal_dir}/raft.dump" if journal_dir else None,
            dynamicMembershipChange=True,
            raftMinTimeout=0.4, raftMaxTimeout=1.0, connectionTimeout=2.0,
            bindRetryTime=0.2,
            # default 5 s: a restarted peer would wait that long to rejoin
            connectionRetryTime=connection_retry_s,
            useFork=False,  # a forked snapshot would copy the whole kernel process (and its namespace)
        )
        raft_guard.install()  # a stranger's bytes are bounded before they authenticate
        journal_space.install()  # a full disk stops this replica cleanly, never with a SIGBUS
        self._sync = SyncObj(self_addr, peer_addrs, conf=conf, consumers=[self.log])
        self._snapshot_members: set[str] | None = None  # the members the last snapshot_members() wrote
        self._sync.addOnTickCallback(self._tick_again_when_alone)
        if journal_dir:
            _private_journal(journal_dir)  # again: pysyncobj has created its files now

    def _tick_again_when_alone(self) -> None:
        """Called on pysyncobj's tick thread just before it polls. A leader advances its commit index
        at the start of a tick, after it appended the entry in the tick before; a peer's answer wakes
        the poll in between, but a group of one (a kernel with one replica) hears none, so each of its
        commits waited out the 50 ms tick period (60 ms no-op cells). Wake the poll at once instead."""
        sync = self._sync
        # Only a leader: one that restarted from its journal holds entries it may commit only once
        # elected (at a later tick, when its election timeout is due); waking it before would spin.
        if (not sync.otherNodes and sync._isLeader()
                and sync.raftCommitIndex < sync._SyncObj__getCurrentLogIndex()):
            sync._SyncObj__pipeNotifier.notify()

    # --- entries ----------------------------------------------------------------
    def propose(self, cell: str, attempt: int, replica: int, lead: bool, *,
                timeout_s: float = 30.0) -> None:
        """``replica`` proposes to lead (``lead``) or to yield this attempt of ``cell``."""
        self._commit("propose", self.log.propose, cell, attempt, replica, lead, timeout_s=timeout_s)

    def vote(self, cell: str, attempt: int, voter: int, choice: int, *,
             timeout_s: float = 30.0) -> None:
        """An explicit vote for ``choice`` (a replica, or ``election.FAILED``) after a timeout."""
        self._commit("vote", self.log.vote, cell, attempt, voter, choice, timeout_s=timeout_s)

    def complete(self, cell: str, attempt: int, executor: int, status: str, image: ImageEntry | None,
                 execution_count: int, *, timeout_s: float = 30.0) -> bool:
        """The executor's end of ``cell``; False if another end committed first."""
        return self._commit("complete", self.log.complete, cell, attempt, executor, status, image,
                            execution_count, timeout_s=timeout_s)

    def barrier(self, replica: int, token: int, *, timeout_s: float = 30.0) -> None:
        """Commit a barrier (see :meth:`KernelLog.barrier`)."""
        self._commit("barrier", self.log.barrier, replica, token, timeout_s=timeout_s)

    def abort(self, cell: str, attempt: int, reporter: int, reason: str, detail: str,
              execution_count: int, *, timeout_s: float = 30.0) -> bool:
        """End ``cell`` without a result; False if another end committed first."""
        return self._commit("abort", self.log.abort, cell, attempt, reporter, reason, detail,
                            execution_count, timeout_s=timeout_s)

    no_majority_s = 4.0
    """Give up on a commit after this long when fewer than a majority of members are connected
    (a user then gets an error reply within seconds, not a cell that hangs)."""

    def majority_connected(self) -> bool:
        members = self.members
        return 2 * (1 + sum(self.connected(a) for a in members)) > len(members) + 1

    def _commit(self, name: str, entry, *args, timeout_s: float):
        """Commit one entry (``entry``: a ``@replicated`` method of :attr:`log`); retries while a
        leader is being elected. Raises RaftUnavailable: after ``timeout_s``, or sooner
        (:attr:`no_majority_s`) when a majority of the group is not even connected."""
        started = time.monotonic()
        deadline = started + timeout_s
        delay = 0.02
        last = None
        slow_logged = False
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if not slow_logged and now - started >= SLOW_COMMIT_S:
                # the journal of a cell that hangs: which entry waited, and on what
                log.warning("committing %r has taken %.0f s so far (last error: %s; leader: %s)", name,
                            now - started, last, self._sync._getLeader())
                slow_logged = True
            if remaining <= 0 or (now - started >= self.no_majority_s and not self.majority_connected()):
                raise RaftUnavailable(f"the kernel's replicas could not agree on {name!r} within "
                                      f"{now - started:.0f} s ({last}); is a majority of them alive?")
            try:
                return entry(*args, sync=True, timeout=min(remaining, 1.0))
            except SyncObjException as exc:
                last = exc.errorCode
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    # --- the group --------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sync.isReady():
                return True
            time.sleep(0.02)
        return False

    @property
    def ready(self) -> bool:
        """Caught up with the group (journal and peers) since it started."""
        return self._sync.isReady()

    @property
    def address(self) -> str:
        """This replica's Raft address."""
        return self._sync.selfNode.address

    @property
    def is_leader(self) -> bool:
        # private: the public getStatus() builds a dict of everything, on every cell
        return self._sync._isLeader()

    @property
    def leader(self) -> str | None:
        """The last known leader's address (possibly outdated)."""
        leader = self._sync.getStatus()["leader"]
        return None if leader is None else str(leader)

    @property
    def log_length(self) -> int:
        """Entries in this replica's Raft log since its last snapshot."""
        return self._sync.getStatus()["log_len"]

    @property
    def members(self) -> set[str]:
        """The other members' Raft addresses, as this replica's log has them now."""
        for _ in range(3):
            try:
                return {n.address for n in self._sync.otherNodes}
            except RuntimeError:  # the Raft thread changed the set while it was copied; read again
                continue
        return {n.address for n in self._sync.otherNodes}

    def connected(self, addr: str) -> bool:
        return self._sync.getStatus().get(f"partner_node_status_server_{addr}", 0) == 2

    def change_membership(self, want: set[str], timeout_s: float = 10.0) -> str | None:
        """One Raft membership change toward ``want`` (the other members' addresses), on the leader.

        Removals go first: with one of three members dead, removing it needs the two live ones,
        while adding first would make a group of four that needs three, the newcomer included.
        Returns what was done (None: nothing to do); raises RaftUnavailable if it did not commit.
        """
        have = self.members
        gone, new = sorted(have - want), sorted(want - have)
        if gone:
            what, addr, change = "remove", gone[0], self._sync.removeNodeFromCluster
        elif new:
            what, addr, change = "add", new[0], self._sync.addNodeToCluster
            # The newcomer catches up from this leader's snapshot when the log it needs is
            # compacted away, and takes the snapshot's member list as its group until it applies
            # the entries after it: a snapshot older than the members it must hear from leaves it
            # deaf to them for good (see snapshot_members).
            if not self.snapshot_members():
                raise RaftUnavailable(f"membership change ({what} {addr}) not begun: this replica's "
                                      "snapshot could not be brought up to date")
        else:
            return None
        done = threading.Event()
        result: dict = {}

        def finished(res, err) -> None:
            result["err"] = err
            done.set()

        change(addr, callback=finished)
        if not done.wait(timeout_s) or result.get("err") != FAIL_REASON.SUCCESS:
            raise RaftUnavailable(f"membership change ({what} {addr}) did not commit: "
                                  f"{result.get('err', 'timeout')}")
        return f"{what} {addr}"

    def transfer_leadership_to(self, addr: str) -> None:
        """If this replica leads, ask ``addr`` to take over (pysyncobj TimeoutNow; it must be fully
        caught up, else nothing happens). Call on the Raft thread (e.g. from ``on_apply``)."""
        if self.is_leader:
            self._sync.transferLeadership(addr)

    def compact_log(self) -> None:
        """Snapshot the state now (pysyncobj does it by itself as the log grows)."""
        self._sync.forceLogCompaction()

    def snapshot_members(self, timeout_s: float = 5.0) -> bool:
        """Make sure this replica's snapshot names the members it has now; False if a snapshot
        was needed and not written within ``timeout_s``.

        A snapshot carries the member list of its time, and pysyncobj gives a replica that loads
        one (a newcomer catching up) exactly that group: it drops every other peer and refuses
        their connections until later log entries add them back. A replica keeps the snapshot it
        joined with until it compacts its own log (5 minutes on), so after a few replacements in
        a row the leader's snapshot may name none of the members now running: a newcomer that
        loaded it heard nobody again and never joined (seen after three drains of a kernel's
        servers, then a lost one). Snapshotting whenever the members changed keeps the list
        current wherever a newcomer gets it from.
        """
        members = self.members | {self.address}
        if members == self._snapshot_members:
            return True
        sync = self._sync
        # pysyncobj names a snapshot by the entry before the last applied one, and writes none
        # when that one has one already (the members it lists are then those of now).
        due = sync._SyncObj__raftLastApplied - 1
        if not self._snapshot_covers(due):
            sync.forceLogCompaction()
            deadline = time.monotonic() + timeout_s
            while not self._snapshot_covers(due):
                if time.monotonic() >= deadline or self.stopped:
                    return False
                time.sleep(0.01)
        self._snapshot_members = members
        return True

    def _snapshot_covers(self, index: int) -> bool:
        written = self._sync._SyncObj__lastSerializedEntry
        return written is not None and written >= index

    def destroy(self) -> None:
        """Ask pysyncobj's thread to stop (see :attr:`stopped`)."""
        self._sync.destroy()

    @property
    def stopped(self) -> bool:
        """pysyncobj's thread has ended: its port and journal are free."""
        return not self._sync.tick_thread_alive()


def _private_journal(journal_dir: str) -> None:
    """The journal's directory is the user's alone (0700) and its files are 0600: the log holds
    the notebook's small values (sealed, gpuhub/replication/sealing.py), and other users share
    the server. pysyncobj creates its files with the process's umask (the user's, which cells
    rely on for their own files): they are made 0600 once they exist, and a snapshot rewritten
    later is still inside the 0700 directory."""
    os.makedirs(journal_dir, mode=0o700, exist_ok=True)
    os.chmod(journal_dir, 0o700)
    for name in os.listdir(journal_dir):
        path = os.path.join(journal_dir, name)
        if name.startswith("raft.") and os.path.isfile(path):
            os.chmod(path, 0o600)


class RaftUnavailable(RuntimeError):
    pass
