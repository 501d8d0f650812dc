"""``gpuhub local-kernel``: a whole replicated kernel on this machine, for trying gpuhub and tests.

It starts what a cluster would run, on 127.0.0.1 and without systemd: one agent per replica with
fake GPUs (each replica on its own "node"), a scheduler that places the kernel, the replicas as
processes, and the router in this process. Any Jupyter client can use the connection file.

It prints its ready line (JSON on stdout: the connection file, the replicas' pids) only once the
kernel has answered a real ``kernel_info_request`` through the router. If a replica exits before
that, or the kernel does not answer within ``--start-timeout``, it prints the replicas' errors (the
end of each one's log, which the agent keeps), stops everything and exits 1. On SIGTERM, SIGINT or
SIGHUP everything it started is stopped; the daemons run in sessions of their own, so a Ctrl-C in
the terminal reaches only this process, which stops the replicas through their agents first.
When the client shuts the kernel down (``exit`` in ``jupyter console``), local-kernel ends too, once
no majority of the replicas runs (the rule a Jupyter server's provisioner follows). It removes the
connection file it wrote whichever way it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from jupyter_client.connect import write_connection_file

from gpuhub.dev.cluster import DevCluster
from gpuhub.platform.http_client import ApiClientError
from gpuhub.server.readiness import (
    KernelStartError,
    dead_replicas,
    majority_running,
    replica_errors,
    wait_until_answering,
)
from gpuhub.server.router import KernelRouter

PROGRESS_EVERY_S = 5.0
WATCH_EVERY_S = 1.0  # how often a ready kernel is looked up, to end with it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="replicas of the kernel (default 3)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs each cell gets (0: a CPU kernel)")
    p.add_argument("--fake-gpus", type=int, default=2, help="fake GPUs per replica's node (default 2)")
    p.add_argument("--connection-file", required=True, help="where to write the kernel's connection file")
    p.add_argument("--workdir", help="keep daemons' configs and logs here (default: a temporary directory)")
    p.add_argument("--log-level", default="WARNING", help="the router's log level (default WARNING)")
    p.add_argument("--start-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long the kernel may take to answer kernel_info before local-kernel gives up "
                        "(default 120)")


def check(args: argparse.Namespace) -> str | None:
    if args.replicas < 1:
        return "--replicas must be at least 1"
    if args.gpus < 0 or args.fake_gpus < 0:
        return "--gpus and --fake-gpus cannot be negative"
    if args.start_timeout <= 0:
        return "--start-timeout must be positive"
    if args.gpus > args.fake_gpus:
        return f"each cell wants {args.gpus} GPU(s) but each node has only --fake-gpus {args.fake_gpus}"
    return None


def say(text: str) -> None:
    print(f"[gpuhub] {text}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace) -> int:
    problem = check(args)
    if problem:
        print(f"gpuhub local-kernel: {problem}", file=sys.stderr)
        return 2
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpuhub-local-"))
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = DevCluster(tmp, nodes=args.replicas, gpus_per_node=args.fake_gpus)
    router = None
    written = ""  # the connection file, once written
    kernel_id = uuid.uuid4().hex[:12]
    stop = asyncio.Event()
    got: list[int] = []

    def on_signal(signum: int) -> None:
        if not got:
            say(f"{signal.Signals(signum).name}: stopping the kernel, its agents and the scheduler…")
        got.append(signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)

    def interrupted() -> int:
        say("interrupted before the kernel was ready")
        return 128 + got[0]

    try:
        say(f"starting {args.replicas} agent(s) and a scheduler in {tmp}…")
        # Each step is bounded (the harness's own deadlines); a signal is acted on between steps.
        await asyncio.to_thread(cluster.start)
        if stop.is_set():
            return interrupted()
        key = secrets.token_hex(32)
        status, record = await asyncio.to_thread(cluster.scheduler_call, "POST", "/api/v1/kernels", {
            "kernel_id": kernel_id, "key": key, "gpus": args.gpus, "replicas": args.replicas,
            "cwd": str(Path.cwd())})
        if status != 201 and status != 200:
            print(f"gpuhub local-kernel: the scheduler refused the kernel: {record}", file=sys.stderr)
            return 1
        if stop.is_set():
            return interrupted()
        replicas = [{"id": r["id"], **r["connection"]} for r in record["replicas"]]
        router = KernelRouter(replicas, key.encode())
        conn = await router.start()
        pids = []
        for r in record["replicas"]:
            _, unit = await asyncio.to_thread(cluster.agent(r["node"]).call, "GET", f"/api/v1/units/{r['unit']}")
            pids.append({"id": r["id"], "node": r["node"], "pid": unit.get("main_pid")})
        started = ", ".join(f"{p['id']}: pid {p['pid']}" for p in pids)
        say(f"replicas started ({started}); waiting for the kernel to answer…")
        waiting = asyncio.create_task(wait_answering(cluster, record, {**conn, "key": key.encode()},
                                                     args.start_timeout))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            return interrupted()
        stopping.cancel()
        try:
            waiting.result()
        except KernelStartError as exc:
            print(f"gpuhub local-kernel: the kernel did not start: {exc}", file=sys.stderr, flush=True)
            return 1
        write_connection_file(args.connection_file, ip=conn["ip"], key=key.encode(),
                              shell_port=conn["shell_port"], iopub_port=conn["iopub_port"],
                              stdin_port=conn["stdin_port"], control_port=conn["control_port"],
                              hb_port=conn["hb_port"], transport="tcp", signature_scheme=conn["signature_scheme"],
                              curve_publickey=conn["curve_publickey"].encode(),
                              curve_secretkey=conn["curve_secretkey"].encode())
        conn_path = written = str(Path(args.connection_file).resolve())  # noqa: ASYNC240 - once, on a path just written
        say(f"kernel ready: jupyter console --existing {conn_path}")
        print(json.dumps({"connection_file": conn_path, "kernel_id": kernel_id, "replicas": pids,
                          "agents": [a.proc.pid for a in cluster.agents], "scheduler": cluster.scheduler.proc.pid,
                          "workdir": str(tmp)}), flush=True)
        gone = asyncio.create_task(kernel_gone(cluster, kernel_id))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (gone, stopping):
            task.cancel()
        await asyncio.gather(gone, stopping, return_exceptions=True)
        if not stop.is_set():
            say("the kernel was shut down by its client: stopping its agents and the scheduler…")
        return 0
    finally:
        if written:  # as a kernel manager removes the file it wrote
            await asyncio.to_thread(Path(written).unlink, missing_ok=True)
        if router is not None:
            await router.stop()
        await asyncio.to_thread(cluster.stop)
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
        say("local kernel stopped")


async def kernel_gone(cluster: DevCluster, kernel_id: str) -> None:
    """Until the kernel has ended as a Jupyter server's provisioner sees it end: no majority of its
    replicas runs (its client shut it down), or the scheduler forgot it. Not until no replica runs:
    on a busy machine the first replica to exit was replaced before the others had, and the
    replacement ran on, waiting for a group that was gone."""
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        try:
            status, view = await asyncio.to_thread(cluster.scheduler_call, "GET", f"/api/v1/kernels/{kernel_id}",
                                                   timeout=10)
        except ApiClientError:
            continue  # a busy scheduler: asked again
        if status == 404 or (status == 200 and not majority_running(view["replicas"])):
            return


async def wait_answering(cluster: DevCluster, record: dict, connection: dict, timeout_s: float) -> None:
    """Until the kernel answers kernel_info through the router; raise KernelStartError with the
    replicas' errors if one of them exits first (a local kernel has no reason to lose one), or
    with the end of each replica's log if it does not answer in time."""
    kernel_id = record["kernel_id"]
    seen: dict[str, str] = {}
    last_progress = [0.0]

    async def failure() -> str | None:
        status, view = await asyncio.to_thread(cluster.scheduler_call, "GET", f"/api/v1/kernels/{kernel_id}",
                                               timeout=10)
        if status != 200:
            return f"the scheduler lost the kernel ({status}: {view})"
        seen.update({f"replica {r['id']}": r.get("state", "?") for r in view["replicas"]})
        dead = dead_replicas(view["replicas"])
        if dead:
            return f"{len(dead)} of {len(view['replicas'])} replicas exited:\n\n{replica_errors(view['replicas'])}"
        return None

    def progress(elapsed: float) -> None:
        if elapsed - last_progress[0] >= PROGRESS_EVERY_S:
            last_progress[0] = elapsed
            states = ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))
            say(f"still waiting for the kernel to answer ({elapsed:.0f} s of {timeout_s:g}; {states})")

    try:
        await wait_until_answering(connection, connection["key"], failure, timeout_s=timeout_s, progress=progress)
    except KernelStartError as exc:
        if not exc.timed_out:
            raise
        logs = "\n\n".join(f"replica {r['id']} on {r['node']} ({r['unit']}), the end of its log:\n"
                            f"{cluster.agent(r['node']).unit_log_tail(r['unit']) or '(empty)'}"
                            for r in record["replicas"])
        raise KernelStartError(f"{exc}\n\n{logs}", timed_out=True) from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))
