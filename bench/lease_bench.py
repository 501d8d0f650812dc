"""A GPU cell's two agent calls: grant + release through ``LeaseClient`` against a real agent.

Anchor in the same run: the same two requests over one bare kept-alive ``http.client`` connection
(the transport's floor, no retry rule, no pool). Pairs alternate between the two, so machine noise
falls on both alike.

    PYTHONPATH=. .venv/bin/python -m bench lease      (GPUHUB_LEASE_PAIRS, default 300)
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import AgentProcess, current_user
from gpuhub.kernel.lease_client import LeaseClient


def _kernel_unit_token(agent: AgentProcess) -> str:
    name = "gpuhub-kernel-bench-r0"
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": 1, "cwd": os.getcwd(),
        "kernel": {"key": "k", "kernel_id": "bench"}})
    if status != 201:
        raise RuntimeError(f"could not start a kernel unit: {status} {unit}")
    return ProcessRunner(str(agent.dir / "run"), 0).read_env(name)["GPUHUB_LEASE_TOKEN"]


def _bare_pair(conn: http.client.HTTPConnection, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request("POST", "/api/v1/leases", json.dumps({"gpus": 1, "holder_pid": os.getpid()}), headers)
    lease = json.loads(conn.getresponse().read())
    conn.request("DELETE", f"/api/v1/leases/{lease['lease_id']}", headers=headers)
    conn.getresponse().read()


def _client_pair(client: LeaseClient) -> None:
    lease = client.try_grant(1)
    if lease is None:
        raise RuntimeError("the agent's only GPU is taken")
    client.release(lease)


def main() -> str:
    pairs = int(os.environ.get("GPUHUB_LEASE_PAIRS", "300"))
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), "bench1", gpus=1).start()
        try:
            token = _kernel_unit_token(agent)
            client = LeaseClient(agent.url, token, agent.name)
            bare = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
            times: dict[str, list[float]] = {"LeaseClient (urllib3 pool)": [], "bare http.client": []}
            for _ in range(20):  # warm both connections and the agent
                _client_pair(client)
                _bare_pair(bare, token)
            for _ in range(pairs):
                for label, pair in (("LeaseClient (urllib3 pool)", lambda: _client_pair(client)),
                                    ("bare http.client", lambda: _bare_pair(bare, token))):
                    t0 = time.perf_counter()
                    pair()
                    times[label].append(time.perf_counter() - t0)
            bare.close()
            client.http.close()
        finally:
            agent.close()
    anchor = statistics.median(times["bare http.client"])
    rows = []
    for label, ts in times.items():
        ts.sort()
        p50, p99 = statistics.median(ts), ts[int(0.99 * (len(ts) - 1))]
        rows.append(f"| {label} | {p50 * 1e6:.0f} | {p99 * 1e6:.0f} | {p50 / anchor:.2f}× |")
    return "\n".join([
        f"### Lease round trip (grant + release), {pairs} alternating pairs",
        "",
        "Command: `PYTHONPATH=. .venv/bin/python -m bench lease`",
        "",
        "| client | p50 µs | p99 µs | p50 vs bare |",
        "|---|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    print(main())
