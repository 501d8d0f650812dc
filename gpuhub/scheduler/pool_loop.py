"""The elastic pool at work: the scheduler's side of gpuhub/scheduler/pool.py.

Every ``pool_interval_s`` it tells the pool rule what the servers hold and how many GPUs are wanted
(granted now, plus those of cells that asked for a migration no server could take), then does what
the rule says: drain a server (heal moves its replicas away, a running cell finishing first), put
one back in service, release an empty drained one through the admin's hook, or acquire a lent one
through the other hook. A hook is a command with the server's name as its one argument (a Slurm
``scontrol``, an IPMI power command; docs/install.md, "Elastic GPU pool").

A hook that fails, hangs past ``pool_hook_timeout_s``, or an acquired server whose agent does not
heartbeat within ``pool_acquire_timeout_s`` is an event (one log line naming the server, the hook
and its output; ``gpuhub_pool_hook_failures_total``), never a stuck pool: a failed release puts the
server back in service, a failed acquire leaves it lent and rests it for ``pool_retry_s`` while the
pool tries another. Without hooks the pool only reports what it would do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import signal
import time
from collections import Counter
from typing import TYPE_CHECKING

from gpuhub.scheduler.pool import PoolPlan, PoolPolicy, PoolServer, PoolSettings

if TYPE_CHECKING:  # the scheduler owns the pool; no import cycle at run time
    from gpuhub.scheduler.service import NodeRecord, Scheduler

log = logging.getLogger(__name__)

# A cell that asked for a migration no server could take counts as demand this long (it asks every 5 s).
WAITING_TTL_S = 15.0
# Hook output kept for the log line (the tail: errors come last).
HOOK_OUTPUT_CHARS = 2000
# A server name a hook may get as its argument (never one that reads as an option).
HOOK_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class HookFailed(RuntimeError):
    """A pool hook exited non-zero, timed out or could not start; the message says which and why."""


async def run_hook(command: str, node: str, timeout_s: float) -> str:
    """Run ``command NODE`` (split like a shell would, no shell, in a process group of its own);
    its output, or HookFailed."""
    if not HOOK_NODE.match(node):
        raise HookFailed(f"refused to pass the server name {node!r} to a hook")
    argv = [*shlex.split(command), node]
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise HookFailed(f"could not start {argv[0]!r}: {exc.strerror or exc}") from None

    async def kill() -> None:  # the hook and whatever it started
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await asyncio.shield(proc.wait())

    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        await kill()
        raise HookFailed(f"still running after {timeout_s:g} s (pool_hook_timeout_s); killed") from None
    except asyncio.CancelledError:  # the scheduler stops: no hook outlives it
        await kill()
        raise
    text = out.decode(errors="replace").strip()[-HOOK_OUTPUT_CHARS:]
    if proc.returncode != 0:
        raise HookFailed(f"exited with status {proc.returncode}" + (f": {text}" if text else ""))
    return text


class ElasticPool:
    def __init__(self, scheduler: Scheduler) -> None:
        c = scheduler.config
        self.s = scheduler
        self.config = c
        self.policy = PoolPolicy(PoolSettings(
            min_active=c.pool_min_active, max_active=c.pool_max_active, headroom_gpus=c.pool_headroom_gpus,
            spare_servers=c.pool_spare_servers, release_after_s=c.pool_release_after_s,
            spare_recent_s=c.pool_spare_recent_s, max_subscription_ratio=c.max_subscription_ratio, replicas=3))
        self._hooks: dict[str, asyncio.Task] = {}  # server -> its hook now running (one at a time)
        self.acts = bool(c.pool_release_command)  # without hooks: report only
        self.waiting: dict[str, tuple[int, float]] = {}  # kernel -> (GPUs its cell waits for, when it asked)
        self.resting: dict[str, float] = {}  # server -> until when it is not acquired again (a failed acquire)
        self.hook_runs: Counter = Counter()  # (hook, outcome) -> runs
        self.events: Counter = Counter()  # action -> count (acquired, released, drained, undrained)
        self.last_plan = PoolPlan()
        self.demand = 0
        self._reported: str = ""  # the last "would do" line, logged once

    # --- what the scheduler tells it ----------------------------------------------------------------
    def cell_waits(self, kernel_id: str, gpus: int) -> None:
        """A cell of ``kernel_id`` waits for ``gpus`` GPUs that no active server can grant now."""
        self.waiting[kernel_id] = (gpus, time.monotonic())

    def cell_placed(self, kernel_id: str) -> None:
        self.waiting.pop(kernel_id, None)

    def placement_failed(self, kernel_id: str) -> None:
        """A new kernel found no servers for its replicas: the pool wants a server more."""
        largest = max((self.s.node_view(r).gpu_count for r in self.s.nodes.values()), default=1)
        self.waiting["placement:" + kernel_id] = (largest, time.monotonic())

    def state(self, rec: NodeRecord) -> str:
        """The pool's name for a server: active, draining, lent, acquiring or lost."""
        if rec.pool in ("lent", "acquiring"):
            return rec.pool
        if not self.s.live(rec):
            return "lost"
        return "draining" if rec.pool == "draining" else "active"

    # --- one decision -----------------------------------------------------------------------------
    def servers(self) -> list[PoolServer]:
        replicas: Counter = Counter(r.node for k in self.s.kernels.values() for r in k.replicas)
        out = []
        for rec in self.s.nodes.values():
            if rec.drained or "gpu" not in rec.info.get("roles", ["gpu"]):
                continue  # drained by an admin, or a notebook host: not the pool's
            state = self.state(rec)
            if state == "lent" and self.resting.get(rec.name, 0.0) > time.monotonic():
                state = "lost"  # resting after a failed acquire: the pool tries another
            elif rec.name in self._hooks and state != "acquiring":
                state = "lost"  # its release hook runs: not the pool's to count or touch meanwhile
            v = self.s.node_view(rec)
            busy = state in ("active", "draining")
            out.append(PoolServer(rec.name, v.gpu_count, state, v.committed if busy else 0,
                                  v.pending if busy else 0, replicas[rec.name] if busy else 0))
        return out

    def current_demand(self) -> int:
        now = time.monotonic()
        for kid, (_, since) in list(self.waiting.items()):
            if now - since > WAITING_TTL_S or (kid not in self.s.kernels and not kid.startswith("placement:")):
                del self.waiting[kid]
        committed = sum(self.s.node_view(r).committed for r in self.s.nodes.values() if self.s.live(r))
        return committed + sum(g for g, _ in self.waiting.values())

    async def step(self) -> PoolPlan:
        self._check_acquiring()
        self.demand = self.current_demand()
        now = time.time()
        # Cells noted when they were granted (as the simulator notes them when they start) or now
        # that they wait.
        for lease in self.s.live_leases():
            self.policy.recent.note(lease.gpus, min(lease.granted_at, now))
        for gpus, _ in self.waiting.values():
            self.policy.recent.note(gpus, now)
        largest = self.policy.recent.largest(now)
        # every replica of a kernel needs a server of its own (3 when the kernelspecs ask for the default)
        replicas = max((len(k.replicas) for k in self.s.kernels.values()), default=3)
        plan = self.policy.plan(self.servers(), self.demand, now, largest_request=largest,
                                min_servers=max(3, replicas))
        self.last_plan = plan
        if not self.acts:
            self._report(plan)
            return plan
        why = (f"demand {self.demand} GPU(s), {plan.wanted_gpus} wanted active with the headroom and the "
               "replicas' room")
        for name in plan.undrain:
            self._set(name, "", f"back in service: {why}")
            self.events["undrained"] += 1
        for name in plan.drain:
            self._set(name, "draining", f"draining to lend it ({why}); its replicas move away")
            self.events["drained"] += 1
        for name in plan.release:
            self._start_hook(name, self._release(name))
        for name in plan.acquire:
            self._set(name, "acquiring", f"acquiring: {why}, or no spare server")
            self._start_hook(name, self._acquire(name))
        return plan

    def _start_hook(self, name: str, work) -> None:
        """Run a hook's work in the background, one at a time per server: a slow hook holds
        neither the pool's next decisions nor another server's hook."""
        task = asyncio.ensure_future(work)
        self._hooks[name] = task
        task.add_done_callback(lambda _t: self._hooks.pop(name, None))

    def _report(self, plan: PoolPlan) -> None:
        parts = [f"{verb} {', '.join(names)}" for verb, names in
                 (("acquire", plan.acquire), ("put back", plan.undrain), ("drain and lend", plan.drain)) if names]
        line = "; ".join(parts)
        if line and line != self._reported:
            log.info("pool (report only, no pool_release_command): would %s (demand %d GPU(s), %d wanted active "
                     "with the headroom and the replicas' room)", line, self.demand, plan.wanted_gpus)
        self._reported = line

    def _set(self, name: str, pool_state: str, why: str) -> None:
        rec = self.s.nodes.get(name)
        if rec is None:
            return
        rec.pool, rec.pool_since = pool_state, time.time()
        self.s.save()
        log.info("pool: %s %s", name, why)

    # --- hooks -------------------------------------------------------------------------------------
    async def _release(self, name: str) -> None:
        # The books may lag: a kernel being created or a replica moving may be on its way there.
        info = await self.s.ask_node(name)
        busy = self.s.busy_targets()
        if info is None or int(info.get("pending", 0)) or int(info.get("committed", 0)) or name in busy:
            log.info("pool: %s is not released yet: %s", name, "its agent does not answer" if info is None
                     else "a replica is on its way there or holds GPUs")
            return
        try:
            out = await run_hook(self.config.pool_release_command, name, self.config.pool_hook_timeout_s)
        except HookFailed as exc:
            self.hook_runs["release", "failed"] += 1
            log.error("pool: releasing %s failed: gpuhub_pool_release_command %s; %s stays in service",
                      name, exc, name)
            self._set(name, "", "back in service after the failed release")
            return
        self.hook_runs["release", "ok"] += 1
        self.events["released"] += 1
        self._set(name, "lent", "released (lent)" + (f": {out}" if out else ""))

    async def _acquire(self, name: str) -> None:
        try:
            out = await run_hook(self.config.pool_acquire_command, name, self.config.pool_hook_timeout_s)
        except HookFailed as exc:
            self.hook_runs["acquire", "failed"] += 1
            self._acquire_failed(name, f"gpuhub_pool_acquire_command {exc}")
            return
        self.hook_runs["acquire", "ok"] += 1
        rec = self.s.nodes.get(name)
        if rec is not None and rec.pool == "acquiring":
            rec.pool_since = time.time()  # its agent must heartbeat after this (a lent one may never have stopped)
            self.s.save()
        if out:
            log.info("pool: acquire hook for %s: %s", name, out)

    def _acquire_failed(self, name: str, why: str) -> None:
        rec = self.s.nodes.get(name)
        if rec is None or rec.pool != "acquiring":
            return
        self.resting[name] = time.monotonic() + self.config.pool_retry_s
        log.error("pool: acquiring %s failed: %s; it stays lent for %g s while the pool tries another server",
                  name, why, self.config.pool_retry_s)
        self._set(name, "lent", "lent again")

    def _check_acquiring(self) -> None:
        """An acquired server is active once its agent heartbeats after the hook began; a server that
        stays silent past ``pool_acquire_timeout_s`` failed to come back."""
        now = time.time()
        for rec in list(self.s.nodes.values()):
            if rec.pool != "acquiring" or rec.name in self._hooks:
                continue  # (the hook still runs: the server is not ours before it ends)
            if rec.last_seen > rec.pool_since and self.s.live(rec):
                self.events["acquired"] += 1
                self._set(rec.name, "", f"acquired: its agent is back after {now - rec.pool_since:.0f} s")
            elif now - rec.pool_since > self.config.pool_acquire_timeout_s:
                self.hook_runs["acquire", "timeout"] += 1
                self._acquire_failed(rec.name, f"its agent did not heartbeat within "
                                               f"{self.config.pool_acquire_timeout_s:g} s (pool_acquire_timeout_s)")

    async def close(self) -> None:
        """Stop the hooks still running (the scheduler stops); their servers' state is in the books."""
        tasks = list(self._hooks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def counts(self) -> Counter:
        """Servers by pool state (for gpuhub_pool_servers)."""
        return Counter(self.state(r) for r in self.s.nodes.values()
                       if not r.drained and "gpu" in r.info.get("roles", ["gpu"]))


async def pool_loop(pool: ElasticPool) -> None:
    try:
        while True:
            try:
                await pool.step()
            except Exception:
                log.exception("pool step failed")
            await asyncio.sleep(pool.config.pool_interval_s)
    finally:
        await pool.close()
