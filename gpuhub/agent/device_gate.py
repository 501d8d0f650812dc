"""Which device nodes each unit may open: a GPU only while a grant holds it (docs/security.md).

Leases alone are advisory: ``CUDA_VISIBLE_DEVICES`` is an environment variable user code can
change. So kernel and server units start with ``DevicePolicy=closed`` (systemd's standard pseudo
devices only, plus the GPU driver's shared control nodes for kernels), and the agent gives a kernel
unit its granted GPUs' device nodes at each grant and takes them back at release
(``systemctl set-property --runtime``: systemd's cgroup device controller or BPF program does the
refusing, EPERM at open). Access already open is not revoked by the kernel's device controller:
a GPU cell runs in a child process that exits with its cell, and the lease ends after it.

The gate converges on what the leases say, one unit at a time: a grant and a release racing for
the same unit end in the list of whichever came last, because each change applies the book's
state when it runs, not its own delta.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

from gpuhub.agent.units import UnitError
from gpuhub.gpus.base import GpuInventory

log = logging.getLogger(__name__)

ACCESS = "rw"  # read and write; no mknod


class DeviceRunner(Protocol):
    backend: str

    async def set_devices(self, name: str, devices: tuple[str, ...]) -> None: ...


class DeviceGateError(RuntimeError):
    """A unit's device list could not be changed: its cell must not run as if it had its GPUs."""


def allow_entry(device: str) -> str:
    return f"{device} {ACCESS}"


class DeviceGate:
    def __init__(self, runner: DeviceRunner, inventory: GpuInventory, extra: Iterable[str] = (),
                 enabled: bool = True) -> None:
        # The process backend runs units as the agent's own processes: nothing to enforce with.
        self.enabled = enabled and runner.backend == "systemd"
        self._runner = runner
        self._inventory = inventory
        self._extra = tuple(extra)
        self._kinds: dict[str, str] = {}  # units the gate looks after: name -> kind
        self._applied: dict[str, frozenset[int] | None] = {}  # None: unknown (adopted, or a change failed)
        self._wanted: Mapping[str, frozenset[int]] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    # --- what a unit may open ----------------------------------------------------------------
    def devices(self, kind: str, gpus: Iterable[int] = ()) -> tuple[str, ...]:
        if kind != "kernel":
            return self._extra  # a user's server never runs a cell: no GPU, no driver node
        granted = [p for g in sorted(gpus) for p in self._inventory.device_paths(g)]
        return (*self._inventory.shared_device_paths(), *self._extra, *granted)

    def at_start(self, kind: str) -> tuple[str, ...] | None:
        """The DeviceAllow= entries a new unit starts with (no GPU), or None when not enforcing."""
        return tuple(allow_entry(d) for d in self.devices(kind)) if self.enabled else None

    # --- units coming and going --------------------------------------------------------------
    def started(self, name: str, kind: str) -> None:
        """A unit started with ``at_start``'s list."""
        if self.enabled:
            self._kinds[name] = kind
            self._applied[name] = frozenset()

    def adopted(self, name: str, kind: str) -> None:
        """A unit found running after an agent restart (perhaps started by an older agent, without a
        device policy): its list is applied again at the next ``follow``."""
        if self.enabled:
            self._kinds[name] = kind
            self._applied[name] = None

    def forget(self, name: str) -> None:
        self._kinds.pop(name, None)
        self._applied.pop(name, None)

    # --- grants ------------------------------------------------------------------------------
    def follow(self, wanted: Mapping[str, frozenset[int]]) -> None:
        """The leases now hold these GPUs per unit (a unit not named holds none): bring every unit
        whose list differs there, in the background (``ready`` waits for one unit)."""
        if not self.enabled:
            return
        self._wanted = wanted
        for name in self._kinds:
            if name not in self._tasks and self._applied.get(name) != wanted.get(name, frozenset()):
                self._tasks[name] = asyncio.get_running_loop().create_task(self._converge(name))

    async def ready(self, name: str) -> None:
        """Wait until ``name``'s device list is what the leases say; DeviceGateError if it cannot be."""
        task = self._tasks.get(name)
        if task is not None:
            await asyncio.shield(task)
        if name in self._kinds and self._applied.get(name) != self._wanted.get(name, frozenset()):
            raise DeviceGateError(f"could not give {name} its GPUs' device nodes (see the agent's log)")

    async def _converge(self, name: str) -> None:
        try:
            while name in self._kinds:
                want = self._wanted.get(name, frozenset())
                if self._applied.get(name) == want:
                    return
                try:
                    await self._runner.set_devices(name, tuple(allow_entry(d) for d in
                                                               self.devices(self._kinds[name], want)))
                except UnitError as exc:
                    if name in self._kinds:  # not stopped meanwhile
                        log.error("%s: device access not changed to GPUs %s: %s", name, sorted(want), exc)
                        self._applied[name] = None
                    return
                if name in self._kinds:
                    self._applied[name] = want
        finally:
            self._tasks.pop(name, None)
