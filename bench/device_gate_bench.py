"""What device access per grant adds to a GPU cell: the agent's ``DeviceGate`` opening a fake GPU's
node to a running unit at a grant and closing it at release (``systemctl set-property --runtime``,
systemd writing the unit's device cgroup), on a GPU server of the podman test cluster.

Anchor in the same run, alternating with it: the same number of ``systemctl show`` calls on the same
unit (the floor of any systemctl round trip). A grant is answered only once its list is applied, so
the grant half is on the cell's path; the release half runs after the reply.

    GPUHUB_CLUSTER=NAME .venv/bin/python -m bench device-gate      (GPUHUB_DEVICE_PAIRS, default 100)

Needs a deployed cluster (`scripts/cluster.sh up NAME && scripts/cluster.sh deploy NAME`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

NODE = "gpu1"
# Runs on the GPU server, in the agent's venv, as root (as the agent does).
ON_NODE = r"""
import asyncio, json, subprocess, sys, time
from gpuhub.agent.device_gate import DeviceGate
from gpuhub.agent.units import SystemdRunner
from gpuhub.gpus.fake import FakeInventory

PAIRS = int(sys.argv[1])
UNIT = "gpuhub-bench-devices"  # not gpuhub-kernel-*: no agent adopts it
subprocess.run(["systemd-run", "--unit", UNIT, "--quiet", "-p", "DevicePolicy=closed", "sleep", "3600"], check=True)
try:
    gpus = FakeInventory.from_config([{"device": f"/dev/gpuhub-fake-gpu{i}"} for i in range(2)], "bench")
    gate = DeviceGate(SystemdRunner("/run/gpuhub", 1000), gpus)
    gate.started(UNIT, "kernel")

    async def pair(gpu):
        t0 = time.perf_counter()
        gate.follow({UNIT: frozenset({gpu})})
        await gate.ready(UNIT)
        t1 = time.perf_counter()
        gate.follow({})
        await gate.ready(UNIT)
        return t1 - t0, time.perf_counter() - t1

    async def anchor():
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("systemctl", "show", "-p", "DeviceAllow", f"{UNIT}.service",
                                                    stdout=subprocess.PIPE)
        await proc.communicate()
        return time.perf_counter() - t0

    async def main():
        grant, release, floor = [], [], []
        for i in range(PAIRS):
            g, r = await pair(i % 2)
            grant.append(g); release.append(r)
            floor.append(await anchor())
        listed = subprocess.run(["systemctl", "show", "-p", "DeviceAllow", f"{UNIT}.service"],
                                capture_output=True, text=True).stdout.strip()
        print(json.dumps({"grant": grant, "release": release, "floor": floor, "after": listed}))

    asyncio.run(main())
finally:
    subprocess.run(["systemctl", "stop", f"{UNIT}.service"])
"""


def main() -> str:
    cluster = os.environ.get("GPUHUB_CLUSTER")
    if not cluster:
        raise SystemExit("set GPUHUB_CLUSTER to a deployed cluster's name (scripts/cluster.sh up NAME)")
    from tests.cluster.conftest import CONTAINERS_CONF

    pairs = int(os.environ.get("GPUHUB_DEVICE_PAIRS", "100"))
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    proc = subprocess.run(["podman", "exec", "-i", f"gpuhub-{cluster}-{NODE}", "/opt/gpuhub/venv/bin/python", "-",
                           str(pairs)], input=ON_NODE, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the benchmark failed on {NODE}: {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if "gpuhub-fake-gpu" in r["after"]:
        raise SystemExit(f"the unit still lists a GPU after the last release: {r['after']}")

    def ms(xs):
        xs = sorted(xs)
        return f"{statistics.median(xs) * 1e3:.1f} | {xs[int(0.95 * (len(xs) - 1))] * 1e3:.1f}"

    ratio = statistics.median(r["grant"]) / statistics.median(r["floor"])
    return "\n".join([
        f"### Device access per grant ({pairs} grant/release pairs, one GPU server of the podman cluster)",
        "",
        f"`GPUHUB_CLUSTER={cluster} .venv/bin/python -m bench device-gate`",
        "",
        "| step | median ms | p95 ms |",
        "|---|---|---|",
        f"| grant: open the GPU's node to the unit (on the cell's path) | {ms(r['grant'])} |",
        f"| release: close it (after the reply) | {ms(r['release'])} |",
        f"| anchor: `systemctl show` on the same unit | {ms(r['floor'])} |",
        "",
        f"Grant / anchor: {ratio:.2f}× (medians).",
    ])
