"""A weekly GPU-hour quota on the installed cluster (docs/quotas.md): carol's inventory quota is
0.001 GPU-hours (3.6 s). Her spawn page shows it; one cell uses it up; her next GPU cell is refused
at once with the words why and changes nothing; an admin's `gpuhub quota grant` on the hub lets the
cell after run."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_e2e import HubUser, http_session, replica_units
from tests.helpers import wait_for

pytestmark = pytest.mark.cluster


def agent_quota(cluster, node: str) -> dict:
    r = http_session(cluster).get(f"{cluster.agent_url(node)}/api/v1/quota",
                                  headers=cluster.agent_auth(node), timeout=10)
    r.raise_for_status()
    return r.json()


def carol_seen(cluster, node: str) -> tuple[float, float]:
    """(GPU-seconds used, extra GPU-hours) of carol's own limit as ``node``'s agent enforces it."""
    q = agent_quota(cluster, node)
    view = q["view"] or {"limits": [], "week": "", "extra_hours": {}}
    used = next((lim["used_s"] for lim in view["limits"] if lim["name"] == "carol"), 0.0)
    for weeks in (q["unreported"]["pending"], (q["unreported"]["inflight"] or {}).get("weeks", {})):
        used += weeks.get(view["week"], {}).get("carol", 0.0)
    return used, view["extra_hours"].get("carol", 0.0)


def test_a_used_up_weekly_quota_refuses_the_next_gpu_cell_until_an_admin_grants_hours(cluster):
    hub = cluster.groups["hub"][0]
    carol = HubUser(cluster, "carol")
    carol.login()
    spawn_page = carol.s.get(f"{cluster.hub_url}/hub/spawn", timeout=30)
    assert "GPU-hours this week: 0.0 of 0.001 (resets Monday 00:00 UTC); GPUs at once: up to 1" in spawn_page.text
    carol.start_server("gpu1")
    try:
        kid = carol.start_kernel("gpuhub-gpu1")
        channel = carol.kernel(kid)
        try:
            channel.run("import time; x = 1; time.sleep(4)")
            nodes = list(replica_units(cluster, kid))
            assert len(nodes) == 3
            # Every server of her kernel learns of the 4 s: its own lease, or the scheduler's answer.
            wait_for(lambda: all(carol_seen(cluster, n)[0] >= 3.6 for n in nodes), timeout=60,
                     what="carol's replicas' servers to count her GPU time")
            refused = channel.collect(channel.send_execute("x = 2"))
            assert refused["reply"]["status"] == "error" and refused["reply"]["ename"] == "GpuQuotaExceeded"
            assert "of 0.001 GPU-hours this week; resets Monday 00:00 UTC" in refused["reply"]["evalue"]
            assert "GpuQuotaExceeded" in refused["stderr"]

            shown = json.loads(cluster.exec(hub, "/opt/gpuhub/venv/bin/gpuhub", "quota", "--user", "carol", "--json"))
            assert shown["users"][0]["gpu_hours_used"] >= 0.001
            out = cluster.exec(hub, "/opt/gpuhub/venv/bin/gpuhub", "quota", "grant", "carol", "1")
            assert "carol: 1 extra GPU-hour(s) this week" in out
            wait_for(lambda: all(carol_seen(cluster, n)[1] == 1 for n in nodes), timeout=60,
                     what="carol's replicas' servers to learn of the extra hour")
            assert channel.run("x += 1; print(x)")["stdout"] == "2\n"  # the refused cell changed nothing
        finally:
            channel.close()
    finally:
        carol.stop_server()
