"""The forked child that runs one GPU cell (docs/architecture.md D2).

The replica process never initialises CUDA. For each cell it forks (ahead of need, see
gpuhub/kernel/cell_process.py); this child sets
``CUDA_VISIBLE_DEVICES`` to exactly the granted GPUs *before any user code runs*, puts the
namespace's GPU tensors back on their devices (:mod:`gpuhub.kernel.devices`), runs the cell
against its copy-on-write view of the namespace, streams outputs to the parent over a pipe, and
finally sends the namespace image (:mod:`gpuhub.kernel.image`; GPU values from the host), with
the bytes of only those large buffers the parent does not hold already. When it exits, the driver
frees its GPU memory. Nothing here may touch ZeroMQ: the parent's sockets are not fork-safe (what
the kernel's own code sends on iopub, comms above all, goes through the pipe too: PipeIopub).
"""

from __future__ import annotations

import asyncio
import builtins
import ctypes
import getpass
import io
import logging
import os
import pickle
import signal
import sys
import time
import traceback
import types
from dataclasses import dataclass, field

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import StdinNotImplementedError

from gpuhub.kernel import devices, dirty, sealed_outputs, shell_settings
from gpuhub.kernel import image as images
from gpuhub.kernel.pipe import FrameReader, FrameWriter
from gpuhub.kernel.warm_imports import imported_since
from gpuhub.replication.digest import digest

PR_SET_PDEATHSIG = 1


@dataclass
class SentImage:
    """The namespace image as the child sends it: the bytes of a buffer only when the parent's
    store lacks its digest (:meth:`gpuhub.kernel.replica.Replica.store_image` takes ``buffers``)."""

    stream: bytes
    names: list[str]
    buffers: list[tuple[str, int, bytes | None]]
    failed: dict[str, str] = field(default_factory=dict)
    imported: list[str] = field(default_factory=list)  # modules new in this process: the replica may import them
    # This process's own (digest, size, memory) of every large buffer, for a process that stays for
    # the next cell (never sent: see __reduce__)
    kept: list = field(default_factory=list, repr=False)

    def __reduce__(self):
        return SentImage, (self.stream, self.names, self.buffers, self.failed, self.imported)


class PipeStream(io.TextIOBase):
    """A GPU cell's sys.stdout or sys.stderr: text to the replica, which relays it as the kernel's
    own stream would. It looks like ipykernel's stream to code that inspects it: UTF-8 (IPython's
    %time and progress bars choose their characters by it), and the file descriptor the kernel's
    stream gives (a copy of the process's original one: ``subprocess.run(..., stdout=sys.stdout)``,
    faulthandler), or ipykernel's error where it has none."""

    encoding = "UTF-8"

    def __init__(self, name: str, chan: FrameWriter, kernel_stream=None) -> None:
        self.name = name
        self.chan = chan
        self.kernel_stream = kernel_stream  # the stream this one replaces in the cell's process

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            self.chan.send("stream", self.name, str(text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        if self.kernel_stream is None:
            raise io.UnsupportedOperation("fileno")
        return self.kernel_stream.fileno()


class PipeIopub:
    """The kernel's iopub socket in a cell's process. The replica's is served by its I/O thread,
    which a forked process lacks: what was sent there (comms: ipywidgets, tqdm.auto's progress bars)
    never left. Here each message goes to the replica as the kernel's session made it (signed, the
    cell's request as its parent), and out on the replica's iopub as it is."""

    def __init__(self, chan: FrameWriter) -> None:
        self.chan = chan

    def send_multipart(self, frames, *args, **kwargs) -> None:
        self.chan.send("iopub", [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in frames])


class PipeDisplayPublisher(DisplayPublisher):
    def __init__(self, chan: FrameWriter | None, **kw) -> None:
        super().__init__(**kw)
        self.chan = chan

    def set_parent(self, parent) -> None:
        pass  # the replica relays what this sends under the cell's request

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw) -> None:
        self.chan.send("display", data, metadata or {}, transient or {}, update)

    def clear_output(self, wait: bool = False) -> None:
        self.chan.send("clear", wait)


class PipeDisplayHook(DisplayHook):
    def __init__(self, chan: FrameWriter | None, **kw) -> None:
        super().__init__(**kw)
        self.chan = chan

    def set_parent(self, parent) -> None:
        pass  # as PipeDisplayPublisher's

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self.chan.send("result", format_dict, md_dict or {})

    def finish_displayhook(self) -> None:
        pass


_prctl = None  # libc's prctl, looked up once in the replica rather than in every child
_display: tuple[PipeDisplayPublisher, PipeDisplayHook] | None = None  # built once, see warm_up


def _die_with_parent() -> None:
    global _prctl
    try:
        if _prctl is None:
            _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def warm_up(shell) -> None:
    """Fill, once in the replica, what IPython and this module otherwise build lazily in each
    forked child and lose with it: a GPU kernel's replica never runs a cell itself, so every
    child compiled tokenize's and IPython's input regexes again (≈ 1–3 ms of a no-op cell) and
    imported IPython's logger, and built its display objects. Runs no user code."""
    global _prctl, _display
    code = "x = 1\n"
    transformed = shell.transform_cell(code)  # re.compile caches: tokenize, input transformers
    shell.should_run_async(code, transformed_cell=transformed, preprocessing_exc_tuple=None)
    shell.logger  # noqa: B018 - a lazy property that imports IPython.core.logger
    try:
        _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        pass
    _display = _display_objects(shell)


def _display_objects(shell) -> tuple[PipeDisplayPublisher, PipeDisplayHook]:
    """Display publisher and hook writing to a pipe not chosen yet (each child sets ``chan``)."""
    return (PipeDisplayPublisher(None, shell=shell),
            PipeDisplayHook(None, shell=shell, cache_size=shell.cache_size))


def serve(shell, resident: dict[str, memoryview], *, out_fd: int, in_fd: int) -> None:
    """In a process just forked from the replica: get ready for a cell (the part that needs no
    cell), wait for one ("go" on ``in_fd``), run it and report to the parent. The replica forks
    this process ahead of need (gpuhub/kernel/cell_process.py), so what is done before "go" (the
    write tracker's arming over every large buffer, above all) costs the cell nothing. Returns
    without running anything when the parent closes the pipe instead.

    A cell whose "go" says ``linger`` leaves this process waiting for the kernel's next cell, with
    its CUDA context and its GPU tensors where they are (a lingering lease): the next cell then
    starts warm. Its namespace is the one the replicas hold after the cell: a value that could not
    be replicated is dropped here too (the replicas no longer have that name, so neither would a
    fresh process). It ends when the parent closes the pipe (or the agent kills it: another kernel
    needs the GPUs)."""
    started = time.monotonic()  # the parent's debug log splits the child's time at these marks
    modules = frozenset(sys.modules)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chan, replies = FrameWriter(out_fd), FrameReader(in_fd)
    # Not the parent's event loop (it was mid-iteration when we forked): a fresh policy makes a new
    # loop on first use only; most cells never ask for one (IPython's top-level await has its own).
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop_policy(None)
    # Large buffers the cell does not write keep the parent's digests: not hashed, not sent. Armed
    # before the cell comes: nothing writes this process's memory until then.
    _, known_digest = images.track(resident, mode="forked-child", sentinel=False)
    images.build_outputs(shell.user_ns, shell.user_ns_hidden)  # the outputs the replica's load left pending
    armed = time.monotonic()
    go = replies.recv_blocking()
    if go is None or go[0] != "go":
        return  # discarded unused (the namespace changed, or the kernel is leaving)
    marks = {"started": started, "armed": armed, "go": time.monotonic()}
    _enter_cell_process(shell, go[1]["gpu_uuids"], chan, replies)
    while True:
        cell = go[1]
        kernel = getattr(shell, "kernel", None)
        if kernel is not None and cell.get("request"):  # forked before the request came: it is the cell's
            kernel.set_parent(cell.get("request_ident"), cell["request"], "shell")  # the shell's too
        sent = _run_cell(shell, cell, chan, known_digest, marks)
        sent.imported = imported_since(modules)
        stay = bool(cell.get("linger"))
        if stay:  # armed before the image's bytes go: a write from then on is seen
            try:
                known_digest = _keep_for_next_cell(shell, sent)
            except Exception:  # the cell's image goes all the same; this process then ends
                traceback.print_exc(file=sys.__stderr__)
                stay = False
        marks["sent"] = time.monotonic()
        chan.send("image", sent, marks)
        if not stay:
            return
        sent = None  # the host copies of GPU tensors it holds are freed before the wait
        go = replies.recv_blocking()
        if go is None or go[0] != "go":
            return
        marks = {"started": marks["sent"], "armed": time.monotonic(), "go": time.monotonic()}


def _enter_cell_process(shell, gpu_uuids: list[str], chan: FrameWriter, replies: FrameReader) -> None:
    """Once per process, before its first cell: its GPUs, its output and input through the pipes,
    the namespace's tensors back on their GPUs."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
    shell_settings.apply_deferred()  # extensions the replica must not load: they may start CUDA
    streams = {id(sys.stdout): PipeStream("stdout", chan, sys.stdout),
               id(sys.stderr): PipeStream("stderr", chan, sys.stderr)}
    sys.stdout, sys.stderr = streams[id(sys.stdout)], streams[id(sys.stderr)]
    _rebind_log_handlers(streams)
    publisher, hook = _display or _display_objects(shell)  # traitlets objects: slow to build per cell
    publisher.chan = hook.chan = chan
    for under in images.UNDERS:  # the output history as the replica's displayhook holds it (image.install)
        setattr(hook, under, getattr(shell.displayhook, under, ""))
    shell.display_pub = publisher
    shell.displayhook = hook
    shell.display_trap.hook = hook

    def showtraceback(self, etype, evalue, stb):
        self._last_traceback = stb
        chan.send("error", {"ename": etype.__name__, "evalue": str(evalue), "traceback": stb})

    shell._showtraceback = types.MethodType(showtraceback, shell)
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        kernel.iopub_socket = PipeIopub(chan)
        # The session refuses to send from a forked process (its sockets are the parent's); the
        # one socket it may use here is that pipe.
        kernel.session.check_pid = False

    def relayed_input(prompt: str = "", password: bool = False) -> str:
        chan.send("input", str(prompt), password)
        reply = replies.recv_blocking()
        if reply is None or reply[0] != "input_reply":
            raise EOFError("the kernel went away while waiting for input")
        _, value, error, message = reply
        if value is None:
            if error == "StdinNotImplementedError":  # the frontend takes no input: as ipykernel says
                raise StdinNotImplementedError(message)
            raise RuntimeError(f"{error}: {message}")
        return value

    builtins.input = relayed_input
    getpass.getpass = lambda prompt="Password: ", stream=None: relayed_input(prompt, True)

    devices.move_tagged_to_devices()
    shell.history_manager.db_cache_size = sys.maxsize  # never flushed here: the parent writes it


def _rebind_log_handlers(streams: dict[int, PipeStream]) -> None:
    """Log handlers made in the replica write to its sys.stdout/sys.stderr (``logging.basicConfig``
    in an earlier cell, taken on from its image: gpuhub/kernel/shell_settings.py). From a forked
    process, ipykernel sends what is written there through a socket of its own, apart from the
    cell's other output: it came after the cell's idle, or not at all when the process ended at
    once (a line logged just before an exception was lost). They write to this process's streams."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            new = streams.get(id(getattr(handler, "stream", None)))
            if new is not None and isinstance(handler, logging.StreamHandler):
                handler.stream = new  # not setStream(): flushing the kernel's stream here would touch its socket


def _run_cell(shell, cell: dict, chan: FrameWriter, known_digest, marks: dict) -> SentImage:
    """Run one cell, send its reply ("done"); the namespace image to send after it."""
    # Run as IPython runs a cell, with this cell's number: it names the cell ("Cell In[n]", the
    # compiled code's file) and moves the prompt on (Out[n], _n). The history database is the
    # parent's to write (one SQLite writer): the child keeps what it records in memory.
    shell.execution_count = cell["execution_count"]
    marks["ready"] = time.monotonic()
    result = shell.run_cell(cell["code"], store_history=cell["store_history"], silent=cell["silent"])
    err = result.error_before_exec or result.error_in_exec
    done = {"status": "ok" if result.success else "error"}
    if not result.success:
        done.update(ename=type(err).__name__, evalue=str(err), traceback=shell._last_traceback or [])
        done["user_expressions"] = {}
    else:
        done["user_expressions"] = shell.user_expressions(cell["user_expressions"] or {})
    done["payload"] = shell.payload_manager.read_payload()
    shell.payload_manager.clear_payload()  # as ipykernel: a process kept for the next cell would send them again
    chan.send("done", done)
    marks["ran"] = time.monotonic()
    sealed_outputs.note_cell(cell["code"])  # before its image: a cell that reached Out ends sealing
    return capture_image(shell, frozenset(cell["stored"]), known_digest)


def _keep_for_next_cell(shell, sent: SentImage):
    """After a cell, in a process that stays for the next one: the namespace as the replicas have
    it (a value that could not be replicated is gone there: gpuhub.kernel.image.install), and a
    write tracker over its large buffers, so that the next image hashes only what that cell wrote.
    Returns the next capture's ``known_digest``."""
    for name in sent.failed:
        shell.user_ns.pop(name, None)
    temporary = devices.take_host_copies()  # GPU tensors' host copies: never tracked (freed once sent)
    resident = {}
    for d, _size, mv in sent.kept:
        address = images.address_of(mv)
        if not any(start <= address < start + n for start, n in temporary):
            resident[d] = mv
    sent.kept = []
    if dirty.in_process_signal() == "sentinel":
        return lambda mv: None  # no page bits here: every large buffer is hashed (no sentinel in a CUDA process)
    _, known_digest = images.track(resident, mode="in-process", sentinel=True)
    return known_digest


def capture_image(shell, stored: frozenset[str], known_digest) -> SentImage:
    """The namespace image, with the bytes of the buffers whose digests the parent's store lacks
    (``stored``: those it has)."""
    cap = images.capture(shell.user_ns, shell.user_ns_hidden, known_digest=known_digest)
    buffers, kept = [], []
    for d, mv in zip(cap.digests, cap.buffers, strict=True):
        d = d or digest(mv)
        kept.append((d, mv.nbytes, mv))
        if d in stored:
            buffers.append((d, mv.nbytes, None))
        else:  # out of band: the pipe reads it from this process's memory, no copy here
            buffers.append((d, mv.nbytes, pickle.PickleBuffer(mv) if mv.contiguous else bytes(mv)))
    return SentImage(cap.stream, cap.names, buffers, cap.failed, kept=kept)
