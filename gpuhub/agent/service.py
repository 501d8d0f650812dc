"""The node agent's state: its GPUs, the units it started, and the per-cell leases.

systemd (or the process runner) is the source of truth for what runs; the state file keeps what
systemd cannot (who a unit belongs to, its GPU spec, live leases) so an agent restart stops nothing
and forgets nothing (docs/architecture.md D5).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import pwd
import re
import secrets
import sys
import time
from dataclasses import asdict
from pathlib import Path

import gpuhub
from gpuhub.agent.config import AgentConfig
from gpuhub.agent.device_gate import DeviceGate, DeviceGateError
from gpuhub.agent.journals import Journals
from gpuhub.agent.leases import Lease, LeaseBook, LeaseError
from gpuhub.agent.lingering import LingeringProcesses, LingerRefused
from gpuhub.agent.metrics import cell_gpu_wait_histogram
from gpuhub.agent.ports import kernel_connection, ports_taken
from gpuhub.agent.quota_gate import QuotaGate, QuotaRefused, UsageMeter
from gpuhub.agent.records import (
    CONNECTION_FILE,
    PEERS_FILE,
    UnitRecord,
    blob_addr,
    raft_addr,
    sha256,
    units_from_books,
    units_to_books,
)
from gpuhub.agent.recovery import (
    adopt_unit,
    gone_for_good,
    live_leases,
    load_state,
    pid_alive,
    saved_leases,
)
from gpuhub.agent.units import UNIT_NAME, UnitConflict, UnitError, UnitSpec, make_runner
from gpuhub.gpus.inventory import GpuInventory, open_inventory
from gpuhub.platform import move_fence, releases
from gpuhub.platform.curve import with_keys
from gpuhub.platform.store import CorruptStore, JsonStore
from gpuhub.platform.tls import local_api_url

log = logging.getLogger(__name__)

# The end of a stopped unit's log that GET /api/v1/units/{name} shows (its start error, mostly).
ERROR_LINES = 20
ERROR_CHARS = 4000
# A user server's copy of its host's servers' certificate and key, in the unit's directory.
SERVER_TLS_CERT, SERVER_TLS_KEY = "server-tls.crt", "server-tls.key"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
# How long a move's fence on a replica holds (Agent.fence): longer than a move takes (start
# the new replica, change the group, stop the old one), short enough that a lost "call it off"
# costs that replica its GPUs for a few minutes at most.
FENCE_S = 180.0
# A lingering lease older than the kernel's linger time by this much is taken back by the agent.
LINGER_SLACK_S = 60.0


class FenceError(RuntimeError):
    """A replica could not be fenced (Agent.fence): the move it guards must wait."""


class Agent:
    def __init__(self, config: AgentConfig, inventory: GpuInventory | None = None) -> None:
        self.config = config
        self.inventory = inventory or open_inventory(
            config.gpus.get("backend", "auto"), config.gpus.get("fake"), config.node_name
        )
        self.book = LeaseBook(self.inventory.count())
        self.runner = make_runner(config.unit_backend, config.runtime_dir, config.min_uid)
        self.device_gate = DeviceGate(self.runner, self.inventory, config.unit_devices,
                                      enabled=config.device_policy == "closed")
        self.units: dict[str, UnitRecord] = {}
        # Replicas a migration is moving away → when the fence lapses (monotonic): no new GPU
        # leases for them (see fence). In memory only: the move it guards takes seconds.
        self.fenced: dict[str, float] = {}
        self.state_path = Path(config.state_dir) / "state.json"
        # 0600: lease token digests, who runs what. Saved at every grant and release, on a GPU cell's
        # path, so not durable: what it describes (transient units, leases of running cells) does
        # not survive a power loss of this node either, and a crash of the agent alone keeps the
        # page cache. Atomic either way.
        self.store = JsonStore(self.state_path, durable=False)
        # Its own file: written when the scheduler's answer changes it, not at every grant and release.
        self.quota_store = JsonStore(Path(config.state_dir) / "quota_view.json", durable=False)
        self.journals = Journals(config.state_dir)
        # reclaimed: lingering leases ended for another grant
        self.counters = {"granted": 0, "refused": 0, "expired": 0, "released": 0, "reclaimed": 0}
        self.lingering = LingeringProcesses()
        self._background: set[asyncio.Task] = set()  # lingering leases being taken back
        self._main_pids: dict[str, int | None] = {}  # unit -> its main process, as systemd said (linger)
        self._unit_locks: dict[str, list] = {}  # unit -> [lock held while it starts or stops, users]
        self.quota_refusals = {"gpus": 0, "gpu_hours": 0}
        self.meter = UsageMeter()  # GPU-seconds of ended leases, until the scheduler has them
        self.quota_gate = QuotaGate()
        self.cell_gpu_wait = cell_gpu_wait_histogram()
        self.cell_gpu_wait.labels(config.node_name)  # exported from 0 on, so rate() sees the first cell
        self._gpu_cache: tuple[float, list] = (0.0, [])

    # --- persistence and recovery ----------------------------------------------
    def save(self) -> None:
        units, incarnations = units_to_books(self.units)
        self.store.save({
            "node": self.config.node_name,
            "units": units,
            "incarnations": incarnations,
            "leases": [lease.to_dict() for lease in self.book.leases.values()],
            "usage": self.meter.to_dict(),
            # A lease that does not survive a crash or reboot counts its GPU-hours up to here.
            "saved_at": time.time(),
        })

    async def recover(self) -> None:
        """Rebuild units and leases from the state file and systemd; stop nothing."""
        data = load_state(self.store)
        self.units.update(units_from_books(data.get("units", {}), data.get("incarnations", {})))
        running = set(await self.runner.list())
        for name in running - set(self.units):
            self.units[name] = await adopt_unit(self.runner, name)
            log.warning("adopted unit %s found in systemd but not in the state file", name)
        for name in list(self.units):
            if await gone_for_good(self.runner, name):
                # Its replica is replaced by the scheduler, so its journal can never be used again.
                log.info("unit %s is no longer running; forgetting it", name)
                self._forget(name)
                self.journals.remove(name)
        if self.config.unit_backend == "systemd":
            self.journals.open_parents()
        self.meter = UsageMeter.from_dict(data.get("usage"))
        saved = saved_leases(data.get("leases", []))
        live = live_leases(saved, self.units)
        for lease in live:
            lease.user = lease.user or self.units[lease.holder].user  # leases saved before quotas
            lease.kernel_id = lease.kernel_id or self.units[lease.holder].kernel_id
            self.book.leases[lease.lease_id] = lease
        ended = [le for le in saved if le.lease_id not in self.book.leases]
        self._ended(ended, now=min(float(data.get("saved_at") or 0.0), time.time()))
        await self._recover_lingering()
        try:  # enforced from the start, not from the next heartbeat
            self.quota_gate.update(self.quota_store.load())
        except CorruptStore:
            log.warning("quota view %s is corrupt; quotas are enforced again from the next heartbeat",
                        self.quota_store.path)
        for u in self.units.values():
            if u.kind == "kernel":
                self.book.place(u.name, u.gpus)
            self.device_gate.adopted(u.name, u.kind)  # its list is applied again just below
        self._leases_changed()
        self.save()
        log.info("recovered %d unit(s) and %d lease(s)", len(self.units), len(self.book.leases))

    async def _recover_lingering(self) -> None:
        """Hold again the processes of lingering leases (checked as at linger time); a lease whose
        process is gone or cannot be checked ends (its kernel's next cell asks anew)."""
        for lease in [le for le in self.book.leases.values() if le.lingering_pid is not None]:
            status = await self.runner.status(lease.holder)
            self._main_pids[lease.holder] = status.main_pid if status.active else None  # as linger() keeps it
            try:
                self.lingering.adopt(lease.lease_id, lease.lingering_pid, self._main_pids[lease.holder],
                                     self._unit_uid(self.units[lease.holder]))
            except (LingerRefused, KeyError) as exc:
                log.info("lingering lease %s of %s ends: %s", lease.lease_id, lease.holder, exc)
                self.book.release(lease.lease_id)

    # --- GPUs ----------------------------------------------------------------
    def gpus(self) -> list:
        now = time.monotonic()
        if now - self._gpu_cache[0] > 1.0:
            self._gpu_cache = (now, self.inventory.gpus())
        return self._gpu_cache[1]

    def _leases_changed(self) -> None:
        self.inventory.leases_changed(self.book.busy)
        self._gpu_cache = (0.0, [])
        held: dict[str, frozenset[int]] = {}
        for lease in self.book.leases.values():
            held[lease.holder] = held.get(lease.holder, frozenset()) | frozenset(lease.gpus)
        self.device_gate.follow(held)

    def node_info(self) -> dict:
        return {
            "node": self.config.node_name,
            "url": self.config.advertise_url,
            "roles": list(self.config.roles),
            "gpu_backend": self.inventory.backend,
            "gpu_count": self.book.gpu_count,
            "gpus": [g.to_dict() for g in self.gpus()],
            "pending": self.book.pending,
            "committed": self.book.committed,
            "lingering": len(self.book.lingering),
            "leases": [lease.to_dict() for lease in self.book.leases.values()],
            "units": len(self.units),
            "version": gpuhub.__version__,
            "release": releases.release_name(),
        }

    # --- units ---------------------------------------------------------------
    def unit_view(self, u: UnitRecord, state: str | None = None, pid: int | None = None, restarts: int = 0) -> dict:
        d = asdict(u)
        d.pop("lease_token_sha256")
        d["node"] = self.config.node_name
        if state is not None:
            d["state"] = state
            d["main_pid"] = pid
            d["restarts"] = restarts
        return d

    def kernel_command(self, conn_path: Path) -> list[str]:
        python = sys.executable if self.config.unit_backend == "process" else f"{self.config.venv}/bin/python"
        return [python, "-m", "gpuhub.kernel", "-f", str(conn_path)]

    def pinned(self, argv: list[str], env: dict) -> tuple[list[str], dict]:
        """A unit outlives upgrades: it runs from the release the venv symlink names now, not from the
        symlink, or it would import code of a later release lazily (gpuhub/platform/releases.py)."""
        return releases.pin(argv, env, self.config.venv)

    def server_tls_files(self) -> dict[str, str]:
        """The certificate and key users' servers on this host serve https with (read at each start,
        so a renewed pair needs no restart), as unit files; empty when none is configured."""
        cert_path, key_path = self.config.server_tls_cert_file, self.config.server_tls_key_file
        if not cert_path:
            return {}
        try:
            return {SERVER_TLS_CERT: Path(cert_path).read_text(), SERVER_TLS_KEY: Path(key_path).read_text()}
        except OSError as exc:
            raise UnitError(f"cannot read the servers' TLS certificate or key: {exc}") from None

    def local_agent_url(self) -> str:
        """Where this server's units reach the agent."""
        return local_api_url(self.config)

    @contextlib.asynccontextmanager
    async def _unit_turn(self, name: str):
        """Starts and stops of one unit name take turns: a stop still running when a start of the
        same name comes (a restarted kernel) must not remove the new unit's journal. The entry
        counts holders and waiters, and goes with the last of them."""
        entry = self._unit_locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._unit_locks[name]

    async def start_unit(self, name: str, kind: str, user: str, gpus: int, env: dict, cwd: str,
                         argv: list[str] | None, key: str = "", kernel_id: str = "", replica_id: int = 0,
                         incarnation: str = "") -> dict:
        if not UNIT_NAME.match(name) or not name.startswith(f"gpuhub-{kind}-"):
            raise UnitError(f"unit name must look like gpuhub-{kind}-<id> (lowercase), not {name!r}")
        if replica_id < 0:
            raise UnitError(f"replica_id must not be negative, not {replica_id}")
        if gpus < 0 or gpus > self.book.gpu_count:
            raise LeaseError(f"unit asks for {gpus} GPU(s) per cell but this node has {self.book.gpu_count}")
        async with self._unit_turn(name):
            return await self._start_unit(name, kind, user, gpus, env, cwd, argv, key, kernel_id,
                                          replica_id, incarnation)

    async def _start_unit(self, name: str, kind: str, user: str, gpus: int, env: dict, cwd: str,
                          argv: list[str] | None, key: str, kernel_id: str, replica_id: int,
                          incarnation: str) -> dict:
        previous = self.units.get(name)
        if previous is not None:
            st = await self.runner.status(name)
            same = previous.incarnation == incarnation
            if st.active and same:
                self._check_same_unit(previous, kind, user, gpus, key)
                return self.unit_view(previous, st.state, st.main_pid)  # idempotent start
            await self.runner.stop(name)
            self._forget(name)
            if not same:
                # The scheduler created the kernel anew under its id (a restart) while this replica
                # of the earlier one was left here (its server did not answer the delete): the new
                # kernel starts empty, not from the earlier one's log.
                self.journals.remove(name)
                log.warning("unit %s belonged to an earlier kernel under this id; stopped it and dropped its "
                            "journal", name)
        elif kind == "kernel":
            self.journals.remove(name)  # no unit of ours owns a journal left under this name
        limits = self.config.limits
        record = UnitRecord(name=name, kind=kind, user=user, gpus=gpus, kernel_id=kernel_id, created_at=time.time(),
                            incarnation=incarnation)
        files = {}
        env = dict(env)
        journal: Path | None = None
        if kind == "kernel":
            if not key:
                raise UnitError("a kernel unit needs the kernel's connection key")
            token = secrets.token_urlsafe(32)
            record.lease_token_sha256 = sha256(token)
            record.key_sha256 = sha256(key)
            record.replica_id = replica_id
            taken = ports_taken(u.connection for u in self.units.values())
            conn = kernel_connection(self.config.kernel_ip, self.config.kernel_ports, taken)
            record.connection = conn
            # the key pair makes every socket of the replica CurveZMQ (gpuhub/platform/curve.py)
            files[CONNECTION_FILE] = json.dumps(with_keys(conn, key))
            udir = self.runner.unit_dir(name)
            journal = self.journals.dir(name)
            env.update(
                GPUHUB_AGENT_URL=self.local_agent_url(),
                GPUHUB_LEASE_TOKEN=token,
                GPUHUB_KERNEL_GPUS=str(gpus),
                GPUHUB_KERNEL_ID=kernel_id,
                GPUHUB_KERNEL_INCARNATION=incarnation,  # read back if the state file is lost (adopt_unit)
                GPUHUB_NODE=self.config.node_name,
                GPUHUB_NOTEBOOK_DIR=cwd,
                GPUHUB_REPLICA_ID=str(replica_id),
                GPUHUB_PEERS_FILE=str(udir / PEERS_FILE),
                GPUHUB_JOURNAL_DIR=str(journal),
                GPUHUB_RAFT_ADDR=raft_addr(conn),
                GPUHUB_BLOB_ADDR=blob_addr(conn),
            )
            env.setdefault("GPUHUB_GPU_LINGER_S", f"{self.config.gpu_linger_s:g}")
            argv = self.kernel_command(udir / CONNECTION_FILE)
            memory, cpu = limits.get("kernel_memory_max", ""), limits.get("kernel_cpu_quota", "")
        else:
            if not argv or not all(isinstance(a, str) for a in argv):
                raise UnitError("a server unit needs 'argv', a list of strings")
            memory, cpu = limits.get("server_memory_max", ""), limits.get("server_cpu_quota", "")
            tls = self.server_tls_files()
            if tls:
                # The server serves https with this host's servers' certificate (jupyterhub-singleuser
                # reads these variables), so the proxy's traffic to it, users' cookies and notebooks,
                # crosses the cluster network encrypted. No client certificate asked for.
                files.update(tls)
                udir = self.runner.unit_dir(name)
                env.pop("JUPYTERHUB_SSL_CLIENT_CA", None)
                env.update(JUPYTERHUB_SSL_CERTFILE=str(udir / SERVER_TLS_CERT),
                           JUPYTERHUB_SSL_KEYFILE=str(udir / SERVER_TLS_KEY))
                record.tls = True
        if kind == "server" or not gpus:
            # GPUs come with a grant only (a GPU cell's child sets its own): CUDA shows a CPU kernel,
            # a user's server and the local kernels it starts no device at all.
            env["CUDA_VISIBLE_DEVICES"] = ""
        argv, env = self.pinned(argv, env)
        spec = UnitSpec(name=name, kind=kind, user=user, argv=argv, env=env, cwd=cwd,
                        memory_max=memory, cpu_quota=cpu, files=files, devices=self.device_gate.at_start(kind))
        fresh_journal = journal is not None and not journal.exists()
        try:
            if journal is not None:
                # Kept if it exists: this replica started again under its name (its unit had
                # stopped) catches up from it.
                self.runner.user_dir(journal, user, traverse=self.journals.parents)
            st = await self.runner.start(spec)
        except BaseException:
            if fresh_journal:
                self.journals.remove(name)
            raise
        self.units[name] = record
        self.device_gate.started(name, kind)
        if kind == "kernel":
            self.book.place(name, gpus)
        self.save()
        log.info("started %s unit %s for %s (%d GPU(s) per cell)", kind, name, user, gpus)
        return self.unit_view(record, st.state, st.main_pid)

    @staticmethod
    def _check_same_unit(running: UnitRecord, kind: str, user: str, gpus: int, key: str) -> None:
        """A start of a running unit is answered with it only if it asks for that very unit: another
        user (or another key) naming it must not get its connection, or think it started its own."""
        if (running.kind, running.user, running.gpus) != (kind, user, gpus) or (
                running.key_sha256 and not hmac.compare_digest(running.key_sha256, sha256(key))):
            raise UnitConflict(f"unit {running.name} runs already, started for another user or with other settings")

    async def stop_unit(self, name: str) -> bool:
        if not UNIT_NAME.match(name):
            return False  # nothing of ours has that name; never touch paths built from it
        async with self._unit_turn(name):
            return await self._stop_unit(name)

    async def _stop_unit(self, name: str) -> bool:
        known = name in self.units
        await self.runner.stop(name)
        self.journals.remove(name)
        if known:
            self._forget(name)
            self.save()
            log.info("stopped unit %s", name)
        return known

    def write_peers(self, name: str, replicas: list[dict]) -> Path:
        """Write the kernel's replica list (validated by the API) into the unit's peers.json.

        Called once all replicas are started, and again whenever a replica is replaced.
        """
        u = self.units.get(name)
        if u is None:
            raise KeyError(name)
        if u.kind != "kernel":
            raise UnitError(f"{name} is a {u.kind} unit; peers are for kernel units")
        mine = next((r for r in replicas if r["id"] == u.replica_id), None)
        if mine is None:
            raise UnitError(f"{name} is replica {u.replica_id}; the replicas list must include it "
                            f"(it has ids {sorted(r['id'] for r in replicas)})")
        for what, own in (("raft", raft_addr(u.connection)), ("blob", blob_addr(u.connection))):
            if own is not None and mine[what] != own:
                raise UnitError(f"replica {u.replica_id}'s {what} address is {own} on this node, not {mine[what]}")
        udir = self.runner.unit_dir(name)
        if not udir.is_dir():
            raise UnitError(f"{name} has no unit directory on this node (it is not running)")
        path = udir / PEERS_FILE
        doc = {"kernel_id": u.kernel_id, "replicas": sorted(replicas, key=lambda r: r["id"])}
        self.runner.write_user_file(path, json.dumps(doc, indent=1) + "\n", u.user, 0o600)
        log.info("peers of %s: %s", name, ", ".join(f"{r['id']}@{r.get('node') or r['raft']}" for r in doc["replicas"]))
        return path

    def _forget(self, name: str) -> None:
        self.device_gate.forget(name)
        self.units.pop(name, None)
        self.fenced.pop(name, None)
        self._main_pids.pop(name, None)
        self.book.unplace(name)
        gone = self.book.release_holder(name)
        for lease in gone:
            self.lingering.forget(lease.lease_id)  # its processes stop with the unit
        self._ended(gone)
        self._leases_changed()

    async def unit_status(self, name: str, with_error: bool = False) -> dict | None:
        """The unit's record and state; ``with_error``: for a unit that is not running, ``error`` is
        the end of its log (why it exited, e.g. an ImportError), or None while it runs."""
        u = self.units.get(name)
        if u is None:
            return None
        st = await self.runner.status(name)
        view = self.unit_view(u, st.state, st.main_pid, st.restarts)
        if with_error:
            view["error"] = None if st.active else await self.unit_error(name)
        return view

    async def unit_error(self, name: str) -> str | None:
        """The last lines of a unit's log, bounded (ERROR_LINES, ERROR_CHARS), with the unit's
        secrets (its lease token, the kernel key) blanked out: the log is the user's, the API
        client may be a scheduler that shows it to the user, and neither needs a secret."""
        text = (await self.runner.log_tail(name, ERROR_LINES)).strip()
        if not text:
            return None
        for secret in self._unit_secrets(name):
            text = text.replace(secret, "[secret]")
        if len(text) > ERROR_CHARS:
            text = "…" + text[-(ERROR_CHARS - 1):]
        return text

    def kernel_key(self, name: str) -> str | None:
        """The connection key of kernel unit ``name`` (from its connection.json), for a scheduler that
        lost its books: without it a replica of the kernel can never be replaced. None: no such kernel."""
        unit = self.units.get(name)
        if unit is None or unit.kind != "kernel":
            return None
        try:
            key = json.loads((self.runner.unit_dir(name) / CONNECTION_FILE).read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            return None
        return key if isinstance(key, str) and key else None

    def _unit_secrets(self, name: str) -> list[str]:
        found = [v for k, v in self.runner.read_env(name).items() if SECRET_NAME.search(k)]
        try:
            conn = json.loads((self.runner.unit_dir(name) / CONNECTION_FILE).read_text())
            found.append(str(conn.get("key", "")))
        except (OSError, ValueError, AttributeError):
            pass
        return [s for s in found if len(s) >= 8]

    # --- leases --------------------------------------------------------------
    def unit_for_lease_token(self, token: str | None) -> UnitRecord | None:
        if not token:
            return None
        digest = sha256(token)
        for u in self.units.values():
            if u.lease_token_sha256 and secrets.compare_digest(u.lease_token_sha256, digest):
                return u
        return None

    def grant(self, unit: UnitRecord, gpus: int, holder_pid: int | None) -> Lease | None:
        """GPUs for one cell of ``unit`` now, or None when they are not free. QuotaRefused when the
        grant would take the unit's user past a limit (gpuhub/agent/quota_gate.py)."""
        if gpus > unit.gpus:
            raise LeaseError(f"{unit.name} was placed with {unit.gpus} GPU(s) per cell; it asked for {gpus}")
        if self.fenced.get(unit.name, 0.0) > time.monotonic():  # moving away: the replica replacing it runs the cell
            self.counters["refused"] += 1
            return None
        # One lease per unit. A replica runs one cell at a time and gives its lease back before it
        # asks again, so a lease it still holds is stale (its release was lost) and is replaced,
        # never added to: user code can read the unit's lease token, and must not collect GPUs
        # beyond the kernel's placement with it.
        for old in [le for le in self.book.leases.values() if le.holder == unit.name]:
            if old.lingering_pid is not None:
                self._take_back_soon([old])  # released once its process has exited
                continue
            self._ended([self.book.release(old.lease_id)])
            self.counters["released"] += 1
            log.warning("%s asked for a lease while holding %s; that one is released", unit.name, old.lease_id)
        self._check_quota(unit, gpus)
        lease = self.book.grant(gpus, unit.name, time.time(), holder_pid=holder_pid, user=unit.user,
                                kernel_id=unit.kernel_id)
        self.counters["granted" if lease else "refused"] += 1
        if lease:
            self._leases_changed()
            self.save()
        return lease

    async def grant_opened(self, unit: UnitRecord, gpus: int, holder_pid: int | None,
                           reclaim: bool = True) -> Lease | None:
        """``grant``, answered once the unit may open the granted GPUs' device nodes: a cell must not
        start before. DeviceGateError when they cannot be opened to it (the grant is given back).
        ``reclaim``: GPUs that other kernels' lingering leases hold are taken back for it (their
        processes end first); an election's tentative asks go without, at first (the kernel)."""
        own = [le for le in self.book.leases.values() if le.holder == unit.name and le.lingering_pid is not None]
        if own:  # asked anew (an election): its warm process ends first
            await self._take_back(self._start_take_back(own), "released")
        if (reclaim and gpus <= unit.gpus and self.book.free < gpus
                and self.fenced.get(unit.name, 0.0) <= time.monotonic()):
            taken = self.book.reclaimable(gpus, ending=self.lingering.ending_ids())
            if taken:  # GPUs kept warm for other kernels' next cells: this cell needs them now
                self._check_quota(unit, gpus)  # a refused ask must not cost others their warm GPUs
                # released together once all have exited, and granted in the same step (no await
                # between): no other ask can take the GPUs freed for this one
                await self._take_back(self._start_take_back(taken), "reclaimed")
        lease = self.grant(unit, gpus, holder_pid)
        if lease is not None:
            try:
                await self.device_gate.ready(unit.name)
            except DeviceGateError:
                self.release(unit, lease.lease_id)
                raise
        return lease

    def _active_leases(self) -> list[Lease]:
        return [le for le in self.book.leases.values() if le.lingering_pid is None]

    def _check_quota(self, unit: UnitRecord, gpus: int) -> None:
        try:
            self.quota_gate.check(unit.user, unit.kernel_id, gpus, self._active_leases(), self.meter)
        except QuotaRefused as exc:
            self.quota_refusals[exc.limit] += 1
            log.info("%s: no lease for %s's cell: %s", unit.name, unit.user, exc)
            raise

    async def linger(self, unit: UnitRecord, lease_id: str, pid: int, waited_s: float | None = None) -> bool:
        """The cell under ``lease_id`` is over and its process ``pid`` keeps the GPUs warm for the
        unit's next cell, until another grant needs them (gpuhub/agent/lingering.py). False: no
        such lease of this unit. LingerRefused: the process cannot be held; the lease stays as it
        was (the kernel then ends the process and releases it)."""
        lease = self.book.leases.get(lease_id)
        if lease is None or lease.holder != unit.name:
            return False
        if self.config.gpu_linger_s <= 0:
            raise LingerRefused("GPUs do not linger between cells on this server (gpu_linger_s = 0)")
        uid = self._unit_uid(unit)
        try:  # the replica's pid as systemd said it last: asking costs a systemctl call per cell
            self.lingering.adopt(lease_id, pid, self._main_pids.get(unit.name), uid)
        except LingerRefused:
            status = await self.runner.status(unit.name)
            self._main_pids[unit.name] = status.main_pid if status.active else None
            self.lingering.adopt(lease_id, pid, self._main_pids[unit.name], uid)
        lease = self.book.leases.get(lease_id)
        if lease is None or lease.holder != unit.name:  # released meanwhile
            self.lingering.forget(lease_id)
            return False
        now = time.time()
        if lease.lingering_pid is None:
            self._ended([lease], now)  # GPU time is counted while cells run, not while it lingers
            if waited_s is not None:
                self.cell_gpu_wait.labels(self.config.node_name).observe(waited_s)
        self.book.linger(lease_id, pid, now)
        self._leases_changed()
        self.save()
        return True

    def resume(self, unit: UnitRecord, lease_id: str) -> Lease | None:
        """The unit's next cell runs under its lingering lease: active again. None: it was taken
        back (or its process is gone); the kernel then asks for a new grant. QuotaRefused as a
        grant would be (the lease is taken back)."""
        lease = self.book.leases.get(lease_id)
        if lease is None or lease.holder != unit.name or lease.lingering_pid is None:
            return None
        if self.lingering.ending(lease_id):
            return None  # being taken back: released once its process has exited
        if not self.lingering.alive(lease_id):  # its process died on its own: the GPUs are free
            self.lingering.forget(lease_id)
            self.book.release(lease_id)
        else:
            try:
                self._check_quota(unit, len(lease.gpus))
            except QuotaRefused:
                self._take_back_soon([lease])
                raise
            self.lingering.forget(lease_id)  # a cell runs in it again: the kernel ends it, never the agent
            self.book.resume(lease_id, time.time())
        self._leases_changed()
        self.save()
        return self.book.leases.get(lease_id)

    @staticmethod
    def _unit_uid(unit: UnitRecord) -> int:
        try:
            return pwd.getpwnam(unit.user).pw_uid
        except KeyError:
            raise LingerRefused(f"no user {unit.user!r} on this host") from None

    def _start_take_back(self, leases: list[Lease]) -> list[tuple[Lease, int | None, asyncio.Future]]:
        """Kill the processes of lingering leases now (from here on they are being ended: resume
        refuses them, expiry waits); ``_take_back`` finishes."""
        return [(lease, lease.lingering_pid, self.lingering.end(lease.lease_id)) for lease in leases]

    async def _take_back(self, ending: list[tuple[Lease, int | None, asyncio.Future]], counter: str) -> None:
        """Once every one of these processes has exited (the driver frees their GPU memory then:
        G1) or EXIT_WAIT_S passed, release their leases together, counted under ``counter``."""
        await asyncio.gather(*(asyncio.shield(exited) for _, _, exited in ending))
        changed = False
        for lease, pid, _ in ending:
            current = self.book.leases.get(lease.lease_id)
            if current is None or current.lingering_pid != pid:
                continue  # released meanwhile (another ask took it back too)
            self.book.release(lease.lease_id)
            self.counters[counter] += 1
            log.info("lingering lease %s of %s taken back (%s)", lease.lease_id, lease.holder, counter)
            changed = True
        if changed:
            self._leases_changed()
            self.save()

    def _take_back_soon(self, leases: list[Lease], counter: str = "released") -> None:
        """Take lingering leases back from a caller that cannot wait: their processes are killed
        now, the leases released once those have exited."""
        if not leases:
            return
        task = asyncio.get_running_loop().create_task(self._take_back(self._start_take_back(leases), counter))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def fence(self, name: str) -> tuple[list[str], bool] | None:
        """Grant no more GPUs to unit ``name``, which a migration or a drain is about to take out of
        its kernel's group, and tell a CPU kernel's replica so (gpuhub/platform/move_fence.py).
        Returns the leases it holds now and whether it says it runs a CPU cell (a replica that does
        either runs a cell, or may have been elected to run the waiting one, and must not be moved),
        or None when there is no such unit. A replica proposes to run a cell only once it holds a
        lease (a CPU kernel's: once it marked itself executing and found no fence), so a fenced
        replica that does neither can never become a cell's executor. The fence lapses after
        FENCE_S, should the scheduler that set it never come back to finish or call off the move.
        Raises FenceError when the fence file cannot be written (a full /run): a replica that never
        sees the fence could start a CPU cell, so the move must wait."""
        u = self.units.get(name)
        if u is None:
            return None
        self.fenced[name] = time.monotonic() + FENCE_S
        udir = self.runner.unit_dir(name)
        running_cpu_cell = False
        if u.kind == "kernel" and udir.is_dir():
            try:
                running_cpu_cell = move_fence.fence(
                    udir, FENCE_S, lambda path, text: self.runner.write_user_file(path, text, u.user))
            except (OSError, UnitError) as exc:
                log.warning("could not fence %s for its CPU cells: %s", name, exc)
                raise FenceError(f"could not write the fence of {name} for its CPU cells: {exc}") from None
        held = [le for le in self.book.leases.values() if le.holder == name]
        # no cell runs under a lingering lease: it must not hold the move up
        self._take_back_soon([le for le in held if le.lingering_pid is not None])
        return sorted(le.lease_id for le in held if le.lingering_pid is None), running_cpu_cell

    def unfence(self, name: str) -> None:
        """The move did not happen: ``name`` may take GPUs, and run CPU cells, again."""
        self.fenced.pop(name, None)
        self._drop_fence_file(name)

    def _drop_fence_file(self, name: str) -> None:
        if UNIT_NAME.match(name):
            with contextlib.suppress(OSError):
                (self.runner.unit_dir(name) / move_fence.FENCE_FILE).unlink()

    def release(self, unit: UnitRecord, lease_id: str, waited_s: float | None = None) -> bool:
        """Take a lease back. ``waited_s``: the kernel ran a cell under it, which had waited that
        long for its GPUs (a replica that lost the cell's election gives its grant back without)."""
        lease = self.book.leases.get(lease_id)
        if lease is None or lease.holder != unit.name:
            return False  # idempotent; and a unit can only release its own leases
        if lease.lingering_pid is not None and self.lingering.alive(lease_id):
            # the kernel ends its lingering process before it releases; one still running is ended
            # first, and its lease goes back once it has exited (G1)
            self._take_back_soon([lease])
            return True
        self.lingering.forget(lease_id)
        self._ended([self.book.release(lease_id)])
        self.counters["released"] += 1
        if waited_s is not None:
            self.cell_gpu_wait.labels(self.config.node_name).observe(waited_s)
        self._leases_changed()
        self.save()
        return True

    def _ended(self, leases: list[Lease], now: float | None = None) -> None:
        """Leases that ended: what they held counts towards their users' GPU-hours."""
        now = time.time() if now is None else now
        for lease in leases:
            if lease.lingering_pid is not None:
                continue  # counted when it began to linger
            self.meter.record(lease.user, len(lease.gpus), lease.granted_at, now)

    def heartbeat_body(self) -> dict:
        """What the agent tells the scheduler every few seconds: node_info, and the GPU-seconds of
        ended leases it has not acknowledged yet."""
        body = self.node_info()
        before = self.meter.inflight
        usage = self.meter.batch()
        if usage is not None:
            body["usage"] = usage
        if (usage is not None and usage is not before) or self.book.leases:
            # A new batch is on disk before the scheduler can count it (a crash must not count it
            # again under a new number); a running lease's time so far survives a crash.
            self.save()
        return body

    def heartbeat_answered(self, answer: object) -> None:
        """The scheduler's answer: which usage batch it has, and the quotas of this server's users."""
        if not isinstance(answer, dict):
            return
        if "usage_ack" in answer:
            self.meter.acked(answer["usage_ack"])
            self.save()
        elif "usage_error" in answer and self.meter.inflight is not None:
            # It can never be counted, and sending it again would stall every later batch.
            log.error("the scheduler refused this server's GPU usage batch %s (%s); it is dropped",
                      self.meter.inflight["seq"], answer["usage_error"])
            self.meter.acked(self.meter.inflight["seq"])
            self.save()
        if "quotas" in answer:
            before = self.quota_gate.view
            self.quota_gate.update(answer["quotas"], {u.user for u in self.units.values() if u.kind == "kernel"})
            if self.quota_gate.view != before:
                self.quota_view_changed()

    def quota_view_changed(self) -> None:
        self.quota_store.save(self.quota_gate.view)

    def gpu_uuids(self, lease: Lease) -> list[dict]:
        gpus = self.gpus()
        return [{"index": i, "uuid": gpus[i].uuid} for i in lease.gpus]

    async def expire_leases(self) -> list[Lease]:
        dead_units = set()
        for name in {lease.holder for lease in self.book.leases.values()}:
            st = await self.runner.status(name)
            if not st.active:
                dead_units.add(name)
        now = time.time()
        # The kernel ends a lingering lease after gpu_linger_s; one left longer (a kernel that lost
        # track of it) is taken back here.
        overdue = [le for le in self.book.leases.values() if le.lingering_pid is not None
                   and now - (le.lingering_since or now) > self.config.gpu_linger_s + LINGER_SLACK_S
                   and not self.lingering.ending(le.lease_id)]
        if overdue:
            self._take_back_soon(overdue, "expired")
        gone = self.book.expire(
            now, lambda lease: lease.holder not in dead_units and pid_alive(lease.holder_pid)
            and (lease.lingering_pid is None or self.lingering.alive(lease.lease_id)))
        for lease in gone:
            self.lingering.forget(lease.lease_id)
        if gone:
            self._ended(gone)
            self.counters["expired"] += len(gone)
            for lease in gone:
                log.warning("lease %s of %s expired (holder gone)", lease.lease_id, lease.holder)
            self._leases_changed()
            self.save()
        return gone
