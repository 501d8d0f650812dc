"""What ``gpuhub nodes|kernels|leases|version`` show: the scheduler's view of the cluster, read
through its admin API with the token the hub host keeps, as a table (``--json`` for scripts)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gpuhub
from gpuhub.platform import releases
from gpuhub.platform.config import ConfigError, load_settings, read_secret
from gpuhub.platform.http_client import ApiClientError, call_json_sync
from gpuhub.platform.tls import local_api_url

DEFAULT_CONFIG = "/etc/gpuhub/scheduler.toml"
CLIENT_CONFIG = "/etc/gpuhub/client.toml"  # every host's: where the scheduler is (roles/gpuhub)


class StatusError(Exception):
    """What went wrong, in words an admin can act on; exit status 2 (setup) or 1 (the call)."""

    def __init__(self, message: str, exit_status: int, http_status: int = 0) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        self.http_status = http_status  # the scheduler's answer, when it gave one


@dataclass(frozen=True)
class Scheduler:
    """The scheduler's admin API as the hub host's configuration names it."""

    url: str
    token: str
    token_file: str

    @classmethod
    def from_config(cls, path: str) -> Scheduler:
        from gpuhub.scheduler.config import SchedulerConfig

        try:
            config = load_settings(SchedulerConfig, path)
            token = read_secret(config.token_file, "scheduler")
        except ConfigError as exc:
            hint = " (run gpuhub as root on the hub host)" if "permission denied" in str(exc) else ""
            raise StatusError(f"{exc}{hint}", 2) from None
        return cls(local_api_url(config), token, config.token_file)

    def get(self, path: str) -> dict:
        return self.call("GET", path)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            _, body = call_json_sync(method, f"{self.url}{path}", self.token, body, timeout=20)
        except ApiClientError as exc:
            if exc.status == 0:
                raise StatusError(f"cannot reach the scheduler at {self.url} ({exc.message}); is it running? "
                                  "systemctl status gpuhub-scheduler", 1) from None
            if exc.status in (401, 403):
                raise StatusError(f"the scheduler at {self.url} refused the token in {self.token_file} "
                                  f"({exc.status} {exc.message}); is it the scheduler's own token?", 1) from None
            raise StatusError(f"the scheduler at {self.url} answered {exc.status}: {exc.message}", 1,
                              exc.status) from None
        return body


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns two spaces apart, the header in capitals."""
    cells = [[str(h).upper() for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def age(since: float | None, now: float) -> str:
    """How long ago, the way ``kubectl`` and ``systemctl`` say it: 45s, 12m, 3h, 2d."""
    if not since:
        return "-"
    s = max(0, int(now - since))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def nodes(sched: Scheduler, args=None) -> tuple[dict, str]:
    body = sched.get("/api/v1/nodes")
    now = time.time()
    rows = [(n["node"], n.get("state") or (("active" if n["live"] else "lost")
                                           + (", drained" if n.get("drained") else "")),
             f"{n.get('committed') or 0}/{n.get('gpu_count') or 0}", n.get("pending") or 0,
             n.get("kernel_replicas") or 0, f"{n.get('subscription_ratio') or 0:.2f}", n.get("units") or 0,
             n.get("gpu_backend"), n.get("version") or "?", age(n.get("last_seen"), now))
            for n in body["nodes"]]
    return body, table(("node", "state", "busy/gpus", "pending", "replicas", "ratio", "units", "backend", "version",
                        "seen"), rows)


def drain(sched: Scheduler, args) -> tuple[dict, str]:
    """``gpuhub node drain|undrain NODE``: the scheduler's flag; with --wait, until the server runs
    no kernel replica any more (each kernel's replica there is moved, one kernel at a time)."""
    drained = args.action == "drain"
    if not args.node:
        raise StatusError(f"{args.action} needs the server's name: gpuhub node {args.action} NODE", 2)
    try:
        view = sched.call("PUT", f"/api/v1/nodes/{args.node}/drain", {"drained": drained})
    except StatusError as exc:
        if exc.http_status == 404:
            raise StatusError(f"no server named {args.node!r}; gpuhub nodes lists them", 1) from None
        raise
    if drained and args.wait:
        deadline = time.monotonic() + args.timeout
        left, told_left, told_waits = view.get("kernel_replicas") or 0, None, set()
        while left:
            if left != told_left:
                print(f"{args.node}: {left} kernel replica(s) still to move", file=sys.stderr, flush=True)
                told_left = left
            for w in view.get("drain_waits") or ():  # the cells it waits for, each said once
                line = f"  waiting for kernel {w['kernel_id']} of {w['user']}: its replica here {w['why']}"
                if line not in told_waits:
                    print(line, file=sys.stderr, flush=True)
                    told_waits.add(line)
            if time.monotonic() > deadline:
                raise StatusError(f"{args.node} still runs {left} kernel replica(s) after {args.timeout:g} s; "
                                  f"the drain goes on (gpuhub kernels shows them, the scheduler's journal says "
                                  f"why; gpuhub node undrain {args.node} calls it off)", 1)
            time.sleep(2)
            view = next((n for n in sched.get("/api/v1/nodes")["nodes"] if n["node"] == args.node), view)
            left = view.get("kernel_replicas") or 0
    if not drained:
        text = f"{args.node}: back in service"
    elif view.get("kernel_replicas"):
        text = f"{args.node}: drained; {view['kernel_replicas']} kernel replica(s) are moving away (gpuhub nodes)"
    else:
        text = f"{args.node}: drained; no kernel replica runs there"
    return view, text


def kernels(sched: Scheduler, args=None) -> tuple[dict, str]:
    body = sched.get("/api/v1/kernels")
    user = getattr(args, "user", None)
    if user:
        body = {"kernels": [k for k in body["kernels"] if k["user"] == user]}
    now = time.time()
    rows = [(k["kernel_id"], k["user"], k["gpus"],
             ", ".join(f"{r['node']}({r.get('state', '?')}{restarted(r)})" for r in k["replicas"]),
             age(k.get("created_at"), now))
            for k in sorted(body["kernels"], key=lambda k: (k["user"], k.get("created_at", 0)))]
    return body, table(("kernel", "user", "gpus", "replicas", "age"), rows)


def restarted(replica: dict) -> str:
    """", restarted N×" for a replica whose unit failed and systemd started again."""
    n = replica.get("restarts") or 0
    return f", restarted {n}×" if isinstance(n, int) and n > 0 else ""


def leases(sched: Scheduler, args=None) -> tuple[dict, str]:
    """Every GPU lease the agents reported in their last heartbeat: who holds which GPU now, and
    whether a cell runs under it or it lingers (kept warm for the kernel's next cell)."""
    listing = sched.get("/api/v1/nodes")
    now = time.time()
    found = [{"node": n["node"], **lease} for n in listing["nodes"] for lease in n.get("leases") or []]
    rows = [(x["node"], x["lease_id"], x["holder"], ",".join(str(g) for g in x["gpus"]) or "-",
             x.get("holder_pid") or "-", age(x.get("granted_at"), now),
             f"lingering {age(x['lingering_since'], now)}" if x.get("lingering_pid") else "cell")
            for x in sorted(found, key=lambda x: (x["node"], x.get("granted_at", 0)))]
    return {"leases": found}, table(("node", "lease", "holder", "gpus", "pid", "held", "state"), rows)


def versions(sched: Scheduler, args=None) -> tuple[dict, str]:
    """This CLI's version, the scheduler's, and every node's (from its last heartbeat), each with the
    release (the installed bundle: docs/upgrades.md) it runs from."""
    listing = sched.get("/api/v1/nodes")
    scheduler = listing.get("scheduler") or {}
    body = {"cli": gpuhub.__version__, "scheduler": scheduler.get("version"),
            "nodes": {n["node"]: n.get("version") for n in listing["nodes"]},
            "releases": {"cli": releases.release_name(), "scheduler": scheduler.get("release"),
                         "nodes": {n["node"]: n.get("release") for n in listing["nodes"]}}}
    rel = body["releases"]
    rows = [("this CLI", body["cli"], rel["cli"] or "-"),
            ("scheduler", body["scheduler"] or "?", rel["scheduler"] or "-")]
    rows += [(name, v or "?", rel["nodes"].get(name) or "-") for name, v in sorted(body["nodes"].items())]
    return body, table(("component", "version", "release"), rows)


def _hours(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def _used_hours(v: float) -> str:
    """Two decimals, or two significant digits below 0.01 (a 0.001-hour limit shows what counts)."""
    return f"{v:.2g}" if 0 < v < 0.01 else f"{v:.2f}"


AGENT_CONFIG = "/etc/gpuhub/agent.toml"  # every host's agent: its min_uid says who may run units


def _check_grantee(sched: Scheduler, user: str) -> None:
    """A grant to a mistyped or system name would be accepted and help nobody: the user must be one
    the scheduler knows (limits, use or kernels) or one this host's agent would run a kernel for."""
    import pwd

    from gpuhub.agent.config import AgentConfig
    from gpuhub.platform.accounts import AccountError, notebook_account

    if any(st["user"] == user for st in sched.get("/api/v1/quota")["users"]):
        return
    try:
        min_uid = load_settings(AgentConfig, AGENT_CONFIG).min_uid
    except (OSError, ConfigError):
        min_uid = AgentConfig.min_uid.default_value
    try:
        notebook_account(user, min_uid)  # the agent's own rule: no system account, no nobody
    except AccountError as exc:
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise StatusError(f"no user {user!r}: not a login account on this host, and the scheduler has no "
                              "limit, GPU use or kernel of theirs; check the name (--force grants anyway)", 2) from None
        raise StatusError(f"{user!r} is a system account, not a notebook user ({exc}; --force grants anyway)",
                          2) from None


def quota(sched: Scheduler, args) -> tuple[dict, str]:
    """``gpuhub quota [--user U]``: GPU-hours used this week and GPUs held, against each limit;
    ``gpuhub quota grant USER HOURS``: extra GPU-hours for USER this week (docs/quotas.md)."""
    from urllib.parse import quote

    if args.action == "grant":
        if not args.target or args.hours is None:
            raise StatusError("usage: gpuhub quota grant USER HOURS", 2)
        if not args.force:
            _check_grantee(sched, args.target)
        st = sched.call("POST", f"/api/v1/quota/{quote(args.target, safe='')}/extra", {"gpu_hours": args.hours})
        body = {"users": [st]}
    elif args.user:
        body = {"users": [sched.get(f"/api/v1/quota/{quote(args.user, safe='')}")]}
    else:
        body = sched.get("/api/v1/quota")
    rows = []
    for st in body["users"]:
        own = next((lim for lim in st["limits"] if lim["kind"] == "user"), None) or {}
        groups = ", ".join(f"{lim['name'].removeprefix('group ')} ({lim['gpu_hours_used']:.1f}/"
                           f"{_hours(lim['gpu_hours'])} h, {lim['gpus_held']}/{_hours(lim['gpus'])} GPUs)"
                           for lim in st["limits"] if lim["kind"] == "group")
        rows.append((st["user"], _used_hours(st["gpu_hours_used"]), _hours(own.get("gpu_hours")),
                     _hours(st.get("extra_gpu_hours") or None), st["gpus_held"], _hours(own.get("gpus")),
                     groups or "-"))
    week = body["users"][0]["week"] if body["users"] else ""
    text = table(("user", "gpu-hours", "limit", "extra", "gpus", "at once", "groups"), rows)
    if week:
        text += f"\n(the week of {week}; it resets Monday 00:00 UTC)"
    if args.action == "grant":
        text = f"{args.target}: {args.hours:g} extra GPU-hour(s) this week\n" + text
    return body, text


def user_scheduler() -> Scheduler | None:
    """In a user's JupyterLab terminal: the scheduler named in /etc/gpuhub/client.toml, with the
    server's JupyterHub token (the scheduler shows that user their own quota only)."""
    import os
    import tomllib

    token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
    url = os.environ.get("GPUHUB_SCHEDULER_URL", "")
    if not url:
        try:
            with open(CLIENT_CONFIG, "rb") as f:  # as the provisioner reads it
                url = tomllib.load(f).get("scheduler_url", "")
        except (OSError, ValueError):
            return None
    return Scheduler(url.rstrip("/"), token, "$JUPYTERHUB_API_TOKEN") if token and url else None


def run(name: str, args, view: Callable[..., tuple[dict, str]], users_too: bool = False) -> int:
    """One ``gpuhub`` status command: the table, or the JSON with ``--json``; errors on stderr.
    ``users_too``: a user without the admin token gets their own view with their JupyterHub token."""
    try:
        try:
            sched = Scheduler.from_config(args.config)
        except StatusError:
            sched = user_scheduler() if users_too else None
            if sched is None:
                raise
        body, text = view(sched, args)
    except StatusError as exc:
        print(f"gpuhub {name}: {exc}", file=sys.stderr)
        return exc.exit_status
    print(json.dumps(body, indent=2) if args.json else text)
    return 0
