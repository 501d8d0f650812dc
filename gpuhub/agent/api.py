"""The agent's HTTP API (see docs/interfaces.md): units for the scheduler and hub, leases for kernels."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado.web import Application

from gpuhub.agent.leases import LeaseError
from gpuhub.agent.metrics import agent_registry
from gpuhub.agent.service import Agent
from gpuhub.agent.units import UnitError
from gpuhub.platform.http_server import ApiError, JsonHandler, bearer_token, field, tokens_equal


class AgentHandler(JsonHandler):
    def initialize(self, agent: Agent, token: str) -> None:
        self.agent = agent
        self.token = token

    def require_admin(self) -> None:
        """Scheduler, hub and Prometheus hold the agent token."""
        if not tokens_equal(bearer_token(self), self.token):
            raise ApiError(401, "missing or invalid token")

    def require_unit(self):
        """Kernels hold a per-unit lease token that allows leases for that unit only."""
        unit = self.agent.unit_for_lease_token(bearer_token(self))
        if unit is None:
            raise ApiError(401, "missing or invalid lease token")
        return unit


class NodeHandler(AgentHandler):
    def get(self) -> None:
        self.require_admin()
        self.write_json(self.agent.node_info())


class UnitsHandler(AgentHandler):
    async def get(self) -> None:
        self.require_admin()
        units = [await self.agent.unit_status(n) for n in list(self.agent.units)]
        self.write_json({"units": [u for u in units if u]})

    async def post(self) -> None:
        self.require_admin()
        body = self.json_body()
        kind = field(body, "kind", str)
        if kind not in ("kernel", "server"):
            raise ApiError(400, "field 'kind' must be 'kernel' or 'server'")
        env = field(body, "env", dict, required=False, default={})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ApiError(400, "field 'env' must map strings to strings")
        kernel = field(body, "kernel", dict, required=False, default={})
        replica_id = kernel.get("replica_id", 0)
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise ApiError(400, "field 'kernel.replica_id' must be an integer >= 0")
        try:
            unit = await self.agent.start_unit(
                name=field(body, "name", str),
                kind=kind,
                user=field(body, "user", str),
                gpus=field(body, "gpus", int, required=False, default=0),
                env=env,
                cwd=field(body, "cwd", str, required=False, default=""),
                argv=field(body, "argv", list, required=False, default=None),
                key=str(kernel.get("key", "")),
                kernel_id=str(kernel.get("kernel_id", "")),
                replica_id=replica_id,
            )
        except (UnitError, LeaseError) as exc:
            raise ApiError(400, str(exc)) from None
        self.write_json(unit, 201)


class UnitHandler(AgentHandler):
    async def get(self, name: str) -> None:
        self.require_admin()
        unit = await self.agent.unit_status(name)
        if unit is None:
            raise ApiError(404, f"no unit {name}")
        self.write_json(unit)

    async def delete(self, name: str) -> None:
        self.require_admin()
        known = await self.agent.stop_unit(name)
        self.write_json({"stopped": name, "was_known": known})


def is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return (bool(sep and host and port.isdigit()) and 0 < int(port) < 65536
            and not any(c.isspace() or c in "/@" for c in host))


def parse_peers(body: dict) -> list[dict]:
    """The body of PUT /api/v1/units/{name}/peers: ``{"replicas": [{"id", "node", "raft", "blob",
    "connection"}, …]}``, every replica of the kernel (this one included); 400 naming what is wrong."""
    replicas = field(body, "replicas", list)
    if not replicas:
        raise ApiError(400, "field 'replicas' must list at least one replica")
    out, seen = [], set()
    for i, r in enumerate(replicas):
        where = f"replicas[{i}]"
        if not isinstance(r, dict):
            raise ApiError(400, f"{where} must be an object")
        try:
            rid = field(r, "id", int)
            entry = {"id": rid, "node": field(r, "node", str, required=False, default=""),
                     "raft": field(r, "raft", str), "blob": field(r, "blob", str)}
            conn = field(r, "connection", dict, required=False, default=None)
        except ApiError as exc:
            raise ApiError(400, f"{where}: {exc.message}") from None
        if rid < 0:
            raise ApiError(400, f"{where}: field 'id' must be >= 0, not {rid}")
        if rid in seen:
            raise ApiError(400, f"{where}: replica id {rid} appears twice")
        seen.add(rid)
        for name in ("raft", "blob"):
            if not is_host_port(entry[name]):
                raise ApiError(400, f"{where}: field {name!r} must be \"host:port\", not {entry[name]!r}")
        if conn is not None:
            entry["connection"] = conn
        out.append(entry)
    return out


class PeersHandler(AgentHandler):
    def put(self, name: str) -> None:
        """The scheduler tells a kernel replica where its peers are (all replicas, itself included)."""
        self.require_admin()
        if name not in self.agent.units:
            raise ApiError(404, f"no unit {name}")
        replicas = parse_peers(self.json_body())
        try:
            path = self.agent.write_peers(name, replicas)
        except KeyError:
            raise ApiError(404, f"no unit {name}") from None
        except UnitError as exc:
            raise ApiError(400, str(exc)) from None
        self.write_json({"unit": name, "peers_file": str(path), "replicas": [r["id"] for r in replicas]})


class LeasesHandler(AgentHandler):
    def post(self) -> None:
        unit = self.require_unit()
        body = self.json_body()
        gpus = field(body, "gpus", int)
        pid = field(body, "holder_pid", int, required=False, default=None)
        if gpus < 0:
            raise ApiError(400, "field 'gpus' must not be negative")
        try:
            lease = self.agent.grant(unit, gpus, pid)
        except LeaseError as exc:
            raise ApiError(400, str(exc)) from None
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


class LeaseHandler(AgentHandler):
    def delete(self, lease_id: str) -> None:
        unit = self.require_unit()
        released = self.agent.release(unit, lease_id)
        self.write_json({"lease_id": lease_id, "released": released})


class MetricsHandler(AgentHandler):
    def initialize(self, agent: Agent, token: str) -> None:
        super().initialize(agent, token)
        self.registry = agent_registry(agent)

    def get(self) -> None:
        self.require_admin()
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.registry))


def make_app(agent: Agent, token: str) -> Application:
    args = {"agent": agent, "token": token}
    return Application(
        [
            (r"/api/v1/node", NodeHandler, args),
            (r"/api/v1/units", UnitsHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)", UnitHandler, args),
            (r"/api/v1/units/([A-Za-z0-9_.@-]+)/peers", PeersHandler, args),
            (r"/api/v1/leases", LeasesHandler, args),
            (r"/api/v1/leases/([A-Za-z0-9]+)", LeaseHandler, args),
            (r"/metrics", MetricsHandler, args),
        ],
        log_function=_log_request,
    )


def _log_request(handler) -> None:
    # Paths only: bodies and headers (tokens, keys) never reach the log.
    import logging

    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING
    if handler.request.path == "/metrics" and status == 200:
        level = logging.DEBUG
    logging.getLogger("gpuhub.agent.access").log(
        level, "%d %s %s %.1fms", status, handler.request.method, handler.request.path,
        1000 * handler.request.request_time(),
    )
