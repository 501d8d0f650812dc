"""The scheduler's HTTP API (see docs/interfaces.md)."""

from __future__ import annotations

import logging

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, ValidationInfo, field_validator
from tornado.web import Application

import gpuhub
from gpuhub.platform import releases
from gpuhub.platform.http_client import ApiClientError
from gpuhub.platform.http_server import (
    ApiError,
    JsonHandler,
    api_settings,
    bearer_token,
    opens_metrics,
    tokens_equal,
)
from gpuhub.platform.schema import Body, invalid
from gpuhub.scheduler.auth import HubUserResolver
from gpuhub.scheduler.metrics import scheduler_registry
from gpuhub.scheduler.migration import NoMigrationTarget
from gpuhub.scheduler.node_tokens import NodeTokens
from gpuhub.scheduler.placement import PlacementError
from gpuhub.scheduler.service import Scheduler

log = logging.getLogger(__name__)


class SchedulerHandler(JsonHandler):
    """``callers``: "admin" (the scheduler token: admins, agents without a token of their own),
    "metrics" (the metrics token: Prometheus), "node" (a server's own token,
    gpuhub/scheduler/node_tokens.py: that server is ``self.node``) and/or "user" (a JupyterHub token,
    whose user is ``self.user``)."""

    callers = ("admin",)
    #: A user's token must carry the hub's kernel scope (gpuhub/scheduler/auth.py) here.
    needs_kernel_scope = False

    def initialize(self, scheduler: Scheduler, token: str, users: HubUserResolver,
                   nodes: NodeTokens | None = None, metrics_token: str | None = None) -> None:
        self.scheduler = scheduler
        self.token = token
        self.users = users
        self.nodes = nodes
        self.metrics_token = metrics_token
        self.admin = False
        self.user: str | None = None
        self.node: str | None = None

    async def authenticate(self) -> None:
        token = bearer_token(self)
        self.admin = "admin" in self.callers and tokens_equal(token, self.token)
        if not self.admin and opens_metrics(self.callers, self.metrics_token, token):
            return
        if not self.admin and "node" in self.callers and self.nodes is not None:
            self.node = self.nodes.node_for(token)
            if self.node is not None:
                return
        if not self.admin and "user" in self.callers and token:
            try:
                hub_user = await self.users.user_for(token)
            except ApiClientError as exc:
                raise ApiError(503, f"cannot check the token with JupyterHub: {exc.message}") from None
            if hub_user is not None and self.needs_kernel_scope and not hub_user.may_run_kernels:
                raise ApiError(403, f"this token of {hub_user.name} lacks the JupyterHub scope "
                                    f"{self.users.kernel_scope}: only the tokens of the user's own servers "
                                    "may start and stop kernels")
            self.user = hub_user.name if hub_user else None
        if not self.admin and self.user is None:
            raise ApiError(401, "missing or invalid token")

    def is_admin(self) -> bool:
        return self.admin

    def require_node(self, node: object) -> None:
        """A server's token speaks for that server only: 403 when the request names another."""
        if self.node is not None and node != self.node:
            raise ApiError(403, f"the token of server {self.node} cannot speak for {node!r}")

    def require_user(self) -> str:
        """The caller's user name; 401 for the admin token, which is no user's."""
        if self.user is None:
            raise ApiError(401, "missing or invalid token: this needs a user's token")
        return self.user


class HeartbeatHandler(SchedulerHandler):
    callers = ("admin", "node")

    def post(self) -> None:
        body = self.json_body()
        self.require_node(body.get("node") if isinstance(body, dict) else None)
        try:
            answer = self.scheduler.heartbeat(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self.write_json(answer)


class NodesHandler(SchedulerHandler):
    def get(self) -> None:
        self.write_json({"nodes": self.scheduler.nodes_view(), "scheduler": {"version": gpuhub.__version__,
                                                                      "release": releases.release_name()}})


class DrainRequest(Body):
    """PUT /api/v1/nodes/<node>/drain."""

    drained: bool


class NodeDrainHandler(SchedulerHandler):
    def put(self, node: str) -> None:
        body = self.parse_body(DrainRequest)
        try:
            rec = self.scheduler.set_drained(node, body.drained)
        except KeyError:
            raise ApiError(404, f"no server named {node!r} has heartbeated to this scheduler") from None
        except ValueError as exc:
            raise ApiError(409, str(exc)) from None
        view = next(n for n in self.scheduler.nodes_view() if n["node"] == rec.name)
        self.write_json(view)


class KernelRequest(Body):
    """POST /api/v1/kernels. Fields in the order they are checked: the first problem is the 400."""

    gpus: int = 0
    replicas: int = Field(default=3, validate_default=True)  # so that _counts also sees a left-out one

    @field_validator("replicas")
    @classmethod
    def _counts(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("gpus", 0) < 0 or v < 1 or v > 7:  # no "gpus" in data: its own error comes first
            raise invalid("gpus must be >= 0 and replicas 1..7")
        return v

    kernel_id: str
    key: str
    cwd: str = ""


class KernelsHandler(SchedulerHandler):
    callers = ("admin", "user")
    needs_kernel_scope = True

    async def get(self) -> None:
        if self.is_admin():
            kernels = list(self.scheduler.kernels.values())
        else:
            user = self.require_user()
            kernels = [k for k in self.scheduler.kernels.values() if k.user == user]
        self.write_json({"kernels": [k.view() for k in kernels]})

    async def post(self) -> None:
        user = self.require_user()
        body = self.parse_body(KernelRequest)
        try:
            record = await self.scheduler.create_kernel(
                user=user,
                kernel_id=body.kernel_id,
                key=body.key,
                gpus=body.gpus,
                replicas=body.replicas,
                cwd=body.cwd,
            )
        except PermissionError as exc:
            raise ApiError(403, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except PlacementError as exc:
            raise ApiError(409, str(exc)) from None
        except ApiClientError as exc:
            raise ApiError(502, f"a node could not start the kernel: {exc.message}") from None
        self.write_json(record.view(), 201)


class KernelHandler(SchedulerHandler):
    callers = ("admin", "user")
    needs_kernel_scope = True

    async def owned(self, kernel_id: str):
        record = self.scheduler.kernels.get(kernel_id)
        if not self.is_admin():
            user = self.require_user()
            if record is not None and record.user != user:
                raise ApiError(404, f"no kernel {kernel_id}")
            self.scheduler.heard_from_owner(kernel_id)  # its server is alive
        if record is None:
            raise ApiError(404, f"no kernel {kernel_id}")
        return record

    async def get(self, kernel_id: str) -> None:
        await self.owned(kernel_id)
        self.write_json(await self.scheduler.kernel_status(kernel_id))

    async def delete(self, kernel_id: str) -> None:
        await self.owned(kernel_id)
        await self.scheduler.delete_kernel(kernel_id)
        self.write_json({"stopped": kernel_id})


class MigrateRequest(Body):
    """POST /api/v1/kernels/<kernel>/migrate: sent by the agent of one of the kernel's servers."""

    node: str


class KernelMigrateHandler(SchedulerHandler):
    callers = ("admin", "node")

    async def post(self, kernel_id: str) -> None:
        """A cell of the kernel waits for a GPU that none of its servers can grant: move a replica
        (202 and the target), or 409 and why not (the cell keeps waiting)."""
        body = self.parse_body(MigrateRequest)
        self.require_node(body.node)
        try:
            answer = await self.scheduler.migrate(kernel_id, body.node)
        except KeyError:
            raise ApiError(404, f"no kernel {kernel_id}") from None
        except PermissionError as exc:
            raise ApiError(403, str(exc)) from None
        except NoMigrationTarget as exc:
            raise ApiError(409, str(exc)) from None
        self.write_json(answer, 202)


class QuotasHandler(SchedulerHandler):
    callers = ("admin", "user")

    async def get(self) -> None:
        """Admins: every user's GPU-hours this week and limits; a user (their JupyterHub token): their own."""
        if self.is_admin():
            self.write_json({"users": self.scheduler.quota_statuses()})
            return
        user = self.require_user()
        self.write_json({"users": [self.scheduler.quota_status(user)]})


class QuotaHandler(SchedulerHandler):
    callers = ("admin", "user")

    async def get(self, user: str) -> None:
        if not self.is_admin() and self.require_user() != user:
            raise ApiError(403, "a user may see their own quota only")
        self.write_json(self.scheduler.quota_status(user))


# An admin's grant at once: more than a year of one GPU is a typo, not a grant.
MAX_EXTRA_GPU_HOURS = 10_000.0


class ExtraHoursRequest(Body):
    """POST /api/v1/quota/<user>/extra: GPU-hours added to the user's limits this week."""

    gpu_hours: float

    @field_validator("gpu_hours")
    @classmethod
    def _hours(cls, v: float) -> float:
        if not 0 < v <= MAX_EXTRA_GPU_HOURS:  # also NaN
            raise invalid(f"field 'gpu_hours' must be more than 0 and at most {MAX_EXTRA_GPU_HOURS:g}, not {v}")
        return v


class QuotaExtraHandler(SchedulerHandler):
    def post(self, user: str) -> None:
        body = self.parse_body(ExtraHoursRequest)
        self.write_json(self.scheduler.grant_extra_hours(user, body.gpu_hours))


class MetricsHandler(SchedulerHandler):
    callers = ("admin", "metrics")

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(scheduler_registry(self.scheduler)))


def make_app(scheduler: Scheduler, token: str, users: HubUserResolver,
             nodes: NodeTokens | None = None, metrics_token: str | None = None) -> Application:
    args = {"scheduler": scheduler, "token": token, "users": users, "nodes": nodes, "metrics_token": metrics_token}
    return Application([
        (r"/api/v1/nodes/heartbeat", HeartbeatHandler, args),
        (r"/api/v1/nodes", NodesHandler, args),
        (r"/api/v1/nodes/([A-Za-z0-9_.-]+)/drain", NodeDrainHandler, args),
        (r"/api/v1/kernels", KernelsHandler, args),
        (r"/api/v1/kernels/([a-z0-9-]+)", KernelHandler, args),
        (r"/api/v1/kernels/([a-z0-9-]+)/migrate", KernelMigrateHandler, args),
        (r"/api/v1/quota", QuotasHandler, args),
        (r"/api/v1/quota/([^/]{1,255})", QuotaHandler, args),
        (r"/api/v1/quota/([^/]{1,255})/extra", QuotaExtraHandler, args),
        (r"/metrics", MetricsHandler, args),
    ], **api_settings())
