"""The gpuhub kernel: an IPython kernel that executes each cell of a GPU kernel in a forked child
holding a per-cell GPU lease (docs/architecture.md D2). CPU-only kernels execute in-process, as ipykernel does.

A kernel started with a peers file is one replica of a Raft group (gpuhub/kernel/replica.py):
every cell first elects its executor, only the executor runs it, the others load what it changed.
The agent always gives a kernel its peers file (a group of one at least); only a CPU kernel may
run without one, started by hand, as a plain IPython kernel.

Where a cell is executed: :meth:`GpuhubKernel.do_execute` → :meth:`_execute_replicated` (election)
→ :meth:`_run_here` → in-process, or :meth:`_run_child` → :func:`gpuhub.kernel.child.run`.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

from ipykernel.ipkernel import IPythonKernel

from gpuhub.kernel import child, hugepages
from gpuhub.kernel.delta import namespace_delta
from gpuhub.kernel.lease_client import LeaseClient, LeaseError
from gpuhub.kernel.pipe import FrameReader, FrameWriter
from gpuhub.kernel.reaper import CellReaper
from gpuhub.kernel.replica import Replica
from gpuhub.replication.digest import digest
from gpuhub.replication.log import CellOutcome

log = logging.getLogger("gpuhub.kernel")
ABORT_NAMES = {"executor-lost": "ExecutorLost", "no-gpu": "GpuWaitTimeout", "interrupted": "KeyboardInterrupt"}


def _child_phases(forking: float, marks: dict[str, float], received: float) -> dict[str, float]:
    """Where a GPU cell's child spent its time (CLOCK_MONOTONIC is one clock for both processes)."""
    return {"fork": marks["started"] - forking, "setup": marks["ready"] - marks["started"],
            "cell": marks["ran"] - marks["ready"], "delta": marks["sent"] - marks["ran"],
            "pipe": received - marks["sent"]}


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with status {os.WEXITSTATUS(status)}"


class GpuhubKernel(IPythonKernel):
    implementation = "gpuhub"
    implementation_version = "0.1.0"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gpus = int(os.environ.get("GPUHUB_KERNEL_GPUS", "0") or 0)
        self.grant_timeout_s = float(os.environ.get("GPUHUB_GRANT_TIMEOUT_S", "300"))
        self.lease_client = LeaseClient.from_env()
        # A GPU cell's process exits and its grant ends after the reply (gpuhub/kernel/reaper.py).
        self.reaper = CellReaper(self.lease_client.release if self.lease_client else lambda grant: None)
        self._child_pid: int | None = None
        self._interrupted = threading.Event()
        self._digests: dict[str, str] = {}
        self._device_tags: dict[str, int] = {}
        self._startup_notice = self._notebook_dir_notice()
        self._running_here = False  # a CPU cell of this replica is running in-process
        self._role = "executor"  # this replica's part in the current request (reply metadata)
        self._phases: dict[str, float] = {}  # seconds per phase of the last cell (debug log)
        if self.gpus > 0:
            child.warm_up(self.shell)  # every GPU cell's child starts from these caches
        self.replica = Replica.from_env(self.session.key, cells_in_process=self.gpus == 0)
        if self.replica is None and self.gpus > 0:
            # a GPU cell gets its lease through the group's election (a group of one at least)
            raise RuntimeError("gpuhub: a GPU kernel runs in a group of replicas and GPUHUB_PEERS_FILE "
                               "is unset; start it through the agent or `gpuhub local-kernel`")
        if self.replica is not None:
            self.replica.huge_pages = self.gpus > 0  # every GPU cell forks this process
            self._join_group()

    def _join_group(self) -> None:
        """Catch up (journal + peers) before the first request: a restarted replica's namespace
        is the group's, not empty."""
        self.replica.wait_ready()
        failed = self.replica.sync_namespace(self.shell.user_ns, self._digests, self._device_tags)
        if failed:
            log.error("replica %d started without %s", self.replica.id, ", ".join(failed))
        if self.replica.state.execution_count:
            self.shell.execution_count = self.replica.state.execution_count
        log.info("replica %d ready: %d name(s), next prompt %d", self.replica.id,
                 len(self.replica.state.names), self.shell.execution_count)

    def start(self):
        # IPython hides everything in the namespace at start-up from %who (hide_initial_ns), which
        # would also hide the names this replica caught up with from change detection.
        for name in self._digests:
            self.shell.user_ns_hidden.pop(name, None)
        super().start()

    def finish_metadata(self, parent, metadata, reply_content):
        metadata = super().finish_metadata(parent, metadata, reply_content)
        if self.replica is not None:
            # The router forwards only the executor's execute_reply (docs/architecture.md D3).
            metadata["gpuhub"] = {"replica": self.replica.id, "role": self._role}
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
        self._role = "executor"
        if self.replica is not None:
            return await self._execute_replicated(code, silent, store_history, user_expressions, allow_stdin,
                                                  cell_meta=cell_meta, cell_id=cell_id)
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
        self._interrupted.clear()
        rep.interrupted.clear()
        started, attempt, told, backoff = time.monotonic(), 0, None, 0.1
        while True:
            asked = time.monotonic()
            self.reaper.wait()  # the previous GPU cell's grant must be back before this one asks
            reaped = time.monotonic()
            grant = self._try_grant()
            granted = time.monotonic()
            decision = rep.elect(cell, attempt, lead=self.gpus == 0 or grant is not None)
            self._phases = {"reap": reaped - asked, "grant": granted - reaped, "elect": time.monotonic() - granted}
            if grant is not None and decision.executor != rep.id:
                self.lease_client.release(grant)  # losers give their tentative grant back at once
            if decision.outcome is not None:  # this replica is late: the cell already ended
                return self._follow(decision.outcome)
            log.debug("cell %s attempt %d: executor %s after %.1f ms (raft leader here: %s)", cell, attempt,
                      decision.executor, (time.monotonic() - started) * 1000, rep.raft.is_leader)
            if decision.executor == rep.id:
                self._show_startup_notice()
                return await self._run_here(cell, attempt, grant, code, silent, store_history,
                                            user_expressions, allow_stdin, cell_meta, cell_id)
            if decision.executor is not None:
                return self._follow(rep.wait_for_end(cell, decision.executor, self.shell.execution_count + 1))
            # Every replica's server is busy. Until migration exists, wait (bounded) and say so.
            waited = time.monotonic() - started
            if self._interrupted.is_set() or waited >= self.grant_timeout_s:
                if self._interrupted.is_set():
                    reason, detail = "interrupted", "interrupted while waiting for a GPU"
                else:
                    reason = "no-gpu"
                    detail = f"no GPU became free on any of this kernel's servers within {self.grant_timeout_s:g} s"
                return self._ended_without_result(
                    rep.abort(cell, attempt, reason, detail, self.shell.execution_count + 1))
            election = rep.state.elections.get((cell, attempt))
            announcer = min(election.proposals) if election and election.proposals else rep.id
            if announcer == rep.id and (told is None or waited - told >= 30):
                nodes = ", ".join(sorted(p.node or p.raft for p in rep.peers.values()))
                sys.stderr.write(f"[gpuhub] waiting for {self.gpus} GPU(s): all busy on this kernel's servers "
                                 f"({nodes}); waited {waited:.0f} s…\n")
                sys.stderr.flush()
                told = waited
            self._interrupted.wait(backoff)
            backoff = min(backoff * 2, 2.0)
            attempt += 1

    def _try_grant(self):
        if self.gpus == 0:
            return None
        if self.lease_client is None:
            return None
        try:
            return self.lease_client.try_grant(self.gpus)
        except LeaseError as exc:
            log.warning("asking the agent for GPUs failed: %s", exc)
            return None

    async def _run_here(self, cell, attempt, grant, code, silent, store_history, user_expressions,
                        allow_stdin, cell_meta, cell_id) -> dict:
        """This replica is the executor: run the cell, publish its delta, then reply."""
        shell, rep = self.shell, self.replica
        began = time.monotonic()
        hidden = set(shell.user_ns_hidden)
        if self.gpus == 0:
            before = {k: id(v) for k, v in shell.user_ns.items() if k not in hidden}
            self._running_here = True
            try:
                reply = await super().do_execute(code, silent, store_history, user_expressions, allow_stdin,
                                                  cell_meta=cell_meta, cell_id=cell_id)
            finally:
                self._running_here = False
            delta = namespace_delta(shell.user_ns, before, self._digests, hidden, out_of_band=True,
                                              alloc=rep.alloc_copy)
            self._warn_unreplicable(delta["failed"])
        else:
            self._allow_stdin = allow_stdin
            reply, delta = self._run_child(shell, code, silent, store_history, user_expressions or {},
                                           grant, cell)
            self._phases["child"] = time.monotonic() - began  # until its delta: the exit is not waited for
            delta = delta or {"set": {}, "deleted": [], "device_tags": {}, "failed": {}, "digests": {}}
        ran = time.monotonic()
        self._phases["run"] = ran - began
        won, entries = rep.commit_cell(cell, attempt, reply["status"], delta["set"], delta["deleted"],
                                       delta["device_tags"], shell.execution_count, delta.get("digests"))
        self._phases["commit"] = time.monotonic() - ran
        log.debug("cell %s: %d value(s) committed; %s", cell, len(entries),
                  ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self._phases.items()))
        if not won:
            # An abort committed first (this replica was cut off): take the group's state instead.
            touched = set(delta["set"]) | set(delta["deleted"]) | set(delta["failed"])
            rep.sync_namespace(shell.user_ns, self._digests, self._device_tags, force=touched)
            self._role = "follower"
            return reply
        if self.gpus == 0:
            for name, entry in entries.items():
                self._digests[name] = entry.digest
            for name in delta["deleted"]:
                self._digests.pop(name, None)
        else:
            delta["digests"] = {name: entry.digest for name, entry in entries.items()}
            self._apply_delta(delta)
        return reply

    def _warn_unreplicable(self, failed: dict[str, str]) -> None:
        for name, why in failed.items():
            sys.stderr.write(f"[gpuhub] warning: variable {name!r} cannot be replicated ({why}); "
                             "it lives only on this replica and is lost if its server fails\n")

    def _follow(self, outcome: CellOutcome) -> dict:
        if outcome.kind == "abort":
            return self._ended_without_result(outcome)
        failed = self.replica.sync_namespace(self.shell.user_ns, self._digests, self._device_tags)
        if failed:
            log.error("replica %d could not load %s after cell", self.replica.id, ", ".join(failed))
        self.shell.execution_count = outcome.execution_count
        self._role = "follower"
        return {"status": outcome.status, "execution_count": outcome.execution_count - 1,
                "user_expressions": {}, "payload": []}

    def _ended_without_result(self, outcome: CellOutcome) -> dict:
        """A cell ended by an abort: the replica whose abort won reports it, the others stay silent."""
        if outcome.by == self.replica.id:
            self.shell.execution_count = outcome.execution_count - 1
            return self._error_reply(ABORT_NAMES.get(outcome.status, "GpuhubError"),
                                     f"{outcome.detail}; variables are as they were before this cell")
        self.shell.execution_count = outcome.execution_count
        self._role = "follower"
        return {"status": "error", "ename": ABORT_NAMES.get(outcome.status, "GpuhubError"),
                "evalue": outcome.detail, "traceback": [], "execution_count": outcome.execution_count - 1,
                "user_expressions": {}, "payload": []}

    def _error_reply(self, ename: str, evalue: str) -> dict:
        tb = [f"{ename}: {evalue}"]
        self.shell._showtraceback(type(ename, (Exception,), {}), evalue, tb)
        self.shell.execution_count += 1
        return {"status": "error", "ename": ename, "evalue": evalue, "traceback": tb,
                "execution_count": self.shell.execution_count - 1, "user_expressions": {}, "payload": []}

    def _run_child(self, shell, code, silent, store_history, user_expressions, grant,
                   cell: str) -> tuple[dict, dict | None]:
        """Run one cell in a forked child holding ``grant``; returns its reply and the namespace delta
        (not applied). The grant ends once the child has exited: at once if it died, otherwise on the
        reaper's thread, so that neither its exit nor the release delays the reply."""
        try:
            preparing = time.monotonic()
            out_r, out_w = os.pipe()
            in_r, in_w = os.pipe()
            hidden = set(shell.user_ns_hidden)
            sys.stdout.flush()
            sys.stderr.flush()
            forking = time.monotonic()
            self._phases["prepare"] = forking - preparing
            pid = os.fork()
        except BaseException:
            self.reaper.end_later(cell, None, grant)
            raise
        if pid == 0:  # the child: never returns
            try:
                os.close(out_r)
                os.close(in_w)
                child.run(shell, code, silent=silent, store_history=store_history,
                              user_expressions=user_expressions, gpu_uuids=grant.uuids, out_fd=out_w, in_fd=in_r,
                              digests=self._digests, device_tags=self._device_tags, hidden=hidden)
            except BaseException:
                import traceback

                traceback.print_exc(file=sys.__stderr__)
            finally:
                os._exit(0)
        os.close(out_w)
        os.close(in_r)
        self._child_pid = pid
        reader, replies = FrameReader(out_r), FrameWriter(in_w)
        done = delta = status = None
        try:
            while delta is None:  # the delta is the child's last frame; nothing after it is awaited
                for msg in reader.poll(0.5):
                    kind = msg[0]
                    if kind == "done":
                        done = msg[1]
                    elif kind == "delta":
                        delta = msg[1]
                        self._phases.update(_child_phases(forking, msg[2], time.monotonic()))
                    else:
                        self._relay(msg, replies)
                if reader.eof and len(reader.buf) == 0:
                    break
        finally:
            self._child_pid = None
            os.close(out_r)  # a child still writing gets EPIPE and leaves
            os.close(in_w)
            if delta is None:  # it died (or this process is leaving): its status says why
                _, status = os.waitpid(pid, 0)
                pid = None
            self.reaper.end_later(cell, pid, grant)
        storing = time.monotonic()
        if store_history:
            shell.history_manager.store_inputs(shell.execution_count, code)
        self._phases["history"] = time.monotonic() - storing
        shell.execution_count += 1
        if done is None:
            # The child died mid-cell: the namespace stays as it was before this cell.
            shell.execution_count -= 1
            return self._error_reply("CellProcessDied", f"the cell's process {_describe_status(status)}; "
                                     "variables are as they were before this cell"), None
        done["execution_count"] = shell.execution_count - 1
        return done, delta

    def _relay(self, msg: tuple, replies: FrameWriter) -> None:
        kind = msg[0]
        if kind == "stream":
            (sys.stdout if msg[1] == "stdout" else sys.stderr).write(msg[2])
        elif kind == "display":
            _, data, metadata, transient, update = msg
            self.shell.display_pub.publish(data, metadata, transient=transient, update=update)
        elif kind == "clear":
            self.shell.display_pub.clear_output(msg[1])
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
                replies.send("input_reply", value, "")
            except Exception as exc:
                replies.send("input_reply", None, f"{type(exc).__name__}: {exc}")

    def _apply_delta(self, delta: dict) -> None:
        ns = self.shell.user_ns
        for name, data in delta["set"].items():
            try:
                ns[name] = pickle.loads(data)
            except Exception as exc:
                sys.stderr.write(f"[gpuhub] warning: variable {name!r} could not be restored "
                                 f"after the GPU cell ({type(exc).__name__}: {exc}); it keeps its old value\n")
                continue
            hugepages.collapse_later(ns[name])  # the next GPU cell's fork copies fewer page-table entries
            self._digests[name] = delta.get("digests", {}).get(name) or digest(data)
            if name in delta["device_tags"]:
                self._device_tags[name] = delta["device_tags"][name]
            else:
                self._device_tags.pop(name, None)
        for name in delta["deleted"]:
            ns.pop(name, None)
            self._digests.pop(name, None)
            self._device_tags.pop(name, None)
        for name, why in delta["failed"].items():
            previous = "keeps its value from before this cell" if name in ns else "is not kept after this cell"
            sys.stderr.write(f"[gpuhub] warning: variable {name!r} cannot leave the GPU cell ({why}); "
                             f"it {previous}\n")

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
        if not self.reaper.wait(timeout=10):  # give the last cell's grant back before leaving
            log.warning("the last GPU cell's process had not exited at shutdown; the agent expires its lease")
        if self.replica is not None:
            self.replica.close()
        return super().do_shutdown(restart)
