"""``gpuhub-agent``: the daemon on every GPU node and notebook host."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from tornado.httpserver import HTTPServer

from gpuhub.agent.api import make_app
from gpuhub.agent.config import AgentConfig
from gpuhub.agent.service import Agent
from gpuhub.platform.config import ConfigError, load_settings, read_secret
from gpuhub.platform.http_client import ApiClientError, call_json

log = logging.getLogger("gpuhub.agent")


async def heartbeat_loop(agent: Agent, token: str) -> None:
    url = agent.config.scheduler_url.rstrip("/") + "/api/v1/nodes/heartbeat"
    failing = False
    while True:
        try:
            await call_json("POST", url, token, agent.node_info(), timeout=5)
            if failing:
                log.info("scheduler reachable again")
            failing = False
        except ApiClientError as exc:
            if not failing:
                log.warning("heartbeat to scheduler failed: %s", exc)
            failing = True
        await asyncio.sleep(agent.config.heartbeat_interval_s)


async def expiry_loop(agent: Agent) -> None:
    while True:
        await asyncio.sleep(agent.config.lease_check_interval_s)
        try:
            await agent.expire_leases()
        except Exception:  # keep the loop alive; the next round retries
            log.exception("lease expiry check failed")


async def serve(agent: Agent, token: str, scheduler_token: str | None) -> None:
    await agent.recover()
    server = HTTPServer(make_app(agent, token), xheaders=False)
    server.listen(agent.config.port, address=agent.config.listen_address)
    log.info(
        "gpuhub-agent %s listening on %s:%d (%d GPU(s), backend %s, units via %s)",
        agent.config.node_name, agent.config.listen_address, agent.config.port,
        agent.book.gpu_count, agent.inventory.backend, agent.runner.backend,
    )
    tasks = [asyncio.create_task(expiry_loop(agent))]
    if agent.config.scheduler_url and scheduler_token:
        tasks.append(asyncio.create_task(heartbeat_loop(agent, scheduler_token)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Units keep running: restarting the agent must never stop a kernel (DESIGN D5).
    log.info("gpuhub-agent stopping; units keep running")
    server.stop()
    for t in tasks:
        t.cancel()
    agent.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuhub-agent", description=__doc__)
    parser.add_argument("--config", default="/etc/gpuhub/agent.toml")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_settings(AgentConfig, args.config)
        token = read_secret(config.token_file, "agent")
        scheduler_token = read_secret(config.scheduler_token_file, "scheduler") if config.scheduler_url else None
        agent = Agent(config)
    except ConfigError as exc:
        print(f"gpuhub-agent: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(agent, token, scheduler_token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
