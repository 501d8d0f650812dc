"""GPU quotas on a development cluster (docs/quotas.md): the agents refuse a cell past its user's
limit with the words the notebook shows, at once and without a wait; usage is counted from the
leases and reaches the scheduler's books; an admin's extra hours let the next cell run."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuhub.dev.cluster import DevCluster, DevKernel, current_user
from tests.helpers import wait_for
from tests.integration.test_gpu_cells import run, wait_for_output

# Two seconds of one GPU: a cell that sleeps 2.5 s uses it up.
TINY_HOURS = 2 / 3600


def quota_view(agent) -> dict:
    return agent.call("GET", "/api/v1/quota")[1]


def every_agent(cluster: DevCluster, predicate) -> bool:
    return all(predicate(quota_view(a)) for a in cluster.agents)


def own_limit(view: dict | None, user: str) -> dict:
    return next(lim for lim in (view or {}).get("limits", []) if lim["kind"] == "user" and user in lim["members"])


@pytest.fixture
def cluster(request, tmp_path):
    c = DevCluster(tmp_path, nodes=3, gpus_per_node=2,
                   scheduler_settings={"quota_users": {current_user(): request.param}}).start()
    yield c
    c.stop()


@pytest.mark.parametrize("cluster", [{"gpus": 1}], indirect=True)
def test_a_kernel_larger_than_the_gpu_limit_is_told_so_at_its_first_cell(cluster):
    k = DevKernel(cluster, gpus=2)
    try:
        started = time.monotonic()
        reply, out = run(k.kc, "x = 1")
        assert time.monotonic() - started < 20  # no wait for a grant timeout
        assert reply["status"] == "error" and reply["ename"] == "GpuQuotaExceeded"
        assert "this kernel asks for 2 GPU(s) per cell, more than the 1 you may hold at once" in reply["evalue"]
        assert out["errors"] == ["GpuQuotaExceeded"]
        reply, out = run(k.kc, "print('x' in dir())")
        assert reply["status"] == "error"  # the kernel never gets the GPUs; and nothing ran
        assert sum(quota_view(a)["refusals"]["gpus"] for a in cluster.agents) >= 2
    finally:
        k.close()


@pytest.mark.parametrize("cluster", [{"gpus": 1}], indirect=True)
def test_a_cell_past_the_gpus_at_once_is_refused_while_another_kernel_holds_one(cluster):
    user = current_user()
    busy, other = DevKernel(cluster, gpus=1), DevKernel(cluster, gpus=1)
    try:
        assert run(other.kc, "y = 1")[0]["status"] == "ok"
        msg_id = busy.kc.execute("import time; print('holding', flush=True); time.sleep(600)")
        wait_for_output(busy.kc, msg_id, "holding")
        # Every agent knows: the holder's own agent from its lease, the others from the scheduler's
        # answer to their heartbeats (the holder's heartbeat shows the lease). Only `busy`'s lease
        # counts: a view may still list `other`'s own last lease, which never counts against it.
        wait_for(lambda: all(held_seen(a, user, busy.kernel_id) for a in cluster.agents), timeout=30,
                 what="every agent to see the held GPU")
        reply, _ = run(other.kc, "y = 2")
        assert reply["status"] == "error" and reply["ename"] == "GpuQuotaExceeded"
        assert "already hold 1 of your 1 at once in other kernels" in reply["evalue"]
        # Every server that was asked decided (the holder's own counts its local lease): none
        # failed with a 500, which the kernel would take for "cannot reach the agent".
        assert sum(quota_view(a)["refusals"]["gpus"] for a in cluster.agents) >= 1
        for a in cluster.agents:
            assert "500 POST /api/v1/leases" not in (a.dir / "agent.log").read_text()
    finally:
        busy.close()
        other.close()


def held_seen(agent, user: str, kernel_id: str) -> int:
    """GPUs the user's kernel ``kernel_id`` holds as this agent sees them: its own leases and
    those the scheduler reported."""
    elsewhere = own_limit(quota_view(agent)["view"], user)["held_elsewhere"].get(kernel_id, 0)
    return elsewhere + sum(len(le["gpus"]) for le in agent.call("GET", "/api/v1/node")[1]["leases"]
                           if le["kernel_id"] == kernel_id)


@pytest.mark.parametrize("cluster", [{"gpu_hours_per_week": TINY_HOURS}], indirect=True)
def test_gpu_hours_are_counted_refused_past_the_limit_and_extra_hours_let_the_next_cell_run(cluster):
    user = current_user()
    k = DevKernel(cluster, gpus=1)
    try:
        reply, _ = run(k.kc, "import time; x = 1; time.sleep(2.5)")
        assert reply["status"] == "ok"
        # The lease's 2.5 s reach the scheduler's books, and every agent's view (one heartbeat later).
        wait_for(lambda: cluster.scheduler_call("GET", f"/api/v1/quota/{user}")[1]["gpu_hours_used"] >= 2.5 / 3600,
                 timeout=30, what="the scheduler to count the cell's GPU time")
        wait_for(lambda: every_agent(cluster, lambda v: own_limit(v["view"], user)["used_s"] >= 2.5
                                     or _unreported(v, user) >= 2.5),
                 timeout=30, what="every agent to see the GPU time used")
        started = time.monotonic()
        reply, out = run(k.kc, "x = 2")
        assert time.monotonic() - started < 20
        assert reply["status"] == "error" and reply["ename"] == "GpuQuotaExceeded"
        assert f"of {TINY_HOURS:g} GPU-hours this week; resets Monday 00:00 UTC" in reply["evalue"]
        # The hours the one GPU cell held: its 2.5 s of sleep and, on a busy machine, a little more.
        used_hours = float(reply["evalue"].removeprefix("used ").split(" ", 1)[0])
        assert 2.5 / 3600 <= used_hours < 30 / 3600, reply["evalue"]
        assert run(k.kc, "print(x)", )[0]["status"] == "error"  # still over: every GPU cell is refused

        status, body = cluster.scheduler_call("POST", f"/api/v1/quota/{user}/extra", {"gpu_hours": 1},
                                              token=cluster.scheduler.token)
        assert status == 200 and body["extra_gpu_hours"] == 1
        own = next(lim for lim in body["limits"] if lim["kind"] == "user")
        assert own["gpu_hours"] == pytest.approx(1 + TINY_HOURS)
        wait_for(lambda: every_agent(cluster, lambda v: v["view"]["extra_hours"].get(user) == 1),
                 timeout=30, what="every agent to learn of the extra hours")
        reply, out = run(k.kc, "x += 1; print(x)")
        assert reply["status"] == "ok" and out["stdout"] == "2\n"  # x was 1: the refused cells changed nothing
    finally:
        k.close()


def _unreported(view: dict, user: str) -> float:
    weeks = [view["unreported"]["pending"], (view["unreported"]["inflight"] or {}).get("weeks", {})]
    return sum(w.get(view["view"]["week"], {}).get(user, 0.0) for w in weeks)


@pytest.mark.parametrize("cluster", [{"gpus": 4, "gpu_hours_per_week": 10}], indirect=True)
def test_the_quota_api_shows_users_their_own_and_admins_everyone(cluster):
    user = current_user()
    status, mine = cluster.scheduler_call("GET", "/api/v1/quota")  # the user's own token
    assert status == 200 and [u["user"] for u in mine["users"]] == [user]
    assert mine["users"][0]["resets"] == "Monday 00:00 UTC"
    assert cluster.scheduler_call("GET", "/api/v1/quota/someone-else")[0] == 403
    assert cluster.scheduler_call("POST", f"/api/v1/quota/{user}/extra", {"gpu_hours": 1})[0] == 401
    for bad in ({"gpu_hours": 0}, {"gpu_hours": -1}, {"gpu_hours": 1e9}, {"hours": 1}):
        status, body = cluster.scheduler_call("POST", f"/api/v1/quota/{user}/extra", bad,
                                              token=cluster.scheduler.token)
        assert status == 400 and "gpu_hours" in body["error"]
    status, every = cluster.scheduler_call("GET", "/api/v1/quota", token=cluster.scheduler.token)
    assert status == 200 and user in [u["user"] for u in every["users"]]


@pytest.mark.parametrize("cluster", [{"gpus": 4, "gpu_hours_per_week": 10}], indirect=True)
def test_the_spawn_page_shows_the_users_quota_line_and_opens_without_the_scheduler(cluster, tmp_path):
    from types import SimpleNamespace

    from gpuhub.hub.spawner import GpuhubSpawner

    token_file = tmp_path / "scheduler.token"
    token_file.write_text(cluster.scheduler.token)
    token_file.chmod(0o600)
    spawner = GpuhubSpawner(user=SimpleNamespace(name=current_user(), url="/user/x/"),
                            scheduler_url=cluster.scheduler.url, scheduler_token_file=str(token_file))
    form = asyncio.run(spawner.get_options_form())
    assert ('<p class="gpuhub-quota">GPU-hours this week: 0.0 of 10 (resets Monday 00:00 UTC); '
            "GPUs at once: up to 4</p>") in form
    assert 'name="profile"' in form
    cluster.scheduler.stop()
    form = asyncio.run(spawner.get_options_form())
    assert "gpuhub-quota" not in form and 'name="profile"' in form


@pytest.mark.parametrize("cluster", [{"gpus": 4, "gpu_hours_per_week": 10}], indirect=True)
def test_gpuhub_quota_shows_admins_every_user_grants_hours_and_shows_a_user_their_own(cluster, tmp_path):
    import json
    import os
    import subprocess
    import sys

    def cli(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "gpuhub.admin.cli", "quota", *argv], capture_output=True,
                              text=True, timeout=60, env={**os.environ, **(env or {})})

    user, config = current_user(), str(cluster.scheduler.config)
    shown = cli("--config", config)
    assert shown.returncode == 0, shown.stderr
    head, row = shown.stdout.splitlines()[:2]
    assert head.split() == ["USER", "GPU-HOURS", "LIMIT", "EXTRA", "GPUS", "AT", "ONCE", "GROUPS"]
    assert row.split() == [user, "0.00", "10", "-", "0", "4", "-"]
    granted = cli("grant", user, "2.5", "--config", config)
    assert granted.returncode == 0 and f"{user}: 2.5 extra GPU-hour(s) this week" in granted.stdout
    assert json.loads(cli("--user", user, "--json", "--config", config).stdout)["users"][0]["extra_gpu_hours"] == 2.5
    assert cli("grant", user, "--config", config).returncode == 2
    # A mistyped name or a system account is refused, the books unchanged; --force grants anyway.
    for name, says in (("no-such-user-x", "no user 'no-such-user-x'"), ("nobody", "system account")):
        wrong = cli("grant", name, "1", "--config", config)
        assert wrong.returncode == 2 and says in wrong.stderr, wrong.stderr
    listed = json.loads(cli("--json", "--config", config).stdout)["users"]
    assert [st["user"] for st in listed] == [user], listed
    assert cli("grant", "no-such-user-x", "1", "--force", "--config", config).returncode == 0
    # A user in a JupyterLab terminal: no admin settings, their server's JupyterHub token.
    env = {"JUPYTERHUB_API_TOKEN": cluster.user_token, "GPUHUB_SCHEDULER_URL": cluster.scheduler.url}
    mine = cli("--config", str(tmp_path / "none.toml"), env=env)
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout.splitlines()[1].split()[:4] == [user, "0.00", "12.5", "2.5"]
    refused = cli("grant", user, "1", "--config", str(tmp_path / "none.toml"), env=env)
    assert refused.returncode == 1 and "refused the token" in refused.stderr
    nothing = cli("--config", str(tmp_path / "none.toml"), env={"JUPYTERHUB_API_TOKEN": ""})
    assert nothing.returncode == 2 and "none.toml" in nothing.stderr
