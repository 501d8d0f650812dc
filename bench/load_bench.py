"""Twenty users at once on the podman test cluster: each logs in through the hub's form, starts a
server and a replicated one-GPU kernel, and runs 20 cells through Jupyter Server's REST and websocket
API as JupyterLab does, while the cluster has fewer GPUs than users, so cells wait for a GPU.

Checks, per cell: its output arrives exactly once (one ``execute_reply``, one line of stdout) and says
the cell ran exactly once in order (the counter it prints); a cell that fails says why. Per daemon:
no restart during the run (systemd's NRestarts and main pid) and its peak resident memory (VmHWM).
Times: login, server ready, kernel start, cell start delay (the cell prints ``time.time()`` when it
starts; the containers share this machine's clock) and round trip.

Run on a cluster deployed with the load users (`GPUHUB_LOAD_USERS=20 GPUHUB_GPU_NODES=4
scripts/cluster.sh up load && GPUHUB_LOAD_USERS=20 GPUHUB_GPU_NODES=4 scripts/cluster.sh deploy load`):
`GPUHUB_CLUSTER=load .venv/bin/python -m bench load`. GPUHUB_LOAD_CELLS sets the cells per user.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gpuhub.kernel.wait_notice import notice_text

CELLS = int(os.environ.get("GPUHUB_LOAD_CELLS", "20"))
WORK_S = 1.0  # what each cell does while it holds its GPU
THINK_S = (0.5, 2.5)  # the user's pause between a reply and the next cell
CELL_TIMEOUT_S = 900  # longer than the kernel's grant timeout (300 s): a cell past it must say why
CELL = ("import os, time\n_t0 = time.time()\nn += 1\ntime.sleep({work})\n"
        "print(n, repr(_t0), os.environ.get('CUDA_VISIBLE_DEVICES', '-'), flush=True)")
HUB_DAEMONS = ("jupyterhub", "configurable-http-proxy", "gpuhub-scheduler", "gpuhub-agent")
NODE_DAEMONS = ("gpuhub-agent",)


def progress(text: str) -> None:
    print(f"[load {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclass
class UserRun:
    name: str
    login_s: float = 0.0
    server_s: float = 0.0
    kernel_s: float = 0.0
    first_cell_s: float = 0.0
    starts: list[float] = field(default_factory=list)  # submit → the cell's first line
    round_trips: list[float] = field(default_factory=list)  # submit → execute_reply
    waited: int = 0  # cells that showed a status line (waiting for a GPU, moving …)
    failures: list[str] = field(default_factory=list)
    replies: Counter = field(default_factory=Counter)  # msg_id → execute_replies seen
    lines: dict = field(default_factory=dict)  # msg_id → stdout text seen
    sent: list[str] = field(default_factory=list)
    cells_from: float = 0.0  # time.time() of the first timed cell's submit and the last reply
    cells_to: float = 0.0


def run_cell(channel, run: UserRun, code: str) -> dict:
    """Send one cell and read the websocket until its reply and idle status, counting every reply
    and stdout of any cell (a late duplicate of an earlier one is counted where it belongs)."""
    submitted = time.time()
    msg_id = channel.send_execute(code)
    run.sent.append(msg_id)
    out: dict = {"reply": None, "stderr": "", "submitted": submitted}
    idle = False
    deadline = time.monotonic() + CELL_TIMEOUT_S
    while not (out["reply"] and idle):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no reply to a cell within {CELL_TIMEOUT_S} s")
        channel.ws.settimeout(left)
        msg = json.loads(channel.ws.recv())
        parent = msg.get("parent_header", {}).get("msg_id")
        kind, content = msg["header"]["msg_type"], msg.get("content", {})
        if kind == "execute_reply":
            run.replies[parent] += 1
        elif kind == "stream" and content.get("name") == "stdout":
            run.lines[parent] = run.lines.get(parent, "") + content.get("text", "")
        if parent != msg_id:
            continue
        if kind == "execute_reply":
            out["reply"], out["replied"] = content, time.time()
        elif kind == "stream" and content.get("name") == "stderr":
            out["stderr"] += content.get("text", "")
        elif notice_text(kind, content) is not None:  # waiting for a GPU, moving the kernel …
            out["waited"] = True
        elif kind == "error":
            out["stderr"] += "\n".join(content.get("traceback", []))
        elif kind == "status":
            idle = content.get("execution_state") == "idle"
    return out


def one_user(cluster, run: UserRun, ready: threading.Barrier, seed: int) -> None:
    from tests.cluster.test_e2e import HubUser

    user = HubUser(cluster, run.name)
    t = time.monotonic()
    user.login()
    run.login_s = time.monotonic() - t
    t = time.monotonic()
    user.start_server("gpu1")
    run.server_s = time.monotonic() - t
    t = time.monotonic()
    kid = user.start_kernel("gpuhub-gpu1")
    run.kernel_s = time.monotonic() - t
    channel = user.kernel(kid)
    try:
        t = time.monotonic()
        first = run_cell(channel, run, "n = 0")
        run.first_cell_s = time.monotonic() - t
        if first["reply"].get("status") != "ok":
            run.failures.append(f"first cell: {first['stderr'][-300:]}")
            return
        ready.wait(timeout=CELL_TIMEOUT_S)
        think = random.Random(seed)
        for i in range(1, CELLS + 1):
            out = run_cell(channel, run, CELL.format(work=WORK_S))
            msg_id = run.sent[-1]
            if out["reply"].get("status") != "ok":
                run.failures.append(f"cell {i}: {out['stderr'][-300:] or out['reply']}")
                continue
            fields = run.lines.get(msg_id, "").split()
            if len(fields) != 3 or fields[0] != str(i):
                run.failures.append(f"cell {i}: printed {run.lines.get(msg_id)!r}, expected one line starting {i}")
                continue
            run.cells_from = run.cells_from or out["submitted"]
            run.cells_to = out["replied"]
            run.starts.append(float(fields[1]) - out["submitted"])
            run.round_trips.append(out["replied"] - out["submitted"])
            run.waited += bool(out.get("waited"))
            time.sleep(think.uniform(*THINK_S))  # the user reads the output (load shape, not a wait)
    finally:
        channel.close()
        user.api("DELETE", f"/user/{run.name}/api/kernels/{kid}")
        user.stop_server()


def daemons(cluster) -> dict[tuple[str, str], dict]:
    """Each daemon's restart count, main pid, peak resident memory (MiB) and CPU seconds on each host."""
    hub = cluster.groups["hub"][0]
    found = {}
    for host in [hub, *cluster.groups["gpu_nodes"]]:
        for unit in HUB_DAEMONS if host == hub else NODE_DAEMONS:
            shown = dict(line.split("=", 1) for line in cluster.exec(
                host, "systemctl", "show", "-p", "NRestarts", "-p", "MainPID", unit).split())
            if shown.get("MainPID", "0") == "0":
                continue  # not on this host
            pid = shown["MainPID"]
            status = cluster.exec(host, "cat", f"/proc/{pid}/status", f"/proc/{pid}/stat", check=False)
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            # utime and stime, in clock ticks (100 a second on Linux), after the ")" that ends the name
            ticks = status.rsplit(")", 1)[-1].split()[11:13]
            found[(host, unit)] = {"restarts": int(shown["NRestarts"]), "pid": pid, "peak_mib": hwm / 1024,
                                   "cpu_s": sum(map(int, ticks)) / 100}
    return found


RSS_OF_USERS = ("import os, sys\nlo, hi = map(int, sys.argv[1:])\ntotal = 0\n"
                "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
                "    try:\n        lines = open(f'/proc/{pid}/status').read().splitlines()\n"
                "    except OSError:\n        continue\n"
                "    f = dict(line.split(':', 1) for line in lines if ':' in line)\n"
                "    if lo <= int(f['Uid'].split()[0]) <= hi and 'VmRSS' in f:\n"
                "        total += int(f['VmRSS'].split()[0])\nprint(total)")


def users_memory(cluster, uids: tuple[int, int]) -> dict[str, float]:
    """Resident memory (MiB) of the load users' processes on each host: their servers on the hub,
    their replicas on the GPU servers (the containers have no procps: /proc is read directly)."""
    found = {}
    for host in [*cluster.groups["hub"], *cluster.groups["gpu_nodes"]]:
        out = cluster.exec(host, "python3", "-c", RSS_OF_USERS, *map(str, uids))
        found[host] = int(out.strip() or 0) / 1024
    return found


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def spread(values: list[float], unit: str = "s") -> str:
    return (f"{pct(values, .5):.2f} / {pct(values, .95):.2f} / {pct(values, .99):.2f} / "
            f"{max(values, default=float('nan')):.2f} {unit}")


@dataclass
class Phase:
    runs: list[UserRun]
    errors: dict[str, str]
    wall_s: float
    peak_memory: dict[str, float]  # host → the load users' processes' resident MiB, sampled
    before: dict
    after: dict

    def all(self, attr: str) -> list[float]:
        values = [getattr(r, attr) for r in self.runs]
        return [x for v in values for x in v] if values and isinstance(values[0], list) else [v for v in values if v]

    @property
    def cells_span_s(self) -> float:  # first timed submit to last reply
        began = [r.cells_from for r in self.runs if r.cells_from]
        return max(r.cells_to for r in self.runs) - min(began) if began else 0.0


def load(cluster, names: list[str], uids: tuple[int, int]) -> Phase:
    """``names`` at once, each in its own thread, as in the module's docstring."""
    before = daemons(cluster)
    runs = [UserRun(n) for n in names]
    ready = threading.Barrier(len(runs))
    errors: dict[str, str] = {}
    peak_memory: dict[str, float] = {}

    def worker(i: int, run: UserRun) -> None:
        try:
            one_user(cluster, run, ready, seed=i)
        except BaseException as e:  # pytest.fail raises a BaseException: report it, go on
            errors[run.name] = f"{type(e).__name__}: {e}"[:400]
            ready.abort()

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i, r), daemon=True) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=20)
        done = sum(len(r.round_trips) + len(r.failures) for r in runs)
        progress(f"{done}/{len(runs) * CELLS} cells answered, {len(errors)} users stopped by an error")
        for host, mib in users_memory(cluster, uids).items():
            peak_memory[host] = max(peak_memory.get(host, 0.0), mib)
    return Phase(runs, errors, time.monotonic() - started, peak_memory, before, daemons(cluster))


def main() -> str:
    from tests.cluster.conftest import load_cluster
    from tests.cluster.test_e2e import every_gpu_node_heartbeats, node_info

    with tempfile.TemporaryDirectory() as tmp:
        cluster = load_cluster(Path(tmp))
        if isinstance(cluster, str):
            raise SystemExit(f"bench load: {cluster}")
        names = sorted(n for n in cluster.passwords if n.startswith("load"))
        if not names:
            raise SystemExit("bench load: the cluster has no load users (deploy it with GPUHUB_LOAD_USERS=20)")
        every_gpu_node_heartbeats(cluster)
        gpus = sum(node_info(cluster, n)["gpu_count"] for n in cluster.groups["gpu_nodes"])
        uids = tuple(int(cluster.exec(cluster.groups["hub"][0], "id", "-u", n)) for n in (names[0], names[-1]))
        progress(f"the anchor: {names[0]} alone, {CELLS} cells")
        alone = load(cluster, names[:1], uids)
        progress(f"{len(names)} users at once, {CELLS} cells each, {gpus} GPUs in all")
        crowd = load(cluster, names, uids)
    return report(cluster, gpus, alone, crowd)


def report(cluster, gpus: int, alone: Phase, crowd: Phase) -> str:
    runs = crowd.runs
    sent = [m for r in runs for m in r.sent]
    replies = Counter({m: c for r in runs for m, c in r.replies.items()})
    dup_replies = sum(1 for m in sent if replies[m] > 1)
    no_reply = sum(1 for m in sent if replies[m] == 0)
    dup_lines = sum(1 for r in runs for m in r.sent[1:] if r.lines.get(m, "").count("\n") > 1)
    failures = [f"{r.name}: {f}" for r in runs for f in r.failures]
    before, after = crowd.before, crowd.after
    restarted = [f"{h} {u}" for key, d in after.items()
                 if key in before and (d["restarts"], d["pid"]) != (before[key]["restarts"], before[key]["pid"])
                 for h, u in [key]]
    ok_cells = len(crowd.all("round_trips"))
    span = crowd.cells_span_s

    def line(label: str, attr: str) -> str:
        return f"| {label} | {pct(alone.all(attr), .5):.2f} s | {spread(crowd.all(attr))} |"

    lines = [
        "### Twenty users at once on the podman test cluster",
        "",
        f"`GPUHUB_CLUSTER=load .venv/bin/python -m bench load` ({time.strftime('%Y-%m-%d')}, "
        f"{platform.node()}, {os.cpu_count()} cores; hub and {len(cluster.groups['gpu_nodes'])} GPU servers "
        f"in podman containers, {gpus} fake GPUs)",
        "",
        f"{len(runs)} users at once, each: log in through the form, start a server (profile gpu1), start a "
        f"replicated one-GPU kernel, run {CELLS} cells of {WORK_S:.0f} s on its GPU with "
        f"{THINK_S[0]}–{THINK_S[1]} s between them, over Jupyter Server's websocket; beside it, the anchor: "
        f"one user doing the same alone, just before. Wall time {crowd.wall_s:.0f} s (alone {alone.wall_s:.0f} s); "
        f"the cells took {span:.0f} s from the first submit to the last reply and held a GPU "
        f"{ok_cells * WORK_S / max(span * gpus, 1e-9):.0%} of the GPU-time of that span.",
        "",
        f"| | one user alone, p50 | {len(runs)} at once: p50 / p95 / p99 / max |",
        "|---|---|---|",
        line("login (form post + token)", "login_s"),
        line("server ready", "server_s"),
        line("kernel start (POST /api/kernels)", "kernel_s"),
        line("first cell (`n = 0`)", "first_cell_s"),
        line("cell start delay (submit → cell starts on its GPU)", "starts"),
        line(f"cell round trip (submit → reply; {WORK_S:.0f} s of it is the cell)", "round_trips"),
        "",
        f"- cells answered ok: {ok_cells} of {len(runs) * CELLS}; with a status line (waited for a GPU or "
        f"moved): {sum(r.waited for r in runs)}; failed with a message: {len(failures)}; users stopped by an "
        f"error: {len(crowd.errors)}",
        f"- exactly once: requests without a reply {no_reply}, with two or more replies {dup_replies}, "
        f"cells whose output came twice {dup_lines}",
        f"- daemons restarted during the run: {', '.join(restarted) or 'none'}",
        "- daemons, peak resident memory (VmHWM since the daemon started) and CPU seconds during the "
        f"{len(runs)}-user run: " + ", ".join(
            f"{u} on {h} {d['peak_mib']:.0f} MiB, {d['cpu_s'] - before.get((h, u), d)['cpu_s']:.1f} CPU-s"
            for (h, u), d in sorted(after.items())),
        "- the load users' processes, peak of resident memory sampled every 20 s (servers on the hub, "
        "replicas on the GPU servers): " + ", ".join(f"{n} {m:.0f} MiB" for n, m in sorted(crowd.peak_memory.items())),
    ]
    for name, err in sorted({**alone.errors, **crowd.errors}.items()):
        lines.append(f"- {name} stopped: {err}")
    for f in failures[:10]:
        lines.append(f"- failed cell: {f}")
    return "\n".join(lines)
