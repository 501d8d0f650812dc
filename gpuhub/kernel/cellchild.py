"""The forked child that runs one GPU cell (DESIGN D2).

The replica process never initialises CUDA. For each cell it forks; this child sets
``CUDA_VISIBLE_DEVICES`` to exactly the granted GPUs *before any user code runs*, runs the cell
against its copy-on-write view of the namespace, streams outputs to the parent over a pipe, and
finally sends back what the cell changed (GPU values moved to the host). When it exits, the driver
frees its GPU memory. Nothing here may touch ZeroMQ: the parent's sockets are not fork-safe.
"""

from __future__ import annotations

import asyncio
import builtins
import ctypes
import getpass
import io
import os
import queue
import signal
import sys
import threading
import time
import types
from collections.abc import Callable

import cloudpickle
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher

from gpuhub.kernel import devices, dirty
from gpuhub.kernel.pipe import FrameReader, FrameWriter
from gpuhub.replication import oob
from gpuhub.replication.blobs import digest, fill_and_digest  # one content hash for all

PR_SET_PDEATHSIG = 1
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <sys/mman.h>; MADV_COLLAPSE since Linux 6.1
HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 32 << 20  # below this, 4 KiB pages cost the fork little
IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), frozenset, range, types.ModuleType,
             types.FunctionType, types.BuiltinFunctionType, type)


class PipeStream(io.TextIOBase):
    def __init__(self, name: str, chan: FrameWriter) -> None:
        self.name = name
        self.chan = chan

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


class PipeDisplayPublisher(DisplayPublisher):
    def __init__(self, chan: FrameWriter | None, **kw) -> None:
        super().__init__(**kw)
        self.chan = chan

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw) -> None:
        self.chan.send("display", data, metadata or {}, transient or {}, update)

    def clear_output(self, wait: bool = False) -> None:
        self.chan.send("clear", wait)


class PipeDisplayHook(DisplayHook):
    def __init__(self, chan: FrameWriter | None, **kw) -> None:
        super().__init__(**kw)
        self.chan = chan

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self.chan.send("result", format_dict, md_dict or {})

    def finish_displayhook(self) -> None:
        pass


def _buffer_range(value) -> tuple[int, int] | None:
    """(address, length) of a large contiguous buffer: ndarray, bytes, bytearray, memoryview."""
    if isinstance(value, memoryview):
        value = value.obj  # the whole exporter: the same allocation
    np = sys.modules.get("numpy")
    if np is not None and type(value) is np.ndarray:
        if not (value.flags.c_contiguous or value.flags.f_contiguous):
            return None
        return value.ctypes.data, value.nbytes
    if type(value) is bytes:
        return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value, len(value)
    if type(value) is bytearray and value:
        c = (ctypes.c_char * 1).from_buffer(value)
        try:
            return ctypes.addressof(c), len(value)
        finally:
            del c
    return None


def prefer_huge_pages(value) -> bool:
    """Back a large buffer the replica holds with 2 MiB pages, so that each GPU cell's fork copies
    512 times fewer page-table entries for it (a value that arrived through ``pickle.loads`` sits
    in 4 KiB pages: fork + exit cost about 1 s per GiB of them on the dev VM, 36 ms once
    collapsed). Synchronous (``MADV_COLLAPSE`` copies the data once); True if Linux did it."""
    try:
        where = _buffer_range(value)
    except (TypeError, ValueError, AttributeError):
        return False
    if where is None or where[1] < HUGE_MIN_BYTES:
        return False
    addr, n = where
    lo, hi = -(-addr // HUGE_PAGE) * HUGE_PAGE, (addr + n) // HUGE_PAGE * HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)  # also for pages faulted in later
        return libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0
    except (OSError, AttributeError):
        return False


_collapse_queue: "queue.SimpleQueue | None" = None


def collapse_later(value) -> None:
    """:func:`prefer_huge_pages` on a background thread (madvise releases the GIL), so collapsing a
    new large value costs the GPU kernel's next cells a cheaper fork, not this cell's reply."""
    global _collapse_queue
    try:
        where = _buffer_range(value)
    except (TypeError, ValueError, AttributeError):
        return
    if where is None or where[1] < HUGE_MIN_BYTES:
        return
    if _collapse_queue is None:
        _collapse_queue = queue.SimpleQueue()
        threading.Thread(target=_collapse_worker, args=(_collapse_queue,), name="gpuhub-huge-pages",
                         daemon=True).start()
    _collapse_queue.put(value)


def _collapse_worker(work: "queue.SimpleQueue") -> None:
    while True:
        value = work.get()
        prefer_huge_pages(value)
        del value  # do not keep the last value alive while waiting


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


def run(shell, code: str, *, silent: bool, store_history: bool, user_expressions: dict,
        gpu_uuids: list[str], out_fd: int, in_fd: int, digests: dict[str, str],
        device_tags: dict[str, int], hidden: set[str]) -> None:
    """Run one cell in this (child) process and report to the parent. Never returns normally."""
    started = time.monotonic()  # the parent's debug log splits the child's time at these marks
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
    chan, replies = FrameWriter(out_fd), FrameReader(in_fd)

    # Not the parent's event loop (it was mid-iteration when we forked): a fresh policy makes a new
    # loop on first use only; most cells never ask for one (IPython's top-level await has its own).
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop_policy(None)

    sys.stdout = PipeStream("stdout", chan)
    sys.stderr = PipeStream("stderr", chan)
    publisher, hook = _display or _display_objects(shell)  # traitlets objects: slow to build per cell
    publisher.chan = hook.chan = chan
    shell.display_pub = publisher
    shell.displayhook = hook
    shell.display_trap.hook = hook

    def showtraceback(self, etype, evalue, stb):
        self._last_traceback = stb
        chan.send("error", {"ename": etype.__name__, "evalue": str(evalue), "traceback": stb})

    shell._showtraceback = types.MethodType(showtraceback, shell)

    def relayed_input(prompt: str = "", password: bool = False) -> str:
        chan.send("input", str(prompt), password)
        reply = replies.recv_blocking()
        if reply is None or reply[0] != "input_reply":
            raise EOFError("the kernel went away while waiting for input")
        if reply[1] is None:
            raise RuntimeError(reply[2])
        return reply[1]

    builtins.input = relayed_input
    getpass.getpass = lambda prompt="Password: ", stream=None: relayed_input(prompt, True)

    ns = shell.user_ns
    for name, index in device_tags.items():
        if name in ns:
            ns[name] = devices.to_device(ns[name], index)
    before = {k: id(v) for k, v in ns.items() if k not in hidden}
    # Large buffers the group already has: skip re-pickling those the cell did not write.
    tracker = dirty.Tracker.arm(ns, [k for k in before if k in digests and k not in device_tags],
                                forked=True)

    # History is the parent's to write (one SQLite writer); the child runs with the same prompt number.
    ready = time.monotonic()
    result = shell.run_cell(code, store_history=False, silent=silent)
    err = result.error_before_exec or result.error_in_exec
    done = {"status": "ok" if result.success else "error"}
    if not result.success:
        done.update(ename=type(err).__name__, evalue=str(err), traceback=shell._last_traceback or [])
        done["user_expressions"] = {}
    else:
        done["user_expressions"] = shell.user_expressions(user_expressions or {})
    done["payload"] = shell.payload_manager.read_payload()
    chan.send("done", done)
    ran = time.monotonic()
    delta = namespace_delta(ns, before, digests, hidden, tracker=tracker)
    chan.send("delta", delta, {"started": started, "ready": ready, "ran": ran, "sent": time.monotonic()})


def pickle_value(value, *, out_of_band: bool = False, alloc: Callable[[int], bytearray] | None = None
                 ) -> tuple[bytes | bytearray | memoryview, str | None]:
    """The bytes that replicate ``value``, and their digest when it came for free: an in-band
    pickle, or with ``out_of_band`` a layout (gpuhub/replication/oob.py) when the value holds
    large buffers. A layout is written into new memory the caller owns (``alloc(n)``: at least
    n bytes, e.g. a reused buffer; the result is then a view of its first n), never aliasing the
    value (the blob store keeps these bytes while later in-process cells may write the value in
    place), and hashed while it is written."""
    if not out_of_band:
        return cloudpickle.dumps(value, protocol=5), None
    layout = oob.dumps(value)
    if isinstance(layout, bytes):
        return layout, None
    buf = alloc(layout.nbytes) if alloc is not None else bytearray(layout.nbytes)
    view = memoryview(buf)[:layout.nbytes]
    d = fill_and_digest(view, lambda lo, hi: layout.write_range(view, lo, hi))
    return (view if len(buf) != layout.nbytes else buf), d


def namespace_delta(ns: dict, before: dict[str, int], digests: dict[str, str], hidden: set[str], *,
                    tracker: dirty.Tracker | None = None, out_of_band: bool = False,
                    alloc: Callable[[int], bytearray] | None = None) -> dict:
    """What the cell changed: new or rebound names, mutated objects (by content digest), deletions.

    ``tracker`` (armed before the cell over names whose values the group has, see
    gpuhub/kernel/dirty.py) lets large buffers that no write touched skip the pickle + digest.
    ``out_of_band``, ``alloc``: large buffers travel as a layout (:func:`pickle_value`)."""
    changed: dict[str, bytes] = {}
    hashed: dict[str, str] = {}  # digests computed here, so the commit need not hash 1 GiB again
    tags: dict[str, int] = {}
    failed: dict[str, str] = {}
    for name, value in list(ns.items()):
        if name in hidden or name.startswith("_"):
            continue
        rebound = before.get(name) != id(value)
        if not rebound and isinstance(value, IMMUTABLE):
            continue
        if not rebound and tracker is not None and tracker.unchanged(name, value):
            continue
        try:
            host_value, index = devices.to_host(value)
            data, known = pickle_value(host_value, out_of_band=out_of_band, alloc=alloc)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is reported by name
            if rebound:
                failed[name] = f"{type(value).__name__}: {exc}"
            continue
        if known is not None or not rebound:
            hashed[name] = known or digest(data)
        if rebound or digests.get(name) != hashed[name]:
            changed[name] = data
            if index is not None:
                tags[name] = index
    deleted = [name for name in before if name not in ns and not name.startswith("_")]
    return {"set": changed, "deleted": deleted, "device_tags": tags, "failed": failed,
            "digests": {name: d for name, d in hashed.items() if name in changed}}
