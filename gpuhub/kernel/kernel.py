"""The gpuhub kernel: an IPython kernel that executes each cell of a GPU kernel in a forked child
holding a per-cell GPU lease (docs/architecture.md D2). CPU-only kernels execute in-process, as ipykernel does.

A kernel started with a peers file is one replica of a Raft group (gpuhub/kernel/replica.py):
every cell first elects its executor, only the executor runs it, the others load what it changed.
The agent always gives a kernel its peers file (a group of one at least); only a CPU kernel may
run without one, started by hand, as a plain IPython kernel.

Where a cell is executed: :meth:`GpuhubKernel.do_execute` → :meth:`_execute_replicated` (election)
→ :meth:`_run_here` → in-process, or :meth:`_run_child` → :func:`gpuhub.kernel.child.serve` in a
process forked ahead of need (:mod:`gpuhub.kernel.cell_process`).
"""

from __future__ import annotations

import asyncio
import functools
import linecache
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time

import ipykernel.compiler
from ipykernel.compiler import XCachingCompiler
from ipykernel.ipkernel import IPythonKernel

from gpuhub.kernel import dirty, hugepages, memory_limit, process_state, random_state, sealed_outputs, shell_settings
from gpuhub.kernel import image as images
from gpuhub.kernel.cell_process import CHILD_FAILED, CellProcess, LingeringProcess
from gpuhub.kernel.moves import MoveRequests
from gpuhub.kernel.pipe import FrameWriter
from gpuhub.kernel.reaper import CellReaper
from gpuhub.kernel.refusals import Refusals
from gpuhub.kernel.replica import Replica
from gpuhub.kernel.wait_notice import WaitNotice
from gpuhub.kernel.warm_imports import ImportWarmer
from gpuhub.platform.messages import DISPATCH_NOTE, GROUP_CHANGE
from gpuhub.platform.move_fence import CellMark
from gpuhub.replication.log import CellOutcome, RaftUnavailable

log = logging.getLogger("gpuhub.kernel")
ABORT_NAMES = {"executor-lost": "ExecutorLost", "no-gpu": "GpuWaitTimeout", "interrupted": "KeyboardInterrupt",
               "majority-lost": "ReplicasUnavailable", "quota": "GpuQuotaExceeded"}


def _child_phases(forking: float | None, handed: float, marks: dict[str, float],
                  received: float) -> dict[str, float]:
    """Where a GPU cell's child spent its time (CLOCK_MONOTONIC is one clock for both processes).
    ``forking``: when it was forked for this cell; None when it was forked ahead (a spare). ``wait``:
    from handing it the cell until it took it (a spare still arming its tracker makes this longer)."""
    phases = {"fork": marks["started"] - forking, "arm": marks["armed"] - marks["started"]} if forking else {}
    phases.update({"wait": marks["go"] - handed, "setup": marks["ready"] - marks["go"],
                   "cell": marks["ran"] - marks["ready"], "delta": marks["sent"] - marks["ran"],
                   "pipe": received - marks["sent"]})
    return phases


# A spare cell process unused this long is ended (not forked again until the next cell): while it
# lives, every page the replica writes is copied once, so an idle kernel's would double over time.
SPARE_MAX_IDLE_S = 600.0


def send_output_now() -> None:
    """Hand what the cell printed and displayed to ZeroMQ before its end commits: once it has, a
    follower's reply may stand in for this replica's if it dies (the router, docs/architecture.md
    D3), and a client takes nothing after that reply's idle. ipykernel sends a cell's output from
    its IOPub thread, in order; a flush of stdout waits until that thread has sent all that came
    before it (displays included), and stderr's is needed only when it holds text."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and (stream is sys.stdout or getattr(stream, "_flush_pending", True)):
            try:
                stream.flush()
            except Exception as exc:  # a cell may have left sys.stdout as anything: the commit comes first
                log.debug("could not flush %r before the commit: %s", stream, exc)


def _describe_status(status: int, oom_before: memory_limit.OomCounts | None = None) -> str:
    """How a cell's process ended; ``oom_before``: its cgroup's out-of-memory counters when its
    cell began (:mod:`gpuhub.kernel.memory_limit`), so that a kill by the OOM killer says so."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:  # a real-time signal other than SIGRTMIN/SIGRTMAX
            name = signal.strsignal(sig) or "unnamed"
        said = f"was killed by signal {sig} ({name})"
        why = memory_limit.killed_by(oom_before, memory_limit.oom_counts()) if sig == signal.SIGKILL else ""
        return f"{said}: {why}" if why else said
    if os.WEXITSTATUS(status) == CHILD_FAILED:
        return "failed in gpuhub's code"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _name_cells_per_kernel() -> None:
    """Name compiled cells after the kernel, not the process: ipykernel files cell n's code under
    a directory named after the pid, and a function keeps that name (its ``co_filename``) wherever
    it travels. Every replica and every GPU cell's child is another process, so with pid names a
    function defined on one could not find its source on another (``inspect.getsource``, the
    lines in a traceback, ``%debug``). With one name per kernel, a replica that records the cell
    (:meth:`GpuhubKernel._remember_cell`) has the source under the name the function carries."""
    kernel_id = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("GPUHUB_KERNEL_ID", "") or str(os.getpid()))
    directory = os.path.join(tempfile.gettempdir(), f"ipykernel_gpuhub_{kernel_id}")
    ipykernel.compiler.get_tmp_directory = lambda: directory


class GpuhubKernel(Refusals, IPythonKernel):
    implementation = "gpuhub"
    implementation_version = "0.1.0"
    refused = ("debugger", "kernel subshells")  # gpuhub/kernel/refusals.py

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gpus = int(os.environ.get("GPUHUB_KERNEL_GPUS", "0") or 0)
        self.grant_timeout_s = float(os.environ.get("GPUHUB_GRANT_TIMEOUT_S", "300"))
        self.lease_client = None
        self._quota_refusal: str | None = None  # the agent's words when a quota refused the last ask
        if self.gpus > 0:
            # GPU kernels only: CPU cells need no lease, and its HTTP client (urllib3) would cost
            # every replica's start ~30 ms of CPU (as gpuhub.kernel.child costs ~10 ms).
            from gpuhub.kernel.lease_client import LeaseClient

            self.lease_client = LeaseClient.from_env()
        # A GPU cell's process exits and its grant ends after the reply (gpuhub/kernel/reaper.py).
        # A cell's process may instead stay for the next cell (a lingering lease, _keep_lingering).
        if self.lease_client is not None:
            self.reaper = CellReaper(self.lease_client.release, self.lease_client.linger)
        else:
            self.reaper = CellReaper(lambda grant: None)
        self._lingering: LingeringProcess | None = None  # the last GPU cell's process, kept for the next
        self._warm: LingeringProcess | None = None  # the one the cell now starting runs in
        self._child_pid: int | None = None
        self._spare: CellProcess | None = None  # the next GPU cell's process, forked ahead of need
        self._spare_wanted = False  # this replica ran the last GPU cell: it likely runs the next
        self._spare_lock = threading.Lock()
        self._interrupted = threading.Event()
        self._joined_names: list[str] = []  # names this replica caught up with at start
        self._unreplicable: dict[str, int] = {}  # name -> id of the value last warned about
        self._unfinished: str | None = None  # a cell this replica gave up on without a majority
        self._unfinished_lock = threading.Lock()
        self._startup_notice = self._notebook_dir_notice()
        self._running_here = False  # a CPU cell of this replica is running in-process
        # CPU kernels: the write tracker for this replica's next cell, armed once the last cell's
        # idle went out (resident map it was armed over, tracker, known_digest), and the last
        # cell's tracker, ended then too: neither costs the reply's time (_between_cells).
        self._next_tracker: tuple[dict, object, object] | None = None
        self._spent_tracker = None
        # buffers this replica's last cell wrote in place (hashed, not tracked, at the next), and the
        # id of the resident map they were found in: a replica that loaded another image since holds
        # others (an id, not the map: that would keep the old buffers alive; a reused id only costs a hash)
        self._written: tuple[int, set[tuple[int, int]]] = (0, set())
        self._arm_after_idle = False
        self._role = "executor"  # this replica's part in the current request (reply metadata)
        self._cell_executor: int | None = None  # a follower's: the replica that ran (or ended) the cell
        self._phases: dict[str, float] = {}  # seconds per phase of the last cell (debug log)
        self._cell_arrived = time.monotonic()  # when the cell now running reached this replica
        self._notes: dict[str, dict] = {}  # cell -> what the router said of it (missed, to)
        self.control_handlers[DISPATCH_NOTE] = self._on_dispatch_note
        # GPU kernels: what a cell's child imported is imported here between cells, when safe
        self.import_warmer = ImportWarmer() if self.gpus > 0 else None
        if self.gpus > 0:
            from gpuhub.kernel import child

            child.warm_up(self.shell)  # every GPU cell's child starts from these caches
        self.replica = Replica.from_env(self.session.key, cells_in_process=self.gpus == 0)
        if self.replica is None and self.gpus > 0:
            # a GPU cell gets its lease through the group's election (a group of one at least)
            raise RuntimeError("gpuhub: a GPU kernel runs in a group of replicas and GPUHUB_PEERS_FILE "
                               "is unset; start it through the agent or `gpuhub local-kernel`")
        # A CPU cell holds no lease: this mark tells the agent it runs one, so that a drain or a
        # migration moves this replica only between cells (gpuhub/platform/move_fence.py).
        self.cell_mark = CellMark.from_env() if self.replica is not None and self.gpus == 0 else None
        if self.replica is not None:
            process_state.take_baseline()  # before any cell: what cells change is carried in each image
            shell_settings.take_baseline()
            shell_settings.defer_code(self.gpus > 0)  # a GPU kernel's replica must never initialise CUDA
            random_state.take_baseline()
            # ipykernel sleeps 0.5 ms between flushing a cell's output and sending its reply (a
            # mitigation, its comment says), which every cell of three replicas paid on its path.
            # Clients take a cell's output until its idle, which follows that output on the same
            # socket (the router forwards the executor's idle only after its reply), so no client
            # needs the reply to come last.
            self._execute_sleep = 0.0
            # every GPU cell forks this process; so does a CPU cell's write-tracking sentinel
            self.replica.huge_pages = self.gpus > 0 or (
                self.replica.settings.write_tracking == "pages" and dirty.in_process_signal() == "sentinel")
            # Joining the group (a Raft leader election, catching up) takes a second or so: it
            # runs beside the kernel's start, so kernel_info is answered meanwhile and only the
            # first cell waits for it (_joined).
            _name_cells_per_kernel()
            self._joined = threading.Event()
            self._unhidden = False
            threading.Thread(target=self._join_group, name="gpuhub-join", daemon=True).start()

    def _join_group(self) -> None:
        """Catch up (journal + peers) before the first cell: a restarted replica's namespace is
        the group's, not empty. A replica that cannot join exits, with the reason in its log."""
        try:
            self.replica.wait_ready()
            if not self.replica.sync_namespace(self.shell.user_ns, self.shell.user_ns_hidden):
                log.error("replica %d started without the group's variables", self.replica.id)
            image = self.replica.state.image
            self._joined_names = list(image.names) if image is not None else []  # what was loaded
            if self.replica.state.execution_count:
                self.shell.execution_count = self.replica.state.execution_count
            log.info("replica %d ready: %d name(s), next prompt %d", self.replica.id,
                     len(self._joined_names), self.shell.execution_count)
            self._joined.set()
        except BaseException as exc:
            log.critical("%s", exc)
            sys.stderr.flush()
            os._exit(3)

    async def _wait_joined(self) -> None:
        if not self._joined.is_set():
            await asyncio.to_thread(self._joined.wait)
        if not self._unhidden:
            shell_settings.reapply()  # taken on by the joining thread: NumPy's lived in its context
            # IPython hides what is in the namespace at start-up from %who (hide_initial_ns); the
            # names this replica caught up with must stay visible, and in the namespace image.
            for name in self._joined_names:
                self.shell.user_ns_hidden.pop(name, None)
            self._unhidden = True

    def _abort_queues(self, *args, **kwargs):
        # With replicas, the router alone aborts the requests queued behind an error (it holds
        # them; gpuhub/server/router.py): a replica aborting its own queue would disagree with
        # the others about which cells ran.
        if self.replica is None:
            return super()._abort_queues(*args, **kwargs)
        return None

    def finish_metadata(self, parent, metadata, reply_content):
        metadata = super().finish_metadata(parent, metadata, reply_content)
        if self.replica is not None:
            # The router forwards only the executor's execute_reply (docs/architecture.md D3), or a
            # follower's, which names the executor, once that executor is gone without its reply.
            metadata["gpuhub"] = {"replica": self.replica.id, "role": self._role}
            if self._role == "follower" and self._cell_executor is not None:
                metadata["gpuhub"]["executor"] = self._cell_executor
        return metadata

    @staticmethod
    def _notebook_dir_notice() -> str:
        wanted = os.environ.get("GPUHUB_NOTEBOOK_DIR", "")
        if wanted and not os.path.isdir(wanted):
            return (f"[gpuhub] the notebook's directory {wanted} does not exist on node "
                    f"{os.environ.get('GPUHUB_NODE', '?')}; this kernel started in {os.getcwd()}\n")
        return ""

    # --- execution -----------------------------------------------------------
    async def do_execute(self, code, silent, store_history=True, user_expressions=None,
                         allow_stdin=False, *, cell_meta=None, cell_id=None):
        self._role, self._cell_executor = "executor", None
        if self.replica is not None:
            await self._wait_joined()
            # Joining loads the namespace on its own thread with sys.stdout and sys.stderr swapped
            # for a sink (gpuhub/kernel/quiet.py). A request dispatched meanwhile (this cell, on a
            # replica that joined while it waited) told the sink its parent, not the kernel's
            # streams: its output would go out with no parent, and clients drop such output.
            self.shell.set_parent(self.get_parent("shell"))
            try:
                return await self._execute_replicated(code, silent, store_history, user_expressions,
                                                      allow_stdin, cell_meta=cell_meta, cell_id=cell_id)
            except RaftUnavailable as exc:
                return self._no_majority(exc, self.get_parent("shell")["header"]["msg_id"], ran=False)
        self._show_startup_notice()  # a CPU kernel started by hand, without a group: plain ipykernel
        return await super().do_execute(code, silent, store_history, user_expressions, allow_stdin,
                                        cell_meta=cell_meta, cell_id=cell_id)

    def _show_startup_notice(self) -> None:
        if self._startup_notice:
            sys.stderr.write(self._startup_notice)
            self._startup_notice = ""

    # --- replicated execution ---------------------------------------------------
    async def _execute_replicated(self, code, silent, store_history, user_expressions, allow_stdin, *,
                                  cell_meta=None, cell_id=None) -> dict:
        rep = self.replica
        cell = self.get_parent("shell")["header"]["msg_id"]
        self._drop_warm()  # taken by the last cell's _run_child; left only by an error
        self._cell_arrived = time.monotonic()
        self._interrupted.clear()
        rep.interrupted.clear()
        if self._unfinished is not None:  # a cell that ran here when the group had no majority
            self._end_unfinished()
        try:
            if self._note(cell).get("missed"):
                rep.catch_up()  # the router skipped this replica for a cell: see the holder as it is now
            ran = await self._run_under_lease(rep, cell, code, silent, store_history, user_expressions,
                                              allow_stdin, cell_meta, cell_id)
        finally:
            self._forget_note(cell)
        if ran is not None:
            return ran
        self._end_lingering()  # an election: whichever replica runs the cell asks for GPUs afresh
        started, told, backoff = time.monotonic(), None, 0.1
        # A replica handed the cell late (it joined the group while the cell waited) goes straight
        # to the attempt the others are at.
        attempt = rep.next_attempt(cell, -1)
        moves = MoveRequests(self.lease_client)
        notice = WaitNotice(cell, self._publish_to_cell)
        group = set(rep.peers)  # a change during this cell: a replica moved for it (a migration)
        # Every replica asks its agent; most give the grant back at once. So the first round ends
        # no other kernel's warm process (a lingering lease) for that; each later one lets one
        # replica do so, in turn by id (attempts are numbered alike on every replica).
        first = attempt
        while True:
            asked = time.monotonic()
            self.reaper.wait()  # the previous GPU cell's grant must be back before this one asks
            reaped = time.monotonic()
            ids = sorted(rep.peers)
            tentative = attempt == first
            grant = self._try_grant(reclaim=not tentative and ids[attempt % len(ids)] == rep.id)
            granted = time.monotonic()
            try:
                lead = grant is not None if self.gpus else self._mark_cpu_cell()
                decision = rep.elect(cell, attempt, lead=lead)
            except BaseException:
                if grant is not None:
                    self.lease_client.release(grant)
                self._end_cpu_mark()
                raise
            if decision.executor != rep.id or decision.outcome is not None:
                self._end_cpu_mark()
            self._phases = {"reap": reaped - asked, "grant": granted - reaped, "elect": time.monotonic() - granted}
            if grant is not None and decision.executor != rep.id:
                self.lease_client.release(grant)  # losers give their tentative grant back at once
            if decision.outcome is not None:  # this replica is late: the cell already ended
                return self._follow(decision.outcome, code, store_history, silent)
            log.debug("cell %s attempt %d: executor %s after %.1f ms (raft leader here: %s)", cell, attempt,
                      decision.executor, (time.monotonic() - started) * 1000, rep.raft.is_leader)
            if decision.executor is not None:
                try:
                    notice.settle(self._waited_text(time.monotonic() - started, rep, decision.executor),
                                  runs_it_after=attempt if decision.executor == rep.id else None)
                except BaseException:
                    self._end_cpu_mark()  # marked as the executor, and never to run it
                    raise
            if decision.executor == rep.id:
                return await self._execute_here(cell, attempt, grant, code, silent, store_history,
                                                user_expressions, allow_stdin, cell_meta, cell_id)
            if decision.executor is not None:
                return self._follow(rep.wait_for_end(cell, decision.executor, self.shell.execution_count + 1),
                                    code, store_history, silent)
            if self._quota_refusal is not None:  # no replica can run it, and this one's agent said why
                return self._ended_without_result(
                    rep.abort(cell, attempt, "quota", self._quota_refusal, self.shell.execution_count + 1))
            # Every replica's server is busy: one replica moves to a server that can grant
            # (docs/architecture.md, "Migration"), or the cell waits (bounded) and says so.
            waited = time.monotonic() - started
            if self._interrupted.is_set() or waited >= self.grant_timeout_s:
                if self._interrupted.is_set():
                    reason, detail = "interrupted", "interrupted while waiting for a GPU"
                elif self.gpus:
                    reason = "no-gpu"
                    detail = f"no GPU became free on any of this kernel's servers within {self.grant_timeout_s:g} s"
                else:  # every replica was fenced for a move all along (gpuhub/platform/move_fence.py)
                    reason = "no-gpu"
                    detail = f"no replica of this kernel could run it within {self.grant_timeout_s:g} s: " \
                             "they were being moved to other servers"
                return self._ended_without_result(
                    rep.abort(cell, attempt, reason, detail, self.shell.execution_count + 1))
            election = rep.state.elections.get((cell, attempt))
            announcer = min(election.proposals) if election and election.proposals else rep.id
            if announcer == rep.id and not tentative:  # a round that reclaimed nothing says nothing yet
                if not self.gpus:  # a CPU cell waits only while its replicas are fenced for a move (a drain)
                    if told is None or waited - told >= 30:
                        notice.show(f"[gpuhub] waiting: this kernel's replicas are being moved to other servers; "
                                    f"waited {waited:.0f} s…")
                        told = waited
                else:
                    # a move takes a replica out of the group for a while: only a whole group can afford it
                    target = moves.ask(waited) if rep.group_whole() else None
                    if target is not None and target != moves.told:
                        notice.show(f"[gpuhub] waiting for a GPU: moving this kernel to {target}…")
                        # the router fetches the new group now, to hand this cell to the new replica
                        self.session.send(self.iopub_socket, GROUP_CHANGE, {"target": target},
                                          parent=self.get_parent("shell"), ident=b"gpuhub_group_change")
                        moves.told, told = target, waited
                    elif told is None and set(rep.peers) != group:
                        told = waited  # the replica that asked for the move (it left or stayed) said so
                    elif told is None or waited - told >= 30:
                        nodes = ", ".join(sorted(p.node or p.raft for p in rep.peers.values()))
                        notice.show(f"[gpuhub] waiting for {self.gpus} GPU(s): all busy on this kernel's servers "
                                    f"({nodes}); waited {waited:.0f} s…")
                        told = waited
            if grant is None:  # a replica whose LEAD came after the attempt was decided tries again at once
                rep.wait_for_later_attempt(cell, attempt, backoff, self._interrupted)
                backoff = backoff if tentative else min(backoff * 2, 2.0)
            attempt = rep.next_attempt(cell, attempt)

    def _waited_text(self, waited: float, rep, executor: int) -> str:
        peer = rep.peers.get(executor)
        where = f"; running on {peer.node}" if peer is not None and peer.node else ""
        why = f"for {self.gpus} GPU(s)" if self.gpus else "while this kernel's replicas were being moved"
        return f"[gpuhub] waited {waited:.0f} s {why}{where}"

    def _publish_to_cell(self, msg_type: str, content: dict) -> None:
        """An output of the cell being executed, sent by the kernel itself (not the user's code)."""
        self.session.send(self.iopub_socket, msg_type, content, parent=self.get_parent("shell"),
                          ident=self._topic(msg_type))

    async def _run_under_lease(self, rep, cell, code, silent, store_history, user_expressions, allow_stdin,
                               cell_meta, cell_id) -> dict | None:
        """The common path (docs/architecture.md, "One commit per cell"): the replica that ran the
        last cell runs this one too, with no election, when it can get the kernel's GPUs now; the
        others wait for its result. None: an election decides this cell (there is no holder, the
        holder yielded, or the router did not hand it the cell)."""
        ended, holder, begun = rep.lease(cell)
        if ended is not None:
            return self._follow(ended, code, store_history, silent)
        if begun or holder is None:
            return None
        if holder == rep.id and self._note(cell).get("late"):
            # Handed this cell after the others (it joined, or its connection to the router broke
            # as the cell was sent): they may have been told the holder would not get it and be
            # electing another replica. Running under the lease beside that one would run the
            # cell twice; the election picks this replica anyway if it can run it.
            log.debug("cell %s: handed late to the lease holder: an election", cell)
            return None
        if holder == rep.id:
            self.reaper.wait()  # the previous GPU cell's grant must be back before this one asks
            asked = time.monotonic()
            self._warm = self._resume_lingering()
            grant = self._warm.grant if self._warm is not None else self._try_grant()
            if self.gpus and grant is None:
                log.debug("cell %s: the lease holder cannot get %d GPU(s) now: an election", cell, self.gpus)
                return None  # it yields through the election (its first proposal begins it)
            if not self._mark_cpu_cell():
                log.debug("cell %s: the lease holder is about to move: an election", cell)
                return None  # the same: another replica runs it
            self._phases = {"grant": time.monotonic() - asked}
            log.debug("cell %s: run under the lease", cell)
            return await self._execute_here(cell, 0, grant, code, silent, store_history, user_expressions,
                                            allow_stdin, cell_meta, cell_id)
        outcome = rep.wait_for_holder(cell, holder, self.shell.execution_count + 1,
                                      lambda: self._note(cell).get("to"))
        if outcome is None:
            return None
        return self._follow(outcome, code, store_history, silent)

    # --- the router's notes (gpuhub/server/router.py, "dispatch notes") -----------------------
    def _note(self, cell: str) -> dict:
        return self._notes.get(cell, {})

    def _forget_note(self, cell: str) -> None:
        self._notes.pop(cell, None)

    def _take_note(self, content: dict) -> None:
        cell = str(content.get("cell", ""))
        if not cell or self.replica is None:
            return
        with self.replica.state.changed:  # a follower waiting on the holder wakes up (wait_for_holder)
            note = self._notes.setdefault(cell, {})
            if content.get("missed"):
                note["missed"] = True
            if content.get("late"):
                note["late"] = True
            if isinstance(content.get("to"), list):
                note["to"] = [int(r) for r in content["to"]]
            while len(self._notes) > 64:  # notes of cells this replica never got
                self._notes.pop(next(iter(self._notes)))
            self.replica.state.changed.notify_all()

    def should_handle(self, stream, msg, idents):
        if msg["header"]["msg_type"] == DISPATCH_NOTE:  # before this cell, on shell: never answered
            self._take_note(msg["content"])
            return False
        return super().should_handle(stream, msg, idents)

    def _on_dispatch_note(self, stream, ident, msg) -> None:
        """On control, while the cell runs: which replicas the router handed it to."""
        self._take_note(msg["content"])

    def _no_majority(self, exc: RaftUnavailable, cell: str, *, ran: bool) -> dict:
        """The group lost its majority: an error reply now (from every replica that notices: the
        router forwards the first), instead of a cell that never ends. The cell is ended in the
        log as soon as a majority is back (:meth:`_abandon`), so that no replica runs it later."""
        rep = self.replica
        reachable = 1 + sum(rep.raft.connected(p.raft) for p in rep.peers.values() if p.id != rep.id)
        self._role = "executor"
        log.warning("replica %d: no majority: %s", rep.id, exc)
        self._abandon(cell)
        if ran:
            what = ("the cell ran, but its result could not be replicated: the variables are as before "
                    "it, unless the replicas that come back had already saved it")
        else:
            what = "the cell did not run"
        return self._error_reply("ReplicasUnavailable", (
            f"only {reachable} of this kernel's {len(rep.peers)} replicas can be reached and a cell needs "
            f"a majority ({len(rep.peers) // 2 + 1}); {what}. "
            "Run it again once the replicas are back (gpuhub restarts lost ones)"), count=False)

    def _abandon(self, cell: str) -> None:
        """Commit an abort of ``cell`` in the background until it gets through: the other replicas
        have the request queued and would otherwise run it once they are back."""
        with self._unfinished_lock:
            self._unfinished = cell

        def end_it() -> None:
            while True:
                try:
                    self._end_unfinished()
                    return
                except RaftUnavailable:
                    if self.replica.closing:
                        return
                except Exception:
                    log.exception("replica %d: could not end cell %s", self.replica.id, cell)
                    return

        threading.Thread(target=end_it, name="gpuhub-abandon", daemon=True).start()

    def _end_unfinished(self) -> None:
        """End in the log the cell given up on (raises RaftUnavailable while no majority)."""
        with self._unfinished_lock:
            cell = self._unfinished
            if cell is None:
                return
            self.replica.abort(cell, -1, "majority-lost", "the kernel's replicas lost their majority",
                               self.replica.state.execution_count or self.shell.execution_count)
            self._unfinished = None

    def _try_grant(self, reclaim: bool = True):
        """The kernel's GPUs from this replica's agent now, or None. A quota refusal is kept in
        ``_quota_refusal``: if no replica gets the GPUs, the cell ends with it (never a silent wait).
        ``reclaim``: also by ending other kernels' lingering processes (gpuhub/agent/lingering.py)."""
        self._quota_refusal = None
        if self.gpus == 0:
            return None
        if self.lease_client is None:
            return None
        from gpuhub.kernel.lease_client import LeaseError, QuotaExceeded

        try:
            return self.lease_client.try_grant(self.gpus, reclaim)
        except QuotaExceeded as exc:
            self._quota_refusal = str(exc)
            return None
        except LeaseError as exc:
            log.warning("asking the agent for GPUs failed: %s", exc)
            return None

    def _mark_cpu_cell(self) -> bool:
        """A CPU kernel's replica about to run a cell says so to its agent; False when the agent
        fenced it for a move (then another replica runs the cell). A replica alone in its group
        has no other to yield to: it runs the cell, marked."""
        mark = self.cell_mark
        if mark is None:
            return True
        return mark.begin(heed_fence=len(self.replica.peers) > 1)

    def _end_cpu_mark(self) -> None:
        if self.cell_mark is not None:
            self.cell_mark.end()

    async def _execute_here(self, cell, attempt, grant, code, silent, store_history, user_expressions,
                            allow_stdin, cell_meta, cell_id) -> dict:
        """This replica runs the cell (elected, or under the lease); a CPU kernel's replica stays
        marked as running it until its image is committed (it must not be moved before)."""
        try:
            return await self._execute_marked(cell, attempt, grant, code, silent, store_history,
                                              user_expressions, allow_stdin, cell_meta, cell_id)
        finally:
            self._end_cpu_mark()

    async def _execute_marked(self, cell, attempt, grant, code, silent, store_history, user_expressions,
                              allow_stdin, cell_meta, cell_id) -> dict:
        rep = self.replica
        waited_s = time.monotonic() - self._cell_arrived  # until this replica held the GPUs
        self._show_startup_notice()
        # Every committed image is applied here before the cell runs (this replica may have
        # missed cells: the router skipped it, or it was stopped for a while).
        if not rep.up_to_date() and not rep.sync_namespace(self.shell.user_ns, self.shell.user_ns_hidden):
            if self._warm is not None:
                self._drop_warm()
            elif grant is not None:
                self.lease_client.release(grant)
            why = f" ({rep.load_error})" if rep.load_error else ""
            return self._ended_without_result(rep.abort(
                cell, attempt, "stale", f"this replica could not load the kernel's variables{why}",
                self.shell.execution_count + 1))
        if grant is not None:  # the cell runs under it: reported to the agent when the lease goes back
            grant.waited_s = waited_s
        if rep.state.execution_count:
            self.shell.execution_count = rep.state.execution_count
        try:
            return await self._run_here(cell, attempt, grant, code, silent, store_history,
                                        user_expressions, allow_stdin, cell_meta, cell_id)
        except BaseException:
            self._drop_warm()
            if self._lingering is not None and self._lingering.state is None:  # never kept: it must not hold on
                self._end_lingering()
            raise

    async def _run_here(self, cell, attempt, grant, code, silent, store_history, user_expressions,
                        allow_stdin, cell_meta, cell_id) -> dict:
        """This replica is the executor: run the cell, publish the namespace image, then reply."""
        shell, rep = self.shell, self.replica
        began = time.monotonic()
        if self.gpus == 0:
            # the cell may read Out (a GPU cell's process builds the outputs it has itself)
            images.build_outputs(shell.user_ns, shell.user_ns_hidden)
            # Large buffers no write touched keep their digest (gpuhub/kernel/dirty.py): not hashed again.
            tracker, known_digest = self._tracker_for_cell()
            before = images.buffer_digests(rep.resident)
            rep.resident = {}  # the cell may write any buffer of the namespace (or free it)
            self._running_here = True
            try:
                reply = await super().do_execute(code, silent, store_history, user_expressions, allow_stdin,
                                                  cell_meta=cell_meta, cell_id=cell_id)
                sealed_outputs.note_cell(code)  # before its image: a cell that reached Out ends sealing
                cap = images.capture(shell.user_ns, shell.user_ns_hidden, known_digest=known_digest)
            finally:
                self._running_here = False
                # ended after the idle: its sentinel, if any, holds the pages the cell wrote twice
                # until then (a few milliseconds), and ending it costs the reply nothing
                self._spent_tracker = tracker
            self._warn_unreplicable(cap.failed)
            entry = rep.store_image(cap.stream, cap.names, cap.sized_buffers(), live=True)
            self._written = (id(rep.resident), images.written(before, rep.resident))
        else:
            self._allow_stdin = allow_stdin
            reply, sent = self._run_child(shell, code, silent, store_history, user_expressions or {}, grant, cell)
            self._phases["child"] = time.monotonic() - began  # until its image: the exit is not waited for
            entry = None
            if sent is not None:
                self._warn_unreplicable(sent.failed)
                entry = rep.store_image(sent.stream, sent.names, sent.buffers, live=False)
        send_output_now()
        if self.gpus > 0 and entry is not None:
            try:  # loaded here now, not after the commit: an image no replica can load is never committed
                rep.prepare_image(entry, shell.user_ns)
            except Exception as exc:
                entry, reply = None, self._image_not_kept(cell, exc, reply)
        ran = time.monotonic()
        self._phases["run"] = ran - began
        try:
            won = rep.commit_cell(cell, attempt, reply["status"], entry, shell.execution_count)
        except RaftUnavailable as exc:
            # Back to the committed image; and once a majority is back, load whatever it agreed
            # on (the complete may still commit: Raft keeps an entry its leader had appended).
            if self.gpus == 0:
                rep.sync_namespace(shell.user_ns, shell.user_ns_hidden, force=True)
            rep.drop_prepared()
            self._end_lingering()
            rep.loaded_version = -1
            shell.execution_count = rep.state.execution_count or shell.execution_count - 1
            return self._no_majority(exc, cell, ran=True)
        self._phases["commit"] = time.monotonic() - ran
        log.debug("cell %s: image %s; %s", cell, "unchanged" if entry is None else f"{entry.nbytes()} bytes",
                  ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self._phases.items()))
        if not won:
            # An abort committed first (this replica was cut off): take the group's state instead.
            rep.drop_prepared()
            rep.sync_namespace(shell.user_ns, shell.user_ns_hidden, force=True)
            self._end_lingering()
            self._role = "follower"
            self._spare_wanted = False  # another replica runs the next cell: no spare held here
            return reply
        if self.gpus > 0 and not rep.sync_namespace(shell.user_ns, shell.user_ns_hidden):
            log.error("replica %d could not load the image of its own cell", rep.id)  # next cell retries
        self._keep_lingering()
        self._arm_after_idle = self.gpus == 0  # this replica likely runs the next cell too
        # ... and its process can be forked after the idle, unless the last one stays for it
        self._spare_wanted = self.gpus > 0 and self._lingering is None
        return reply

    def _tracker_for_cell(self):
        """The write tracker for a CPU cell about to run here: the one armed after the last cell
        when it was armed over the buffers this replica still holds, else one armed now."""
        rep = self.replica
        ready, self._next_tracker = self._next_tracker, None
        if ready is not None:
            resident, tracker, known_digest = ready
            if resident is rep.resident:
                return tracker, known_digest
            if tracker is not None:
                tracker.close()  # armed over buffers this replica no longer holds (it followed a cell)
        return self._arm_tracker()

    def _arm_tracker(self):
        """A write tracker over the buffers of the last image this replica holds, and its known_digest."""
        rep = self.replica
        resident_id, written = self._written
        return images.track(rep.resident, mode="in-process", sentinel=rep.settings.write_tracking == "pages",
                            hash_instead=written if resident_id == id(rep.resident) else ())

    # Requests that read the namespace: the outputs a load left pending are built first
    # (gpuhub/kernel/sealed_outputs.py). Cells build them where they run (_run_here, a GPU cell's process).
    def do_complete(self, code, cursor_pos):
        images.build_outputs(self.shell.user_ns, self.shell.user_ns_hidden)
        return super().do_complete(code, cursor_pos)

    def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        images.build_outputs(self.shell.user_ns, self.shell.user_ns_hidden)
        return super().do_inspect(code, cursor_pos, detail_level, omit_sections)

    async def dispatch_shell(self, *args, **kwargs):
        await super().dispatch_shell(*args, **kwargs)
        self._between_cells()

    def _between_cells(self) -> None:
        """After a request's idle went out: end the last CPU cell's tracker and arm the next one.

        Arming (for 1 GiB of arrays: a sentinel fork, the page map and a word of every page, about
        20 ms on the dev VM) then costs a notebook's user nothing, who reads the output meanwhile.
        A write between cells (a background thread's) is seen by the next cell's capture when it
        comes after this arming began (the sentinel's fork); one in the milliseconds between the
        capture and here is not."""
        spent, self._spent_tracker = self._spent_tracker, None
        if spent is not None:
            spent.close()  # its sentinel ends: pages the cell wrote are no longer held twice
        self._probe_imports()
        self._keep_spare()
        if not self._arm_after_idle or self.replica is None or self.replica.closing:
            return
        self._arm_after_idle = False
        rep = self.replica
        try:
            tracker, known_digest = self._arm_tracker()
        except Exception:  # the next cell arms its own (and hashes what it cannot vouch for)
            log.exception("replica %d: arming the write tracker for the next cell failed", rep.id)
            return
        self._next_tracker = (rep.resident, tracker, known_digest)

    def _probe_imports(self) -> None:
        """GPU kernels: probe what the last cell's child imported; import it here once the probe
        reports it safe (gpuhub/kernel/warm_imports.py), on this loop, so never during a fork."""
        if self.import_warmer is None or (self.replica is not None and self.replica.closing):
            return
        try:
            fd = self.import_warmer.start_probe()
        except OSError:
            log.exception("could not start an import probe")
            return
        if fd is None:
            return
        loop = asyncio.get_running_loop()

        def reported() -> None:
            loop.remove_reader(fd)
            try:
                self.import_warmer.probe_done()
            except Exception:
                log.exception("importing a cell's modules in the replica failed")
            self._probe_imports()  # names offered meanwhile
            self._keep_spare()  # one forked before these imports would lack them

        loop.add_reader(fd, reported)

    def _image_not_kept(self, cell: str, exc: Exception, reply: dict) -> dict:
        """The reply for a GPU cell whose image this replica cannot load (an object whose
        unpickling fails outside the process that made it). Committed, that image would have
        stopped every later cell of the kernel; the cell commits none instead, so the variables
        stay as they were before it, here and on every replica (said, as when a cell's process
        ends before it hands them back), and its process, which holds its values, is not kept."""
        log.error("cell %s: its namespace image cannot be loaded (%s: %s); the cell commits none",
                  cell, type(exc).__name__, exc)
        self.replica.drop_prepared()
        self._end_lingering()
        lost = self._error_reply("CellVariablesLost", f"the cell ran, but its variables cannot be loaded back "
                                 f"({type(exc).__name__}: {exc}); variables are as they were before this cell",
                                 count=False)
        lost["execution_count"] = reply.get("execution_count", lost["execution_count"])
        return lost

    def _warn_unreplicable(self, failed: dict[str, str]) -> None:
        """Warn once per value that cannot travel (not again every cell while it stays)."""
        ns = self.shell.user_ns
        for name, why in failed.items():
            if images.OUTPUT_NAME.fullmatch(name) or self._unreplicable.get(name) == id(ns.get(name)):
                continue
            self._unreplicable[name] = id(ns.get(name))
            sys.stderr.write(f"[gpuhub] warning: variable {name!r} cannot be replicated ({why}); "
                             "it lives only on this replica and is lost if its server fails\n")
        for name in [n for n in self._unreplicable if n not in failed]:
            del self._unreplicable[name]

    def _follow(self, outcome: CellOutcome, code: str, store_history: bool, silent: bool) -> dict:
        self._end_lingering()  # the namespace moves on without it
        if outcome.kind == "abort":
            return self._ended_without_result(outcome)
        rep = self.replica
        self._spare_wanted = False  # another replica ran this cell: it runs the next one too
        self._drop_spare()
        if not rep.sync_namespace(self.shell.user_ns, self.shell.user_ns_hidden):
            log.error("replica %d could not load the namespace after cell", rep.id)
        number = outcome.execution_count - (1 if store_history and not silent else 0)
        self._remember_cell(code, number)
        if store_history and not silent:  # every replica keeps the session's history
            self.shell.history_manager.store_inputs(number, code)
        self.shell.execution_count = outcome.execution_count
        self._role, self._cell_executor = "follower", outcome.by
        reply = {"status": outcome.status, "execution_count": outcome.execution_count - 1,
                 "user_expressions": {}, "payload": []}
        if outcome.status == "error":  # ipykernel's metadata and stop-on-error read these
            reply.update(ename="", evalue="", traceback=[])
        return reply

    def _remember_cell(self, code: str, number: int) -> None:
        """Cache cell ``number``'s source as IPython does when it compiles a cell (linecache, and
        the name → number map that tracebacks use): this replica did not compile it itself.

        The lines cached are IPython's transform of the cell, as on the replica that ran it. With
        ipykernel's compiler, which names a cell after its source (not its transform) and by a
        path, they are made only when something reads them (a traceback, ``inspect.getsource``):
        a lazy linecache entry, which saves every follower a transform per cell (tens of
        microseconds; the shown text may then follow a later change of IPython's automagic or
        autocall, never the line count). Otherwise (another compiler; a ``<...>`` name, which
        linecache never reads lazily) the transform is made now, as before."""
        compiler = self.shell.compile
        try:
            if type(compiler).get_code_name is not XCachingCompiler.get_code_name:
                compiler.cache(self._transformed(code), number, raw_code=code)
                return
            name = compiler.cache(code, number, raw_code=code)
        except Exception as exc:
            log.debug("could not cache cell %d: %s", number, exc)
            return
        if name.startswith("<") and name.endswith(">"):
            compiler.cache(self._transformed(code), number, raw_code=code)
        else:
            linecache.cache[name] = (functools.partial(self._transformed, code),)

    def _transformed(self, code: str) -> str:
        try:
            return self.shell.transform_cell(code)
        except Exception:  # a cell IPython cannot transform failed on the executor too
            return code

    def _ended_without_result(self, outcome: CellOutcome) -> dict:
        """A cell ended by an abort: the replica whose abort won reports it, the others stay silent."""
        if outcome.by == self.replica.id:
            self.shell.execution_count = outcome.execution_count - 1
            return self._error_reply(ABORT_NAMES.get(outcome.status, "GpuhubError"),
                                     f"{outcome.detail}; variables are as they were before this cell")
        self.shell.execution_count = outcome.execution_count
        self._role, self._cell_executor = "follower", outcome.by
        return {"status": "error", "ename": ABORT_NAMES.get(outcome.status, "GpuhubError"),
                "evalue": outcome.detail, "traceback": [], "execution_count": outcome.execution_count - 1,
                "user_expressions": {}, "payload": []}

    def _error_reply(self, ename: str, evalue: str, *, count: bool = True) -> dict:
        tb = [f"{ename}: {evalue}"]
        self.shell._showtraceback(type(ename, (Exception,), {}), evalue, tb)
        if count:
            self.shell.execution_count += 1
        return {"status": "error", "ename": ename, "evalue": evalue, "traceback": tb,
                "execution_count": self.shell.execution_count - 1 if count else self.shell.execution_count,
                "user_expressions": {}, "payload": []}

    def _run_child(self, shell, code, silent, store_history, user_expressions, grant,
                   cell: str) -> tuple[dict, dict | None]:
        """Run one cell in a forked child holding ``grant``; returns its reply and what it sent of
        the namespace image (not stored yet; None when it died). The child is the spare forked
        after the last cell when nothing changed since, else forked now. The grant ends once the
        child has exited: at once if it died, otherwise on the reaper's thread, so that neither its
        exit nor the release delays the reply."""
        rep = self.replica
        # As IPython 9's run_cell: the prompt number moves on when the cell starts, so the child's
        # outputs (Out[n], _n) and the ones relayed here carry this cell's number.
        number = shell.execution_count
        counting = store_history and not silent
        preparing = time.monotonic()
        warm, self._warm = self._warm, None
        proc, forking = (warm.proc if warm is not None else self._take_spare()), None
        # The request the cell answers: user code asking get_ipython().parent_header or the
        # kernel's get_parent() must see this cell's (the process may have been forked before it).
        request = {k: v for k, v in self.get_parent("shell").items() if k != "buffers"}
        go = {"code": code, "silent": silent, "store_history": store_history,
              "user_expressions": user_expressions, "gpu_uuids": list(grant.uuids),
              "execution_count": number, "stored": rep.store.digests(),
              "request": request, "request_ident": self._parent_ident["shell"],
              "linger": rep.settings.gpu_linger_s > 0}
        oom_before = memory_limit.oom_counts()  # never raises
        try:
            started = proc is not None and proc.start(go)
            if not started:
                if proc is not None:
                    log.warning("the %s process for GPU cells had died (%s); forking one for cell %s",
                                "lingering" if warm is not None else "spare",
                                _describe_status(proc.status) if proc.status is not None else "gone", cell)
                forking = time.monotonic()
                proc = CellProcess.fork(shell, rep.resident, None, rep.store.alloc)
                started = proc.start(go)
            handed = proc.started or time.monotonic()
        except OSError as exc:  # no process for the cell (fork: out of memory, process limit)
            self.reaper.end_later(cell, None, grant)
            log.error("cell %s: could not start its process: %s", cell, exc)
            reply = self._error_reply("CellProcessNotStarted", f"the cell's process could not be started ({exc}); "
                                      "nothing ran and variables are as they were", count=counting)
            self._remember_cell(code, number)
            if counting:  # In[n] as the followers record it
                shell.history_manager.store_inputs(number, code)
            return reply, None
        except BaseException:
            if proc is not None and proc.started is None:
                proc.discard()  # forked, never handed its cell
            self.reaper.end_later(cell, None, grant)
            raise
        if counting:
            shell.execution_count += 1
        self._phases["prepare"] = (forking or handed) - preparing
        self._child_pid = proc.pid if started else None
        done = sent = None
        status = proc.status
        try:
            while started and sent is None:  # the image is the child's last frame; nothing after it is awaited
                for msg in proc.reader.poll(0.5):
                    kind = msg[0]
                    if kind == "done":
                        done = msg[1]
                    elif kind == "image":
                        sent = msg[1]
                        self.import_warmer.offer(sent.imported)
                        self._phases.update(_child_phases(forking, handed, msg[2], time.monotonic()))
                    else:
                        self._relay(msg, proc.writer)
                if proc.reader.eof:  # it ended; a frame it had begun (killed while sending) is lost
                    break
        finally:
            self._child_pid = None
            if started and sent is not None and go["linger"]:
                # it waits for the next cell; kept once this cell is committed (_keep_lingering)
                self._lingering = LingeringProcess(proc, grant, cell)
            else:
                proc.close_pipes()  # a child still writing gets EPIPE and leaves
                pid = proc.pid if started else None
                if started and sent is None:  # it died (or this process is leaving): its status says why
                    _, status = os.waitpid(pid, 0)
                    pid = None
                self.reaper.end_later(cell, pid, grant)
        storing = time.monotonic()
        self._remember_cell(code, number)  # the child compiled it, and its caches died with it
        if counting:
            shell.history_manager.store_inputs(number, code)
        self._phases["history"] = time.monotonic() - storing
        if done is None or sent is None:
            # The child died mid-cell, or it ran but its variables never came back (say so, rather
            # than an "ok" whose changes are gone): the namespace stays as it was before this cell.
            ended = _describe_status(status, oom_before)
            if done is None:
                ename, what = "CellProcessDied", f"the cell's process {ended}"
            else:
                ename, what = "CellVariablesLost", ("the cell ran, but its process ended before it handed back "
                                                    f"its variables: it {ended} (more in the kernel's log)")
            reply = self._error_reply(ename, f"{what}; variables are as they were before this cell", count=False)
            reply["execution_count"] = number  # counted above, as IPython counts a failed cell
            return reply, None
        done["execution_count"] = shell.execution_count - 1
        return done, sent

    # --- the last GPU cell's process, kept for the next cell (a lingering lease) ----
    def _linger_state(self) -> tuple:
        """What the lingering process's namespace matches: the image loaded after its cell, the
        prompt number, the names shown (unlike a spare's, the modules imported here do not matter)."""
        rep = self.replica
        return (rep.loaded_version, id(rep.resident), self.shell.execution_count, self._unhidden)

    def _keep_lingering(self) -> None:
        """The cell that ran in ``_lingering`` is committed and loaded: keep its process for the next
        cell, tell the agent (on the reaper's thread), and end it after the kernel's linger time."""
        lingering = self._lingering
        if lingering is None or lingering.state is not None:
            return
        lingering.state = self._linger_state()
        loop = asyncio.get_running_loop()
        lingering.timer = loop.call_later(self.replica.settings.gpu_linger_s, self._linger_over, lingering)

        def refused(why: str) -> None:  # on the reaper's thread
            lingering.refused = why
            loop.call_soon_threadsafe(self._linger_over, lingering)

        self.reaper.linger_later(lingering.cell, lingering.proc.pid, lingering.grant, refused)

    def _linger_over(self, lingering: LingeringProcess) -> None:
        """No next cell in time (or the agent would not hold it): the process and lease end, and a
        spare is forked for the next cell instead."""
        if self._lingering is not lingering:
            return
        log.debug("the lingering process of cell %s ends (%s)", lingering.cell,
                  lingering.refused or f"no cell for {self.replica.settings.gpu_linger_s:g} s")
        self._end_lingering()
        self._spare_wanted = True
        self._keep_spare()

    def _resume_lingering(self) -> LingeringProcess | None:
        """The lingering process, when this cell may run in it: nothing changed the namespace since
        and the agent still holds its GPUs (it may have ended it for another kernel). Otherwise it
        is ended (and its exit waited for: its GPU memory is free) and None returned."""
        lingering, self._lingering = self._lingering, None
        if lingering is None:
            return None
        if lingering.timer is not None:
            lingering.timer.cancel()
        release = True
        if lingering.refused is None and lingering.state == self._linger_state():
            from gpuhub.kernel.lease_client import LeaseError, QuotaExceeded

            try:
                if self.lease_client.resume(lingering.grant):
                    return lingering
                release = False  # the agent took it back (and ended the process)
                log.debug("the lingering lease of cell %s was taken back", lingering.cell)
            except QuotaExceeded:
                release = False  # the agent released it; the grant asked for next says why
            except LeaseError as exc:
                log.warning("could not resume the lingering lease of cell %s: %s", lingering.cell, exc)
        lingering.end(self.reaper, release=release)
        self.reaper.wait()
        return None

    def _end_lingering(self) -> None:
        lingering, self._lingering = self._lingering, None
        if lingering is not None:
            lingering.end(self.reaper)

    def _drop_warm(self) -> None:
        """End a resumed lingering process that no cell took (an error before the cell ran)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.end(self.reaper)

    # --- the next GPU cell's process, forked ahead of need (gpuhub/kernel/cell_process.py) ----
    def _spare_state(self) -> tuple:
        """What a cell's process copies from this replica and must still be so when it runs the
        cell: the image loaded (and the memory holding its buffers), the prompt number (and so the
        history), the modules imported, the names shown."""
        rep = self.replica
        return (rep.loaded_version, id(rep.resident), self.shell.execution_count, len(sys.modules), self._unhidden)

    def _take_spare(self) -> CellProcess | None:
        """The spare process if it was forked from the state this replica is in now."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.state != self._spare_state():
            log.debug("the spare process for GPU cells is stale: forking one for this cell")
            spare.discard()
            return None
        return spare

    def _drop_spare(self) -> None:
        # Shutdown calls this on the control thread: the lock keeps one spare from being taken twice.
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.discard()

    def _keep_spare(self) -> None:
        """Fork the next GPU cell's process now, between cells, when this replica ran the last
        cell (with the executor lease it runs the next one too) and has no spare of its state."""
        rep = self.replica
        if not self._spare_wanted or rep is None or rep.closing:
            return
        state = self._spare_state()
        spare = self._spare  # once: shutdown may drop it from the control thread meanwhile
        if spare is not None:
            if spare.state == state:
                return
            self._drop_spare()
        if self.import_warmer.probing:
            return  # the modules about to be imported here would be missing in it: the probe's end calls again
        if hugepages.busy():
            # Collapsing pages a child shares would make its tracker see them written: soon over.
            asyncio.get_running_loop().call_later(0.05, self._keep_spare)
            return
        try:
            spare = CellProcess.fork(self.shell, rep.resident, state, rep.store.alloc)
        except OSError as exc:  # e.g. out of memory for the page tables: the cell forks its own
            log.warning("could not fork a spare process for GPU cells: %s", exc)
            return
        with self._spare_lock:
            leaving = not self._spare_wanted  # shutdown began while it forked
            if not leaving:
                self._spare = spare
        if leaving:
            spare.discard()
            return
        asyncio.get_running_loop().call_later(SPARE_MAX_IDLE_S, self._expire_spare, spare)

    def _expire_spare(self, spare: CellProcess) -> None:
        if self._spare is spare:
            log.debug("no GPU cell for %.0f s: the spare process ends until the next one", SPARE_MAX_IDLE_S)
            self._spare_wanted = False
            self._drop_spare()

    def _relay(self, msg: tuple, replies: FrameWriter) -> None:
        kind = msg[0]
        if kind == "stream":
            (sys.stdout if msg[1] == "stdout" else sys.stderr).write(msg[2])
        elif kind == "display":
            _, data, metadata, transient, update = msg
            self.shell.display_pub.publish(data, metadata, transient=transient, update=update)
        elif kind == "clear":
            self.shell.display_pub.clear_output(msg[1])
        elif kind == "iopub":  # signed in the cell's process with the kernel's key (child.PipeIopub)
            self.iopub_socket.send_multipart(msg[1])
        elif kind == "result":
            hook = self.shell.displayhook
            hook.start_displayhook()
            hook.write_output_prompt()
            hook.write_format_data(msg[1], msg[2])
            hook.finish_displayhook()
        elif kind == "error":
            content = msg[1]
            sys.stdout.flush()
            sys.stderr.flush()
            self.shell._showtraceback(type(content["ename"], (Exception,), {}), content["evalue"],
                                      content["traceback"])
        elif kind == "input":
            _, prompt, password = msg
            try:
                value = self.getpass(prompt) if password else self.raw_input(prompt)
                replies.send("input_reply", value, "", "")
            except Exception as exc:  # e.g. StdinNotImplementedError: raised again in the child
                replies.send("input_reply", None, type(exc).__name__, str(exc))

    # --- interrupts: go to the cell's process, or stop a wait for a GPU ----
    def _signal_cell(self, sig: int) -> bool:
        """Signal the running cell's process; False when no GPU cell is running."""
        pid = self._child_pid
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        return True

    def _send_interrupt_children(self) -> None:
        self._interrupted.set()
        if self.replica is not None:
            self.replica.interrupted.set()
            # Only the executor's user code may see KeyboardInterrupt; a follower mid-protocol must not.
            if not self._signal_cell(signal.SIGINT) and self._running_here:
                super()._send_interrupt_children()
            return
        super()._send_interrupt_children()  # no group: a CPU kernel, its cells run in this process

    def do_shutdown(self, restart):
        self._signal_cell(signal.SIGKILL)
        self._spare_wanted = False
        self._drop_spare()
        self._end_lingering()
        self._drop_warm()
        if self.import_warmer is not None:
            self.import_warmer.close()
        if not self.reaper.wait(timeout=10):  # give the last cell's grant back before leaving
            log.warning("the last GPU cell's process had not exited at shutdown; the agent expires its lease")
        if self.replica is not None:
            self.replica.close()
        return super().do_shutdown(restart)
