"""``gpuhub``: the admin CLI."""

from __future__ import annotations

import argparse
import os
import sys
import time


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
    changes = install(args.prefix, profiles, args.replicas, plain_python3=args.plain_python3)
    for line in changes:
        print(line)
    if not changes:
        print("unchanged")
    return 0


def cmd_releases(args) -> int:
    """The installed releases of this host (gpuhub/platform/releases.py); prune removes unused old ones."""
    import json
    from pathlib import Path

    from gpuhub.platform import releases

    root, venv = Path(args.root), Path(args.venv)
    if args.action == "prune":
        try:
            removed, busy = releases.prune(root, venv, args.keep)
        except (ValueError, OSError) as exc:
            print(f"gpuhub releases prune: {exc}", file=sys.stderr)
            return 2
        for r in removed:
            print(f"removed {r.name}")
        for r in busy:
            print(f"kept {r.name}: {len(r.pids)} process(es) still run from it (pids {', '.join(map(str, r.pids))})")
        if not removed:
            print("unchanged")
        return 0
    found = releases.list_releases(root, venv)
    if args.json:
        print(json.dumps({"releases": [r.to_dict() for r in found]}, indent=2))
        return 0
    if not found:
        print(f"no releases under {root}")
        return 0
    for r in found:
        mark = "*" if r.current else " "
        state = "" if r.complete else "  (unfinished)"
        print(f"{mark} {r.name}  {len(r.pids)} process(es){state}")
    return 0


def cmd_backup(args) -> int:
    from pathlib import Path

    from gpuhub.admin import backup

    try:
        if args.command == "backup":
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            out = Path(args.output or f"/var/backups/gpuhub/hub-{os.uname().nodename}-{stamp}.tar.gz")
            entries = backup.create(out)
            print(f"wrote {out} ({sum(not e.directory for e in entries)} files)")
        else:
            entries = backup.restore(Path(args.archive))
            for e in entries:
                if not e.directory:
                    print(f"restored /{e.path}")
    except backup.BackupError as exc:
        print(f"gpuhub {args.command}: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"gpuhub {args.command}: {exc} (run it as root)", file=sys.stderr)
        return 2
    return 0


def _status_commands(sub) -> None:
    """nodes, kernels, leases, version: the scheduler's view (gpuhub/admin/status.py)."""
    from gpuhub.admin import status

    def add(name: str, help: str, view, *extra_args):
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", default=status.DEFAULT_CONFIG,
                       help=f"the scheduler's settings: its address and token (default {status.DEFAULT_CONFIG})")
        p.add_argument("--json", action="store_true", help="print the scheduler's answer as JSON, for scripts")
        for flags, kw in extra_args:
            p.add_argument(*flags, **kw)
        p.set_defaults(func=lambda args: status.run(name, args, view))

    add("nodes", "the servers the scheduler knows: live, GPUs pending and committed, units, version",
        status.nodes)
    add("kernels", "every kernel and where its replicas run", status.kernels,
        (("--user",), {"help": "only this user's kernels"}))
    add("leases", "who holds which GPU now (the agents' last heartbeats)", status.leases)
    add("version", "the version of this CLI, the scheduler and every server", status.versions)
    q = sub.add_parser("quota", help="GPU-hours used this week and GPUs held, against each user's limits; "
                                     "'grant USER HOURS' adds extra GPU-hours this week")
    q.add_argument("action", nargs="?", choices=("show", "grant"), default="show")
    q.add_argument("target", nargs="?", help="grant: the user")
    q.add_argument("hours", nargs="?", type=float, help="grant: extra GPU-hours for this week")
    q.add_argument("--user", help="show: this user only")
    q.add_argument("--force", action="store_true",
                   help="grant: even to a user the scheduler does not know who has no login account on this host")
    q.add_argument("--config", default=status.DEFAULT_CONFIG,
                   help=f"the scheduler's settings: its address and token (default {status.DEFAULT_CONFIG}); "
                        "without them, a user's own quota with $JUPYTERHUB_API_TOKEN")
    q.add_argument("--json", action="store_true", help="print the scheduler's answer as JSON, for scripts")
    q.set_defaults(func=lambda args: status.run("quota", args, status.quota, users_too=True))
    node = sub.add_parser("node", help="take a server out of service for maintenance, or put it back")
    node.add_argument("action", choices=("list", "drain", "undrain"),
                      help="list: as `gpuhub nodes`; drain: no new kernels there, and its kernels' replicas move "
                           "to other servers (a running GPU cell finishes first)")
    node.add_argument("node", nargs="?", help="drain, undrain: the server's name, as gpuhub nodes shows it")
    node.add_argument("--wait", action="store_true", help="drain: wait until no kernel replica runs there")
    node.add_argument("--timeout", type=float, default=600, help="--wait: give up after this many seconds")
    node.add_argument("--config", default=status.DEFAULT_CONFIG,
                      help=f"the scheduler's settings: its address and token (default {status.DEFAULT_CONFIG})")
    node.add_argument("--json", action="store_true", help="print the server's entry as JSON, for scripts")
    node.set_defaults(func=lambda args: status.run("node " + args.action, args,
                                                   status.nodes if args.action == "list" else status.drain))


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
    ki.add_argument("--plain-python3", action="store_true",
                    help="also write the plain \"python3\" kernelspec (ipykernel without its debugger)")
    ki.set_defaults(func=cmd_kernelspecs)
    _status_commands(sub)
    bk = sub.add_parser("backup", help="the hub host's state (database, secrets, TLS, the scheduler's books) "
                                       "in one archive, readable by root only")
    bk.add_argument("--output", help="the archive to write (default /var/backups/gpuhub/hub-HOST-TIME.tar.gz)")
    bk.set_defaults(func=cmd_backup)
    rs = sub.add_parser("restore", help="put a backup's files back (stop jupyterhub and gpuhub-scheduler first)")
    rs.add_argument("archive")
    rs.set_defaults(func=cmd_backup)
    rel = sub.add_parser("releases", help="the gpuhub releases installed on this host (* = current)")
    rel.add_argument("action", nargs="?", choices=("list", "prune"), default="list")
    rel.add_argument("--root", default="/opt/gpuhub/venvs", help="where the releases are (default %(default)s)")
    rel.add_argument("--venv", default="/opt/gpuhub/venv", help="the symlink to the current one (default %(default)s)")
    rel.add_argument("--keep", type=int, default=2,
                     help="prune: how many complete releases to keep, the current one included (default %(default)s)")
    rel.add_argument("--json", action="store_true", help="list: JSON, for scripts")
    rel.set_defaults(func=cmd_releases)
    sub.add_parser("sim", help="trace-driven simulator (gpuhub sim --help)")
    lk = sub.add_parser("local-kernel", help="run a replicated kernel on this machine (fake GPUs, no systemd)")
    from gpuhub.dev import localkernel

    localkernel.add_arguments(lk)
    lk.set_defaults(func=localkernel.main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
