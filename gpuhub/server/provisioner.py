"""The kernel provisioner inside the user's Jupyter server: kernels are placed by the scheduler.

Selected per kernelspec (``metadata.kernel_provisioner.provisioner_name = "gpuhub-provisioner"``,
config ``{"gpus": N, "replicas": R}``). The scheduler places R replicas; this provisioner runs the
kernel's router (gpuhub/server/router.py, docs/architecture.md D3) inside the Jupyter server and hands the server
the router's connection info, so the server sees one ordinary kernel. A restart keeps the router
(and its ports) and swaps in fresh replicas.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import tomllib
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import KernelProvisionerBase
from tornado.web import HTTPError
from traitlets import Float, Integer, Unicode

from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.server.readiness import (
    KernelStartError,
    dead_replicas,
    majority_running,
    replica_errors,
    wait_until_answering,
)
from gpuhub.server.regroup import GroupFollower, routable
from gpuhub.server.router import KernelRouter

CLIENT_CONFIG = "/etc/gpuhub/client.toml"


class KernelLaunchFailed(HTTPError, RuntimeError):
    """A kernel could not be started, and why. Jupyter Server answers any other exception from a
    kernel start with a bare "Unhandled error"; an HTTPError's message reaches the user's
    kernel-start dialog. A RuntimeError too, for jupyter_client callers outside a server."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(status, message)

    # As given: tornado escapes "%" in a message without format args (a replica's log has them).
    @property
    def log_message(self) -> str:
        return self._log_message or ""

    def get_message(self) -> str:
        return self.log_message

    def __str__(self) -> str:
        return self.log_message

    def __repr__(self) -> str:
        return f"KernelLaunchFailed({self.log_message!r}, status={self.status_code})"

    def __reduce__(self):
        return type(self), (self.log_message, self.status_code)


class GpuhubProvisioner(KernelProvisionerBase):
    gpus = Integer(0, config=True, help="GPUs each cell of this kernel gets")
    replicas = Integer(3, config=True, help="Replicas of this kernel (on distinct nodes)")
    scheduler_url = Unicode(config=True, help="gpuhub-scheduler URL (default: /etc/gpuhub/client.toml)")
    poll_cache_s = Float(3.0, config=True, help="How long a poll answer is reused")
    start_timeout_s = Float(120.0, config=True,
                            help="How long a new kernel may take to answer kernel_info before its start fails")

    _record: dict | None = None
    _router: KernelRouter | None = None
    _follower: GroupFollower | None = None  # the router's, from its start on
    _client_conn: dict | None = None
    _last_poll: tuple[float, int | None] = (0.0, None)
    _deleted = False  # the scheduler was told to stop this kernel (kill, then cleanup, ask once)

    def _default_url(self) -> str:
        url = os.environ.get("GPUHUB_SCHEDULER_URL", "")
        if not url and os.path.exists(CLIENT_CONFIG):
            with open(CLIENT_CONFIG, "rb") as f:
                url = tomllib.load(f).get("scheduler_url", "")
        if not url:
            raise KernelLaunchFailed(f"gpuhub: no scheduler configured (set scheduler_url in {CLIENT_CONFIG})")
        return url.rstrip("/")

    @property
    def _url(self) -> str:
        return (self.scheduler_url or self._default_url()).rstrip("/")

    @property
    def _token(self) -> str:
        token = os.environ.get("GPUHUB_SCHEDULER_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN")
        if not token:
            raise KernelLaunchFailed("gpuhub: no token to talk to the scheduler (JUPYTERHUB_API_TOKEN unset)")
        return token

    @property
    def has_process(self) -> bool:
        return self._record is not None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        limit = os.environ.get("GPUHUB_MAX_GPUS")
        if limit is not None and self.gpus > int(limit):
            raise KernelLaunchFailed(
                f"this kernel needs {self.gpus} GPU(s) per cell but your server's profile allows {limit}; "
                "restart your server with a larger profile", status=400)
        kwargs = await super().pre_launch(**kwargs)
        kwargs.setdefault("cmd", self.kernel_spec.argv)
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        km = self.parent
        key = km.session.key.decode() if isinstance(km.session.key, bytes) else km.session.key
        cwd = kwargs.get("cwd") or os.getcwd()
        try:
            _, record = await call_json("POST", f"{self._url}/api/v1/kernels", self._token, {
                "kernel_id": self.kernel_id, "key": key, "gpus": self.gpus,
                "replicas": self.replicas, "cwd": str(cwd),
            }, timeout=60)
        except ApiClientError as exc:
            raise KernelLaunchFailed(f"gpuhub could not start the kernel: {exc.message}") from None
        self._record, self._deleted = record, False
        self._last_poll = (0.0, None)  # a restart must not reuse the dead kernel's answer
        replicas = [{"id": r.get("id", i), **r["connection"]} for i, r in enumerate(record["replicas"])]
        if self._router is None:
            self._router = KernelRouter(replicas, key.encode(), log=self.log, name=self.kernel_id)
            self._client_conn = await self._router.start()
            self._follower = GroupFollower(self._router, self._kernel_record)
        else:  # a restart: same router and ports, fresh replicas
            for r in replicas:
                self._router.replace_replica(r)
        conn = dict(self._client_conn)
        conn["key"] = key.encode()
        self.connection_info = conn
        self.log.info("gpuhub kernel %s on %s", self.kernel_id, ", ".join(r["node"] for r in record["replicas"]))
        try:
            await self._wait_answering(conn)
        except KernelStartError as exc:
            # jupyter_client does not clean up after a failed launch: stop what was started.
            await self.kill()
            await self.cleanup(restart=False)
            self.log.error("gpuhub kernel %s did not start: %s", self.kernel_id, exc)
            raise KernelLaunchFailed(f"gpuhub could not start the kernel: {exc}") from None
        return conn

    async def _wait_answering(self, conn: dict) -> None:
        """Return once the kernel answers kernel_info through its router. Raise KernelStartError, with
        the replicas' errors (their agents keep the end of each dead replica's log), once too few of
        its replicas run to make a majority, or when it does not answer within ``start_timeout_s``."""
        last: list[dict] = []

        async def failure() -> str | None:
            try:
                _, status = await call_json("GET", f"{self._url}/api/v1/kernels/{self.kernel_id}", self._token,
                                            timeout=10)
            except ApiClientError as exc:
                if exc.status == 404:
                    return "the scheduler stopped the kernel: none of its replicas was running"
                return None  # the scheduler unreachable for a moment: ask again at the next try
            replicas = status.get("replicas", [])
            last[:] = replicas
            dead = dead_replicas(replicas)
            if replicas and len(replicas) - len(dead) <= len(replicas) // 2:
                return (f"{len(dead)} of its {len(replicas)} replicas exited, so it cannot run:\n\n"
                        f"{replica_errors(replicas)}")
            return None

        try:
            await wait_until_answering(conn, conn["key"], failure, timeout_s=self.start_timeout_s)
        except KernelStartError as exc:
            if exc.timed_out and replica_errors(last):
                raise KernelStartError(f"{exc}; its replicas that exited:\n\n{replica_errors(last)}",
                                       timed_out=True) from None
            raise

    async def _kernel_record(self) -> dict:
        _, record = await call_json("GET", f"{self._url}/api/v1/kernels/{self.kernel_id}", self._token, timeout=10)
        return record

    async def poll(self) -> int | None:
        if self._record is None:
            return 0
        now = time.monotonic()
        if now - self._last_poll[0] < self.poll_cache_s:
            return self._last_poll[1]
        try:
            _, status = await call_json("GET", f"{self._url}/api/v1/kernels/{self.kernel_id}", self._token, timeout=10)
            result = None if majority_running(status["replicas"]) else 1
            if result is None and self._router is not None:
                # The scheduler may have replaced a replica whose node was lost: route to the new one.
                self._router.set_replicas(routable(status))
        except ApiClientError as exc:
            result = 1 if exc.status == 404 else None  # scheduler unreachable: assume alive, ask again later
        self._last_poll = (now, result)
        return result

    async def wait(self) -> int | None:
        while True:
            self._last_poll = (0.0, None)
            status = await self.poll()
            if status is not None:
                return status
            await asyncio.sleep(1.0)

    async def send_signal(self, signum: int) -> None:
        if signum in (signal.SIGKILL, signal.SIGTERM):
            await self.kill()
        # SIGINT: gpuhub kernelspecs use interrupt_mode "message" (interrupt_request on the control channel).

    async def kill(self, restart: bool = False) -> None:
        if self._record is None or self._deleted:
            return
        try:
            await call_json("DELETE", f"{self._url}/api/v1/kernels/{self.kernel_id}", self._token, timeout=30)
            self._deleted = True
        except ApiClientError as exc:
            self._deleted = exc.status == 404  # the scheduler had forgotten it already
            if not self._deleted:
                self.log.warning("gpuhub: stopping kernel %s failed: %s", self.kernel_id, exc)
        self._last_poll = (time.monotonic(), 0)

    async def terminate(self, restart: bool = False) -> None:
        await self.kill(restart)

    async def cleanup(self, restart: bool = False) -> None:
        # A kernel that exited when asked (shutdown_request) was never killed: tell the scheduler
        # it is over, or its units and journals stay on the GPU servers. On a restart too: the
        # kernel starts again under the same id, and the scheduler would answer that launch with
        # the record of the replicas that just exited.
        await self.kill()
        if not restart:
            self._record = None
            if self._router is not None:
                await self._follower.close()
                await self._router.stop()
                self._router = None

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info["gpuhub_record"] = self._record
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self._record = provisioner_info.get("gpuhub_record")
