"""``gpuhub-agent``: the daemon on every GPU node and notebook host."""

from __future__ import annotations

import asyncio
import logging
import sys

from traitlets import Unicode

from gpuhub.agent.api import make_app
from gpuhub.agent.config import AgentConfig
from gpuhub.agent.service import Agent
from gpuhub.gpus.base import GpuConfigError
from gpuhub.platform.config import ConfigError
from gpuhub.platform.daemon import Daemon
from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.tls import cert_pair_context

log = logging.getLogger("gpuhub.agent")


async def heartbeat_loop(agent: Agent, token: str) -> None:
    url = agent.config.scheduler_url.rstrip("/") + "/api/v1/nodes/heartbeat"
    failing = False
    while True:
        try:
            _, answer = await call_json("POST", url, token, agent.heartbeat_body(), timeout=5)
            agent.heartbeat_answered(answer)
            if failing:
                log.info("scheduler reachable again")
            failing = False
        except ApiClientError as exc:
            if not failing:
                log.warning("heartbeat to scheduler failed: %s", exc)
            failing = True
        except Exception:  # e.g. the state file cannot be written: keep heartbeating all the same
            log.exception("heartbeat round failed")
        await asyncio.sleep(agent.config.heartbeat_interval_s)


async def expiry_loop(agent: Agent) -> None:
    while True:
        await asyncio.sleep(agent.config.lease_check_interval_s)
        try:
            await agent.expire_leases()
        except Exception:  # keep the loop alive; the next round retries
            log.exception("lease expiry check failed")


class AgentDaemon(Daemon):
    name = "gpuhub-agent"
    description = __doc__
    settings_class = AgentConfig
    config_file = Unicode("/etc/gpuhub/agent.toml", config=True, help="The TOML config file.")
    quiet_paths = ("/metrics",)
    # Units keep running: restarting the agent must never stop a kernel (docs/architecture.md D5).
    stop_message = "stopping; units keep running"

    def secret_files(self) -> dict[str, str]:
        files = {"agent": self.settings.token_file}
        if self.settings.scheduler_url:
            files["scheduler"] = self.settings.scheduler_token_file
        return files

    def init_service(self) -> None:
        # Checked now, not at a user's first server start.
        cert_pair_context(self.settings.server_tls_cert_file, self.settings.server_tls_key_file,
                          ("server_tls_cert_file", "server_tls_key_file"))
        try:
            self.agent = Agent(self.settings)
        except GpuConfigError as exc:  # the [gpus] table of the file
            raise ConfigError(f"{self.config_file}: {exc}") from None

    async def prepare(self) -> None:
        await self.agent.recover()

    def make_web_app(self):
        return make_app(self.agent, self.secrets["agent"], self.secrets.get("scheduler"), self.secrets.get("metrics"))

    def listening_message(self) -> str:
        a = self.agent
        return (f"{super().listening_message()} as node {a.config.node_name} "
                f"({a.book.gpu_count} GPU(s), backend {a.inventory.backend}, units via {a.runner.backend})")

    def background(self) -> list:
        tasks = [expiry_loop(self.agent)]
        if "scheduler" in self.secrets:
            tasks.append(heartbeat_loop(self.agent, self.secrets["scheduler"]))
        return tasks

    def on_stop(self) -> None:
        self.agent.save()


def main(argv: list[str] | None = None) -> int:
    return AgentDaemon.main(argv)


if __name__ == "__main__":
    sys.exit(main())
