"""The agent's HTTP API (see docs/interfaces.md): units for the scheduler and hub, leases for kernels."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, ValidationInfo, field_validator
from tornado.web import Application

from gpuhub.agent.device_gate import DeviceGateError
from gpuhub.agent.leases import LeaseError
from gpuhub.agent.lingering import LingerRefused
from gpuhub.agent.metrics import agent_registry
from gpuhub.agent.quota_gate import QuotaRefused
from gpuhub.agent.service import Agent, FenceError
from gpuhub.agent.units import UnitConflict, UnitError
from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.http_server import (
    ApiError,
    JsonHandler,
    api_settings,
    bearer_token,
    opens_metrics,
    token_matches,
)
from gpuhub.platform.schema import Body, invalid

INCARNATION = re.compile(r"[A-Za-z0-9_-]{0,64}")


class AgentHandler(JsonHandler):
    """``callers``: "admin" (this agent's token: the scheduler, the hub), "metrics" (the metrics
    token: Prometheus) or "unit" (a kernel's per-unit lease token, which allows leases for that unit
    only; the unit is ``self.unit``)."""

    callers = ("admin",)

    def initialize(self, agent: Agent, token: str, scheduler_token: str | None = None,
                   metrics_token: str | None = None) -> None:
        self.agent = agent
        self.token = token
        self.scheduler_token = scheduler_token
        self.metrics_token = metrics_token
        self.unit = None

    async def authenticate(self) -> None:
        token = bearer_token(self)
        if "unit" in self.callers:
            self.unit = self.agent.unit_for_lease_token(token)
            if self.unit is None:
                raise ApiError(401, "missing or invalid lease token")
        elif not (token_matches(token, self.token) or opens_metrics(self.callers, self.metrics_token, token)):
            raise ApiError(401, "missing or invalid token")


class NodeHandler(AgentHandler):
    def get(self) -> None:
        self.write_json(self.agent.node_info())


class KernelPart(Body):
    """``kernel`` of POST /api/v1/units; the scheduler sends strings, anything else is str()-ed."""

    key: Any = ""
    kernel_id: Any = ""
    replica_id: Any = 0
    incarnation: Any = ""

    @field_validator("replica_id")
    @classmethod
    def _replica_id(cls, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise invalid("field 'kernel.replica_id' must be an integer >= 0")
        return v

    @field_validator("incarnation")
    @classmethod
    def _incarnation(cls, v: Any) -> str:
        if not isinstance(v, str) or not INCARNATION.fullmatch(v):
            raise invalid("field 'kernel.incarnation' must be up to 64 letters, digits, '-' or '_'")
        return v


class UnitRequest(Body):
    """POST /api/v1/units. Fields in the order they are checked: the first problem is the 400."""

    kind: str
    env: dict = Field(default_factory=dict)
    kernel: KernelPart = Field(default_factory=KernelPart)
    name: str
    user: str
    gpus: int = 0
    cwd: str = ""
    argv: list = None  # servers only; start_unit checks it is a list of strings
    quotas: dict = None  # kernels: the user's limits from the scheduler (gpuhub/agent/quota_gate.py)

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in ("kernel", "server"):
            raise invalid("field 'kind' must be 'kernel' or 'server'")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict) -> dict:
        if not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            raise invalid("field 'env' must map strings to strings")
        return v


class UnitsHandler(AgentHandler):
    async def get(self) -> None:
        units = [await self.agent.unit_status(n) for n in list(self.agent.units)]
        self.write_json({"units": [u for u in units if u]})

    async def post(self) -> None:
        body = self.parse_body(UnitRequest)
        try:
            unit = await self.agent.start_unit(
                name=body.name,
                kind=body.kind,
                user=body.user,
                gpus=body.gpus,
                env=body.env,
                cwd=body.cwd,
                argv=body.argv,
                key=str(body.kernel.key),
                kernel_id=str(body.kernel.kernel_id),
                replica_id=body.kernel.replica_id,
                incarnation=body.kernel.incarnation,
            )
        except UnitConflict as exc:
            raise ApiError(409, str(exc)) from None
        except (UnitError, LeaseError) as exc:
            raise ApiError(400, str(exc)) from None
        if body.quotas is not None:
            self.agent.quota_gate.merge(body.quotas)
            self.agent.quota_view_changed()
        self.write_json(unit, 201)


class UnitHandler(AgentHandler):
    async def get(self, name: str) -> None:
        unit = await self.agent.unit_status(name, with_error=True)
        if unit is None:
            raise ApiError(404, f"no unit {name}")
        self.write_json(unit)

    async def delete(self, name: str) -> None:
        known = await self.agent.stop_unit(name)
        self.write_json({"stopped": name, "was_known": known})


class FenceHandler(AgentHandler):
    def post(self, name: str) -> None:
        """The scheduler is about to move this replica away (a migration, a drain): no new GPU
        leases for it, and no new CPU cell; the answer lists the leases it holds now and says
        whether it runs a CPU cell (either calls the move off)."""
        try:
            fence = self.agent.fence(name)
        except FenceError as exc:
            raise ApiError(503, str(exc)) from None
        if fence is None:
            raise ApiError(404, f"no unit {name}")
        held, executing = fence
        self.write_json({"unit": name, "fenced": True, "leases": held, "executing": executing})

    def delete(self, name: str) -> None:
        self.agent.unfence(name)
        self.write_json({"unit": name, "fenced": False})


class UnitKeyHandler(AgentHandler):
    def get(self, name: str) -> None:
        """A kernel unit's connection key: the scheduler rebuilds its books from the agents."""
        key = self.agent.kernel_key(name)
        if key is None:
            raise ApiError(404, f"no kernel unit {name} with a key")
        self.write_json({"unit": name, "key": key})


def is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return (bool(sep and host and port.isdigit()) and 0 < int(port) < 65536
            and not any(c.isspace() or c in "/@" for c in host))


class Peer(Body):
    """One replica in PUT /api/v1/units/{name}/peers."""

    id: int
    node: str = ""
    raft: str
    blob: str
    connection: dict = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: int) -> int:
        if v < 0:
            raise invalid(f"field 'id' must be >= 0, not {v}")
        return v

    @field_validator("raft", "blob")
    @classmethod
    def _addr(cls, v: str, info: ValidationInfo) -> str:
        if not is_host_port(v):
            raise invalid(f"field {info.field_name!r} must be \"host:port\", not {v!r}")
        return v

    def entry(self) -> dict:
        """As written to peers.json (no "connection" key when none was sent)."""
        entry = {"id": self.id, "node": self.node, "raft": self.raft, "blob": self.blob}
        if self.connection is not None:
            entry["connection"] = self.connection
        return entry


class PeersRequest(Body):
    """PUT /api/v1/units/{name}/peers: ``{"replicas": [{"id", "node", "raft", "blob", "connection"},
    …]}``, every replica of the kernel (this one included)."""

    replicas: list[Peer]

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v: list[Peer]) -> list[Peer]:
        if not v:
            raise invalid("field 'replicas' must list at least one replica")
        seen: set[int] = set()
        for i, r in enumerate(v):
            if r.id in seen:
                raise invalid(f"replicas[{i}]: replica id {r.id} appears twice")
            seen.add(r.id)
        return v


class PeersHandler(AgentHandler):
    def put(self, name: str) -> None:
        """The scheduler tells a kernel replica where its peers are (all replicas, itself included)."""
        if name not in self.agent.units:
            raise ApiError(404, f"no unit {name}")
        replicas = [r.entry() for r in self.parse_body(PeersRequest).replicas]
        try:
            path = self.agent.write_peers(name, replicas)
        except KeyError:
            raise ApiError(404, f"no unit {name}") from None
        except UnitError as exc:
            raise ApiError(400, str(exc)) from None
        self.write_json({"unit": name, "peers_file": str(path), "replicas": [r["id"] for r in replicas]})


class LeaseRequest(Body):
    """POST /api/v1/leases."""

    gpus: int
    holder_pid: int = None  # lets the agent see the holder die before its unit does
    reclaim: bool = True  # take back other kernels' lingering GPUs if those are what it takes

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: int) -> int:
        if v < 0:
            raise invalid("field 'gpus' must not be negative")
        return v


class LeasesHandler(AgentHandler):
    callers = ("unit",)

    async def post(self) -> None:
        unit = self.unit
        body = self.parse_body(LeaseRequest)
        gpus, pid = body.gpus, body.holder_pid
        try:
            lease = await self.agent.grant_opened(unit, gpus, pid, reclaim=body.reclaim)
        except LeaseError as exc:
            raise ApiError(400, str(exc)) from None
        except DeviceGateError as exc:
            raise ApiError(503, str(exc)) from None
        except QuotaRefused as exc:  # waiting will not help: the kernel ends the cell with this message
            self.write_json({"error": str(exc), "quota": exc.limit}, 403)
            return
        if lease is None:
            b = self.agent.book
            self.write_json(
                {"error": f"{gpus} GPU(s) not free on {self.agent.config.node_name} "
                          f"({b.committed} of {b.gpu_count} busy)", "free": b.free, "gpu_count": b.gpu_count},
                409,
            )
            return
        self.write_json({"lease_id": lease.lease_id, "node": self.agent.config.node_name,
                         "gpus": self.agent.gpu_uuids(lease)})


# A week: longer than any cell waits for a GPU (the kernel gives up long before).
MAX_WAITED_S = 7 * 86400.0


class LeaseHandler(AgentHandler):
    callers = ("unit",)

    def delete(self, lease_id: str) -> None:
        unit = self.unit
        waited_s = _waited_s(self.get_query_argument("waited_s", None))
        released = self.agent.release(unit, lease_id, waited_s)
        self.write_json({"lease_id": lease_id, "released": released})


def _waited_s(raw: object) -> float | None:
    if raw is None:
        return None
    try:
        waited_s = float(raw)
    except (TypeError, ValueError):
        waited_s = -1.0
    if not 0.0 <= waited_s <= MAX_WAITED_S:  # also NaN
        raise ApiError(400, f"waited_s must be seconds between 0 and {MAX_WAITED_S:g}, not {str(raw)[:40]!r}")
    return waited_s


class LingerRequest(Body):
    """POST /api/v1/leases/{id}/linger."""

    pid: int
    waited_s: float = None


class LingerHandler(AgentHandler):
    """The cell under the lease is over; its process keeps the GPUs warm for the next cell."""

    callers = ("unit",)

    async def post(self, lease_id: str) -> None:
        unit = self.unit
        body = self.parse_body(LingerRequest)
        waited_s = _waited_s(body.waited_s)
        try:
            lingering = await self.agent.linger(unit, lease_id, body.pid, waited_s)
        except LingerRefused as exc:
            raise ApiError(400, str(exc)) from None
        if not lingering:
            raise ApiError(404, f"{unit.name} holds no lease {lease_id}")
        self.write_json({"lease_id": lease_id, "lingering": True})


class ResumeHandler(AgentHandler):
    """The kernel's next cell runs under its lingering lease (409: it was taken back)."""

    callers = ("unit",)

    def post(self, lease_id: str) -> None:
        unit = self.unit
        try:
            lease = self.agent.resume(unit, lease_id)
        except QuotaRefused as exc:
            self.write_json({"error": str(exc), "quota": exc.limit}, 403)
            return
        if lease is None:
            self.write_json({"error": f"lease {lease_id} was taken back"}, 409)
            return
        self.write_json({"lease_id": lease.lease_id, "node": self.agent.config.node_name,
                         "gpus": self.agent.gpu_uuids(lease)})


class MigrationHandler(AgentHandler):
    callers = ("unit",)

    async def post(self) -> None:
        """A kernel's cell waits for GPUs none of its servers can grant: ask the scheduler, on its
        behalf, to move one of its replicas to a server that can (gpuhub/scheduler/migration.py).
        The kernel's lease token names the kernel; the scheduler's answer is passed on."""
        unit = self.unit
        if unit.kind != "kernel" or not unit.kernel_id:
            raise ApiError(400, f"unit {unit.name} is not a kernel replica")
        if not self.agent.config.scheduler_url or not self.scheduler_token:
            raise ApiError(409, f"server {self.agent.config.node_name} has no scheduler to ask")
        url = f"{self.agent.config.scheduler_url.rstrip('/')}/api/v1/kernels/{unit.kernel_id}/migrate"
        try:
            _, answer = await call_json("POST", url, self.scheduler_token,
                                        {"node": self.agent.config.node_name}, timeout=10)
        except ApiClientError as exc:
            if exc.status in (403, 404, 409):  # the scheduler's reason, for the notebook
                raise ApiError(409, exc.message) from None
            raise ApiError(502, f"cannot ask the scheduler: {exc.message}") from None
        self.write_json(answer, 202)


class QuotaViewHandler(AgentHandler):
    def get(self) -> None:
        """What this agent enforces: the scheduler's last quota view and its own unreported usage."""
        self.write_json({"view": self.agent.quota_gate.view, "unreported": self.agent.meter.to_dict(),
                         "refusals": self.agent.quota_refusals})


class MetricsHandler(AgentHandler):
    callers = ("admin", "metrics")

    def initialize(self, agent: Agent, token: str, scheduler_token: str | None = None,
                   metrics_token: str | None = None) -> None:
        super().initialize(agent, token, scheduler_token, metrics_token)
        self.registry = agent_registry(agent)

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.registry))


def make_app(agent: Agent, token: str, scheduler_token: str | None = None,
             metrics_token: str | None = None) -> Application:
    args = {"agent": agent, "token": token, "scheduler_token": scheduler_token, "metrics_token": metrics_token}
    return Application(
        [
            (r"/api/v1/node", NodeHandler, args),
            (r"/api/v1/units", UnitsHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)", UnitHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)/peers", PeersHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)/key", UnitKeyHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)/fence", FenceHandler, args),
            (r"/api/v1/leases", LeasesHandler, args),
            (r"/api/v1/leases/([A-Za-z0-9]+)", LeaseHandler, args),
            (r"/api/v1/leases/([A-Za-z0-9]+)/linger", LingerHandler, args),
            (r"/api/v1/leases/([A-Za-z0-9]+)/resume", ResumeHandler, args),
            (r"/api/v1/migrations", MigrationHandler, args),
            (r"/api/v1/quota", QuotaViewHandler, args),
            (r"/metrics", MetricsHandler, args),
        ],
        **api_settings(),
    )
