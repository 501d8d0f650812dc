"""The gpuhub kernel: an IPython kernel that executes each cell of a GPU kernel in a forked child
holding a per-cell GPU lease (DESIGN D2). CPU-only kernels execute in-process, as ipykernel does.

Where a cell is executed: :meth:`GpuhubKernel.do_execute` → :meth:`_execute_in_child` →
:func:`gpuhub.kernel.cellchild.run` in the child.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

from ipykernel.ipkernel import IPythonKernel

from gpuhub.kernel import cellchild
from gpuhub.kernel.grants import GrantClient, GrantError
from gpuhub.kernel.pipe import FrameReader, FrameWriter


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
        self.grants = GrantClient.from_env()
        self._child_pid: int | None = None
        self._interrupted = threading.Event()
        self._digests: dict[str, str] = {}
        self._device_tags: dict[str, int] = {}
        self._startup_notice = self._notebook_dir_notice()

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
        if self._startup_notice:
            sys.stderr.write(self._startup_notice)
            self._startup_notice = ""
        if self.gpus == 0:
            return await super().do_execute(code, silent, store_history, user_expressions, allow_stdin,
                                            cell_meta=cell_meta, cell_id=cell_id)
        self._allow_stdin = allow_stdin
        return self._execute_in_child(code, silent, store_history, user_expressions or {})

    def _error_reply(self, ename: str, evalue: str) -> dict:
        tb = [f"{ename}: {evalue}"]
        self.shell._showtraceback(type(ename, (Exception,), {}), evalue, tb)
        self.shell.execution_count += 1
        return {"status": "error", "ename": ename, "evalue": evalue, "traceback": tb,
                "execution_count": self.shell.execution_count - 1, "user_expressions": {}, "payload": []}

    def _execute_in_child(self, code: str, silent: bool, store_history: bool, user_expressions: dict) -> dict:
        shell = self.shell
        if self.grants is None:
            return self._error_reply("GpuhubError", "this GPU kernel has no GPU agent to ask (GPUHUB_AGENT_URL unset)")
        self._interrupted.clear()
        try:
            grant = self.grants.acquire(self.gpus, self.grant_timeout_s, on_wait=sys.stderr.write,
                                        cancelled=self._interrupted.is_set)
        except GrantError as exc:
            return self._error_reply(type(exc).__name__, str(exc))
        try:
            return self._run_child(shell, code, silent, store_history, user_expressions, grant.uuids)
        finally:
            self.grants.release(grant)

    def _run_child(self, shell, code, silent, store_history, user_expressions, uuids) -> dict:
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe()
        hidden = set(shell.user_ns_hidden)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.close(out_r)
                os.close(in_w)
                cellchild.run(shell, code, silent=silent, store_history=store_history,
                              user_expressions=user_expressions, gpu_uuids=uuids, out_fd=out_w, in_fd=in_r,
                              digests=self._digests, device_tags=self._device_tags, hidden=hidden)
            except BaseException:  # noqa: BLE001 - report anything, then leave without cleanup
                import traceback

                traceback.print_exc(file=sys.__stderr__)
            finally:
                os._exit(0)
        os.close(out_w)
        os.close(in_r)
        self._child_pid = pid
        reader, replies = FrameReader(out_r), FrameWriter(in_w)
        done = delta = None
        try:
            while not reader.eof or reader.buf:
                for msg in reader.poll(0.5):
                    kind = msg[0]
                    if kind == "done":
                        done = msg[1]
                    elif kind == "delta":
                        delta = msg[1]
                    else:
                        self._relay(msg, replies)
                if reader.eof and len(reader.buf) == 0:
                    break
        finally:
            _, status = os.waitpid(pid, 0)
            self._child_pid = None
            os.close(out_r)
            os.close(in_w)
        if store_history:
            shell.history_manager.store_inputs(shell.execution_count, code)
        shell.execution_count += 1
        if done is None:
            # The child died mid-cell: the namespace stays as it was before this cell.
            return self._error_reply("CellProcessDied", f"the cell's process {_describe_status(status)}; "
                                     "variables are as they were before this cell")
        if delta is not None:
            self._apply_delta(delta)
        done["execution_count"] = shell.execution_count - 1
        return done

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
            except Exception as exc:  # noqa: BLE001 - the child raises it in user code
                replies.send("input_reply", None, f"{type(exc).__name__}: {exc}")

    def _apply_delta(self, delta: dict) -> None:
        ns = self.shell.user_ns
        for name, data in delta["set"].items():
            try:
                ns[name] = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001
                sys.stderr.write(f"[gpuhub] warning: variable {name!r} could not be restored "
                                 f"after the GPU cell ({type(exc).__name__}: {exc}); it keeps its old value\n")
                continue
            self._digests[name] = cellchild.digest(data)
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
        if not self._signal_cell(signal.SIGINT) and self.gpus == 0:
            super()._send_interrupt_children()

    def do_shutdown(self, restart):
        self._signal_cell(signal.SIGKILL)
        return super().do_shutdown(restart)
