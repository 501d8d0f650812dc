"""``gpuhub``: the admin CLI."""

from __future__ import annotations

import argparse
import json
import sys

from gpuhub.platform.config import ConfigError, load_settings, read_secret


def cmd_kernelspecs(args) -> int:
    from gpuhub.admin.kernelspecs import install, parse_profile

    try:
        profiles = [parse_profile(p) for p in args.profile]
    except ValueError as exc:
        print(f"gpuhub kernelspecs: {exc}", file=sys.stderr)
        return 2
    if not profiles:
        print("gpuhub kernelspecs: give at least one --profile NAME:GPUS", file=sys.stderr)
        return 2
    changes = install(args.prefix, profiles, args.replicas)
    for line in changes:
        print(line)
    if not changes:
        print("unchanged")
    return 0


def cmd_nodes(args) -> int:
    from gpuhub.platform.http_client import ApiClientError, call_json_sync
    from gpuhub.scheduler.config import SchedulerConfig

    try:
        config = load_settings(SchedulerConfig, args.config)
        token = read_secret(config.token_file, "scheduler")
    except ConfigError as exc:
        print(f"gpuhub nodes: {exc}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if config.listen_address in ("0.0.0.0", "::") else config.listen_address
    try:
        _, body = call_json_sync("GET", f"http://{host}:{config.port}/api/v1/nodes", token)
    except ApiClientError as exc:
        print(f"gpuhub nodes: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(f"{'NODE':<16} {'LIVE':<5} {'GPUS':>4} {'PENDING':>7} {'COMMITTED':>9} {'UNITS':>5}  BACKEND")
    for n in body["nodes"]:
        print(f"{n['node']:<16} {('yes' if n['live'] else 'NO'):<5} {n['gpu_count'] or 0:>4} {n['pending'] or 0:>7} "
              f"{n['committed'] or 0:>9} {n['units'] or 0:>5}  {n['gpu_backend']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:
        from gpuhub.sim.cli import main as sim_main

        return sim_main(argv[1:])
    parser = argparse.ArgumentParser(prog="gpuhub", description="gpuhub admin CLI")
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kernelspecs", help="manage gpuhub kernelspecs")
    ksub = k.add_subparsers(dest="action", required=True)
    ki = ksub.add_parser("install", help="write one kernelspec per profile (idempotent)")
    ki.add_argument("--prefix", required=True, help="environment prefix, e.g. /opt/gpuhub/venv")
    ki.add_argument("--profile", action="append", default=[], help="NAME:GPUS, repeatable")
    ki.add_argument("--replicas", type=int, default=3)
    ki.set_defaults(func=cmd_kernelspecs)
    n = sub.add_parser("nodes", help="list the nodes the scheduler knows")
    n.add_argument("--config", default="/etc/gpuhub/scheduler.toml")
    n.add_argument("--json", action="store_true")
    n.set_defaults(func=cmd_nodes)
    sub.add_parser("sim", help="trace-driven simulator (gpuhub sim --help)")
    lk = sub.add_parser("local-kernel", help="run a replicated kernel on this machine (fake GPUs, no systemd)")
    from gpuhub.dev import localkernel

    localkernel.add_arguments(lk)
    lk.set_defaults(func=localkernel.main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
