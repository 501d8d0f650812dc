"""Modules a GPU cell's child imported, imported again in its replica so later children have them.

A GPU kernel's replica never runs a cell: each cell runs in a child forked from it
(gpuhub/kernel/child.py), and whatever the child imports dies with it. Libraries import a lot
lazily: the first optimizer step in a process imports ``torch._dynamo`` (869 modules, about 1 s
on an H100 server), so every GPU cell paid that again where a plain ipykernel pays it once. After
such a cell, between cells, the replica imports what its child imported; the next children
inherit the modules.

An import in the replica must not break what every later child relies on:

- **no CUDA initialised there**: a child forked from a process that called ``cuInit`` cannot use
  CUDA. The driver tells without initialising anything: ``cuDeviceGetCount`` answers
  CUDA_ERROR_NOT_INITIALIZED until some code calls ``cuInit``.
- **no thread started there**: a child has none of its parent's threads, and a module whose
  thread is missing may wait for it forever.

So a *probe*, a child forked first, imports the same modules and reports both; only when it saw
neither does the replica import them (:meth:`ImportWarmer.probe_done`). Names the probe refused
are never tried again. Output printed while importing goes nowhere: in the replica it would reach
the notebook as the last cell's output.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import signal
import sys
import time

from gpuhub.kernel.quiet import silenced

log = logging.getLogger("gpuhub.kernel")

CUDA_ERROR_NOT_INITIALIZED = 3
MAX_NAMES = 5000  # one cell's imports; bounded so that a pathological cell cannot flood the pipe
PROBE_TIMEOUT_S = 120  # a probe whose imports hang is killed (SIGALRM), and its names refused


def imported_since(before: set[str] | frozenset[str]) -> list[str]:
    """Modules in ``sys.modules`` now and not in ``before``, under their own names (aliases such as
    ``os.path`` and modules made at run time without a spec are left out: they cannot be imported
    by name), in import order."""
    names = []
    for name, module in list(sys.modules.items()):
        if name in before or name == "__main__":
            continue
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.name == name:
            names.append(name)
            if len(names) >= MAX_NAMES:
                break
    return names


def cuda_initialised() -> bool:
    """Whether this process has called ``cuInit`` (False when the CUDA driver is not even loaded)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def thread_count() -> int:
    """Threads of this process, native ones included (a module may start them in C)."""
    return len(os.listdir("/proc/self/task"))


def import_quietly(names: list[str]) -> list[str]:
    """Import ``names``; return those that imported. Nothing they print or warn reaches the notebook."""
    done = []
    with silenced():  # the cell's own process showed it, as a plain kernel shows it, once
        for name in names:
            if name in sys.modules:
                done.append(name)
                continue
            try:
                importlib.import_module(name)
                done.append(name)
            except BaseException:  # SystemExit from a module's top level too
                pass
    return done


def _probe(names: list[str], fd: int) -> None:
    """In the probe child: import ``names``, report what changed on ``fd``, exit. Never returns."""
    try:
        signal.alarm(PROBE_TIMEOUT_S)
        threads = thread_count()
        cuda = cuda_initialised()
        ok = import_quietly(names)
        report = {"ok": ok, "cuda": cuda_initialised() and not cuda, "threads": thread_count() - threads}
        data = memoryview(json.dumps(report).encode())
        while data:
            data = data[os.write(fd, data):]
    finally:
        os._exit(0)


class ImportWarmer:
    """Offered the modules each child imported; probes them, then imports the safe ones here.

    All methods run on the replica's main thread, between cells (the kernel's event loop), so a
    cell's fork never happens in the middle of an import."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.refused: set[str] = set()
        self.warmed = 0  # modules imported here so far (the debug log reports it)
        self._probe: tuple[int, int, list[str], float] | None = None  # pid, read fd, names, started

    def offer(self, names: list[str]) -> None:
        known = set(self.pending)
        self.pending += [n for n in names if n not in sys.modules and n not in self.refused and n not in known]

    @property
    def probing(self) -> bool:
        """A probe is out: its modules are about to be imported here."""
        return self._probe is not None

    def start_probe(self) -> int | None:
        """Fork a probe for the pending names; returns the fd that becomes readable when it reports
        (None when there is nothing to probe or a probe is still out)."""
        if self._probe is not None or not self.pending:
            return None
        names, self.pending = self.pending, []
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _probe(names, write_fd)
        os.close(write_fd)
        self._probe = (pid, read_fd, names, time.monotonic())
        return read_fd

    def probe_done(self) -> None:
        """The probe reported (or died): import what it found safe, refuse the rest."""
        if self._probe is None:
            return
        pid, read_fd, names, started = self._probe
        self._probe = None
        chunks = []
        try:
            while chunk := os.read(read_fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(read_fd)
            os.waitpid(pid, 0)
        try:
            report = json.loads(b"".join(chunks))
        except ValueError:  # it died or hung (SIGALRM): none of these are tried again
            self.refused.update(names)
            log.warning("import probe of %d module(s) gave no report; they stay in the cells' processes", len(names))
            return
        if report["cuda"] or report["threads"] > 0:
            self.refused.update(names)
            log.info("not importing %d module(s) in the replica: the probe saw %s", len(names),
                     "CUDA initialised" if report["cuda"] else f"{report['threads']} thread(s) started")
            return
        self.refused.update(set(names) - set(report["ok"]))
        began = time.monotonic()
        self.warmed += len(import_quietly(report["ok"]))
        if cuda_initialised():  # the probe saw none: an import that behaves otherwise here
            log.error("importing a cell's modules initialised CUDA in the replica: its GPU cells may fail")
        log.debug("imported %d module(s) a cell's process used, in %.0f ms (probe %.0f ms)", len(report["ok"]),
                  (time.monotonic() - began) * 1000, (began - started) * 1000)

    def close(self) -> None:
        if self._probe is not None:
            pid, read_fd, _, _ = self._probe
            self._probe = None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.close(read_fd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
