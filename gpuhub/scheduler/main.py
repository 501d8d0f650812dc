"""``gpuhub-scheduler``: places kernel replicas on GPU nodes (runs on the hub host)."""

from __future__ import annotations

import asyncio
import logging
import sys

from traitlets import Unicode

from gpuhub.platform.config import ConfigError
from gpuhub.platform.daemon import Daemon
from gpuhub.scheduler.api import make_app
from gpuhub.scheduler.auth import HubUserResolver
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.node_tokens import AgentTokens, NodeTokens
from gpuhub.scheduler.pool_loop import pool_loop
from gpuhub.scheduler.quotas import QuotaConfigError
from gpuhub.scheduler.service import Scheduler

log = logging.getLogger("gpuhub.scheduler")


async def _step(name: str, step) -> None:
    try:
        await step()
    except Exception:
        log.exception("%s failed", name)


async def maintenance_loop(scheduler: Scheduler, heal_every_s: float = 2.0, reconcile_every_s: float = 30.0) -> None:
    """Heal (replace replicas on lost nodes) often, reconcile the books with the agents now and then.

    One task runs both, one after the other, so a reconcile never sees a replacement unit that the
    books do not list yet. The first reconcile waits for the agents' first heartbeats.
    """
    loop = asyncio.get_running_loop()
    next_reconcile = loop.time() + min(10.0, scheduler.config.node_timeout_s)
    while True:
        await _step("heal", scheduler.heal)
        if loop.time() >= next_reconcile:
            await _step("reconcile", scheduler.reconcile)
            next_reconcile = loop.time() + reconcile_every_s
        await asyncio.sleep(heal_every_s)


class SchedulerDaemon(Daemon):
    name = "gpuhub-scheduler"
    description = __doc__
    settings_class = SchedulerConfig
    config_file = Unicode("/etc/gpuhub/scheduler.toml", config=True, help="The TOML config file.")
    quiet_paths = ("/metrics", "/api/v1/nodes/heartbeat")
    stop_message = "stopping; kernels keep running"

    def secret_files(self) -> dict[str, str]:
        files = {"scheduler": self.settings.token_file}
        if not self.settings.agent_token_dir:
            files["agent"] = self.settings.agent_token_file
        return files

    def init_service(self) -> None:
        agents = AgentTokens(self.secrets.get("agent", ""), self.settings.agent_token_dir)
        try:
            self.scheduler = Scheduler(self.settings, agents)
        except (QuotaConfigError, ValueError) as exc:  # quotas, pool settings: the message names the key
            raise ConfigError(f"{self.config_file}: {exc}") from None
        self.node_tokens = NodeTokens(self.settings.node_token_dir) if self.settings.node_token_dir else None

    async def prepare(self) -> None:
        self.scheduler.load()

    def make_web_app(self):
        users = HubUserResolver(self.settings.hub_api_url, self.settings.static_user_tokens,
                                kernel_scope=self.settings.hub_kernel_scope)
        return make_app(self.scheduler, self.secrets["scheduler"], users, self.node_tokens, self.secrets.get("metrics"))

    def listening_message(self) -> str:
        return (f"{super().listening_message()} "
                f"({len(self.scheduler.kernels)} kernel(s) in the books)")

    def background(self) -> list:
        loops = [maintenance_loop(self.scheduler)]
        if self.scheduler.pool is not None:
            loops.append(pool_loop(self.scheduler.pool))
        return loops

    def on_stop(self) -> None:
        self.scheduler.save()


def main(argv: list[str] | None = None) -> int:
    return SchedulerDaemon.main(argv)


if __name__ == "__main__":
    sys.exit(main())
