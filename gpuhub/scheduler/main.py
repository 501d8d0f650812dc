"""``gpuhub-scheduler``: places kernel replicas on GPU nodes (runs on the hub host)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from tornado.httpserver import HTTPServer

from gpuhub.platform.config import ConfigError, load_settings, read_secret
from gpuhub.scheduler.api import make_app
from gpuhub.scheduler.auth import HubUserResolver
from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.service import Scheduler

log = logging.getLogger("gpuhub.scheduler")


async def _step(name: str, step) -> None:
    try:
        await step()
    except Exception:  # noqa: BLE001 - one failed round must not stop the loop
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


async def serve(scheduler: Scheduler, token: str) -> None:
    scheduler.load()
    users = HubUserResolver(scheduler.config.hub_api_url, scheduler.config.static_user_tokens)
    server = HTTPServer(make_app(scheduler, token, users))
    server.listen(scheduler.config.port, address=scheduler.config.listen_address)
    log.info("gpuhub-scheduler listening on %s:%d (%d kernel(s) in the books)",
             scheduler.config.listen_address, scheduler.config.port, len(scheduler.kernels))
    task = asyncio.create_task(maintenance_loop(scheduler))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gpuhub-scheduler stopping; kernels keep running")
    server.stop()
    task.cancel()
    scheduler.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuhub-scheduler", description=__doc__)
    parser.add_argument("--config", default="/etc/gpuhub/scheduler.toml")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_settings(SchedulerConfig, args.config)
        token = read_secret(config.token_file, "scheduler")
        agent_token = read_secret(config.agent_token_file, "agent")
    except ConfigError as exc:
        print(f"gpuhub-scheduler: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(Scheduler(config, agent_token), token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
