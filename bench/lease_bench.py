"""A GPU cell's two agent calls: grant + release through ``LeaseClient`` against a real agent.

Anchor in the same run: the same two requests over one bare kept-alive ``http.client`` connection
(the transport's floor, no retry rule, no pool). A third agent enforces GPU quotas on the same
user (docs/quotas.md: a user limit, 20 group limits it is in, 200 other users' limits), so the
quota check's cost on every grant shows beside the others, and a fourth serves TLS with a
certificate of a test CA, as deployed agents do (docs/security.md, "TLS"), so the cost of https over
http shows too. Pairs alternate between them, so machine noise falls on all alike.

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


def quota_view(user: str) -> dict:
    """What the scheduler would send a server whose users have limits: the user's own, groups the
    user is in, and many other users' (a view lists every user with a kernel on the server)."""
    from gpuhub.platform.weeks import week_key, week_start

    def limit(name, kind, members):
        return {"name": name, "kind": kind, "members": members, "gpus": 8, "gpu_hours": 1e6, "used_s": 3600.0,
                "held_elsewhere": {f"k{i}": 1 for i in range(4)}}

    now = time.time()
    limits = [limit(user, "user", [user])]
    limits += [limit(f"group g{i}", "group", [user] + [f"u{j}" for j in range(30)]) for i in range(20)]
    limits += [limit(f"u{i}", "user", [f"u{i}"]) for i in range(200)]
    return {"week": week_key(now), "week_start": week_start(now), "users": [user], "limits": limits,
            "extra_hours": {}}


def _kernel_unit_token(agent: AgentProcess, quotas: dict | None = None) -> str:
    name = "gpuhub-kernel-bench-r0"
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": 1, "cwd": os.getcwd(),
        "kernel": {"key": "k", "kernel_id": "bench"}, **({"quotas": quotas} if quotas else {})})
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
    from tests.tls_certs import TestCA

    pairs = int(os.environ.get("GPUHUB_LEASE_PAIRS", "300"))
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), "bench1", gpus=1).start()
        limited = AgentProcess(Path(tmp), "bench2", gpus=1).start()
        (Path(tmp) / "tls").mkdir()
        ca = TestCA(Path(tmp) / "tls")
        cert = ca.server("host")
        trust = os.environ.get("SSL_CERT_FILE")
        os.environ["SSL_CERT_FILE"] = str(ca.cert)  # the host's trust store holds the cluster CA
        secure = AgentProcess(Path(tmp), "bench3", gpus=1,
                              extra={"tls_cert_file": str(cert.cert), "tls_key_file": str(cert.key)}).start()
        try:
            token = _kernel_unit_token(agent)
            client = LeaseClient(agent.url, token, agent.name)
            quota_client = LeaseClient(limited.url, _kernel_unit_token(limited, quota_view(current_user())),
                                       limited.name)
            tls_client = LeaseClient(secure.url, _kernel_unit_token(secure), secure.name)
            bare = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
            variants = (("LeaseClient (urllib3 pool)", lambda: _client_pair(client)),
                        ("bare http.client", lambda: _bare_pair(bare, token)),
                        ("LeaseClient, agent enforcing quotas (221 limits)", lambda: _client_pair(quota_client)),
                        ("LeaseClient over https (kept-alive TLS connection)", lambda: _client_pair(tls_client)))
            times: dict[str, list[float]] = {label: [] for label, _ in variants}
            for _ in range(20):  # warm the connections and the agents
                for _, pair in variants:
                    pair()
            for _ in range(pairs):
                for label, pair in variants:
                    t0 = time.perf_counter()
                    pair()
                    times[label].append(time.perf_counter() - t0)
            bare.close()
            client.http.close()
            quota_client.http.close()
            tls_client.http.close()
        finally:
            agent.close()
            limited.close()
            secure.close()
            if trust is None:
                os.environ.pop("SSL_CERT_FILE", None)
            else:
                os.environ["SSL_CERT_FILE"] = trust
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
