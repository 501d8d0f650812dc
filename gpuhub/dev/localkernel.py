"""``gpuhub local-kernel``: a whole replicated kernel on this machine, for trying gpuhub and tests.

It starts what a cluster would run, on 127.0.0.1 and without systemd: one agent per replica with
fake GPUs (each replica on its own "node"), a scheduler that places the kernel, the replicas as
processes, and the router in this process. Any Jupyter client can use the connection file. On
SIGTERM or SIGINT everything it started is stopped.
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
from gpuhub.server.router import KernelRouter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3, help="replicas of the kernel (default 3)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs each cell gets (0: a CPU kernel)")
    p.add_argument("--fake-gpus", type=int, default=2, help="fake GPUs per replica's node (default 2)")
    p.add_argument("--connection-file", required=True, help="where to write the kernel's connection file")
    p.add_argument("--workdir", help="keep daemons' configs and logs here (default: a temporary directory)")
    p.add_argument("--log-level", default="WARNING", help="the router's log level (default WARNING)")


def check(args: argparse.Namespace) -> str | None:
    if args.replicas < 1:
        return "--replicas must be at least 1"
    if args.gpus < 0 or args.fake_gpus < 0:
        return "--gpus and --fake-gpus cannot be negative"
    if args.gpus > args.fake_gpus:
        return f"each cell wants {args.gpus} GPU(s) but each node has only --fake-gpus {args.fake_gpus}"
    return None


async def serve(args: argparse.Namespace) -> int:
    problem = check(args)
    if problem:
        print(f"gpuhub local-kernel: {problem}", file=sys.stderr)
        return 2
    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpuhub-local-"))
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = DevCluster(tmp, nodes=args.replicas, gpus_per_node=args.fake_gpus)
    router = None
    kernel_id = uuid.uuid4().hex[:12]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"[gpuhub] starting {args.replicas} agent(s) and a scheduler in {tmp}…", file=sys.stderr)
        await asyncio.to_thread(cluster.start)
        key = secrets.token_hex(32)
        status, record = await asyncio.to_thread(cluster.scheduler_call, "POST", "/api/v1/kernels", {
            "kernel_id": kernel_id, "key": key, "gpus": args.gpus, "replicas": args.replicas,
            "cwd": str(Path.cwd())})
        if status != 201 and status != 200:
            print(f"gpuhub local-kernel: the scheduler refused the kernel: {record}", file=sys.stderr)
            return 1
        replicas = [{"id": r["id"], **r["connection"]} for r in record["replicas"]]
        router = KernelRouter(replicas, key.encode())
        conn = await router.start()
        write_connection_file(args.connection_file, ip=conn["ip"], key=key.encode(),
                              shell_port=conn["shell_port"], iopub_port=conn["iopub_port"],
                              stdin_port=conn["stdin_port"], control_port=conn["control_port"],
                              hb_port=conn["hb_port"], transport="tcp", signature_scheme=conn["signature_scheme"])
        pids = []
        for r in record["replicas"]:
            _, unit = await asyncio.to_thread(cluster.agent(r["node"]).call, "GET", f"/api/v1/units/{r['unit']}")
            pids.append({"id": r["id"], "node": r["node"], "pid": unit.get("main_pid")})
        conn_path = str(Path(args.connection_file).resolve())  # noqa: ASYNC240 - once, on a path just written
        print(json.dumps({"connection_file": conn_path, "kernel_id": kernel_id, "replicas": pids,
                          "workdir": str(tmp)}), flush=True)
        await stop.wait()
        return 0
    finally:
        if router is not None:
            await router.stop()
        await asyncio.to_thread(cluster.stop)
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
        print("[gpuhub] local kernel stopped", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))
