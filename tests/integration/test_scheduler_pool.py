"""The elastic pool at work in the scheduler (gpuhub/scheduler/pool_loop.py): hooks run with the
server's name, a drained server's replicas move before it is released, failing or hanging hooks are
events that leave the pool consistent, and settings that cannot work are refused."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest

from gpuhub.scheduler.config import SchedulerConfig
from gpuhub.scheduler.metrics import scheduler_registry
from gpuhub.scheduler.pool_loop import HookFailed, run_hook
from gpuhub.scheduler.service import Scheduler
from tests.unit.test_scheduler_heal import kernel, stub_agents

HOOK = """\
import sys, time
action, mode, log, node = sys.argv[1:5]
if mode == "hang":
    time.sleep(60)
if mode == "slow":
    time.sleep(1)
with open(log, "a") as fh:
    fh.write(f"{action} {node}\\n")
if mode == "fail":
    print(f"cannot {action} {node}: no such node in slurm.conf")
    sys.exit(3)
"""


@pytest.fixture
def hook(tmp_path):
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    log = tmp_path / "hooks.log"

    def command(action: str, mode: str = "ok") -> str:
        return f"{sys.executable} {script} {action} {mode} {log}"

    command.log = log
    return command


def pool_scheduler(tmp_path, hook, nodes=("a", "b", "c", "d"), release="ok", acquire="ok", **settings) -> Scheduler:
    settings = {"pool_min_active": 2, "pool_release_after_s": 0, "pool_hook_timeout_s": 5, **settings}
    config = SchedulerConfig(state_dir=str(tmp_path / "state"), node_timeout_s=5, pool_enabled=True,
                             pool_release_command=hook("release", release),
                             pool_acquire_command=hook("acquire", acquire), **settings)
    s = Scheduler(config, agent_token="t")
    for name in nodes:
        beat(s, name)

    async def ask_node(name):  # the agent's answer now: as in the books (no agents here)
        v = s.node_view(s.nodes[name])
        return {"gpu_count": v.gpu_count, "pending": v.pending, "committed": v.committed}

    s.ask_node = ask_node
    return s


async def settle(s: Scheduler) -> None:
    """Wait for the hooks the pool started in the background."""
    await asyncio.gather(*list(s.pool._hooks.values()), return_exceptions=True)


def beat(s: Scheduler, name: str, committed: int = 0) -> None:
    s.heartbeat({"node": name, "url": f"http://{name}.invalid", "gpu_count": 2, "committed": committed,
                 "pending": 0})


def states(s: Scheduler) -> dict[str, str]:
    return {v["node"]: v["state"] for v in s.nodes_view()}


def metric(s: Scheduler, name: str, **labels) -> float:
    value = scheduler_registry(s).get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_idle_servers_drain_then_are_released_through_the_hook_with_their_names(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook, nodes=("a", "b", "c", "d", "e"), pool_min_active=3)
    s.kernels["k1"] = kernel(["a", "b", "c"])
    plan = await s.pool.step()
    # five idle servers, at least three: the two that hold nothing drain (two at a time at most)
    assert plan.drain == ("d", "e") and states(s)["d"] == states(s)["e"] == "draining"
    assert not any(v.schedulable for v in s.node_views() if v.name in plan.drain)
    plan = await s.pool.step()
    assert plan.release == ("d", "e")
    await settle(s)
    assert sorted(hook.log.read_text().splitlines()) == ["release d", "release e"]
    assert states(s) == {"a": "active", "b": "active", "c": "active", "d": "lent", "e": "lent"}
    assert metric(s, "gpuhub_pool_servers", state="lent") == 2
    assert metric(s, "gpuhub_pool_hook_runs_total", hook="release", outcome="ok") == 2
    assert metric(s, "gpuhub_pool_actions_total", action="released") == 2


async def test_the_spare_is_kept_for_the_cells_the_agents_report_not_for_every_placed_kernel(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook, pool_min_active=3)
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    record.gpus = 2  # a whole server's worth, but it has run no cell lately
    now = time.time()
    for i, name in enumerate(("a", "b", "c")):  # one 1-GPU cell of other kernels on each
        s.heartbeat({"node": name, "url": f"http://{name}.invalid", "gpu_count": 2, "committed": 1, "pending": 0,
                     "leases": [{"lease_id": f"l{i}", "holder": f"gpuhub-kernel-small{i}-r0", "gpus": [0],
                                 "granted_at": now, "user": "bob", "kernel_id": f"small{i}"}]})
    # The largest recent request is one GPU, which a, b and c can each grant: d is surplus.
    assert (await s.pool.step()).drain == ("d",)
    # k1's cell waits for two GPUs, which only an empty server has: d comes back at once.
    s.pool.cell_waits("k1", 2)
    plan = await s.pool.step()
    assert plan.undrain == ("d",) and states(s)["d"] == "active"
    # While k1's cells keep coming (its lease on d), d stays; twenty minutes after, it is surplus again.
    s.pool.cell_placed("k1")
    s.heartbeat({"node": "d", "url": "http://d.invalid", "gpu_count": 2, "committed": 0, "pending": 0,
                 "leases": []})
    s.pool.policy.recent.note(2, now)
    assert not (await s.pool.step()).drain
    s.pool.policy.recent.last[2] = now - s.config.pool_spare_recent_s - 1
    assert (await s.pool.step()).drain == ("d",)


async def test_a_drained_servers_replicas_move_before_it_is_released(tmp_path, hook, monkeypatch):
    s = pool_scheduler(tmp_path, hook, nodes=("a", "b", "c", "d"), pool_min_active=3, pool_spare_servers=0)
    started, stopped = stub_agents(s, monkeypatch)
    s.kernels["k1"] = record = kernel(["a", "b", "c"])
    s.nodes["d"].info["committed"] = 1  # d is busy: a, holding a replica, is the one to lend
    plan = await s.pool.step()
    assert plan.drain == ("a",)
    s.started -= 60  # past the scheduler's start-up grace
    await s.heal()  # the drain moves a's replica, to the server that stays
    assert started == ["d"] and stopped == ["a"]
    assert sorted(r.node for r in record.replicas) == ["b", "c", "d"]
    plan = await s.pool.step()
    await settle(s)
    assert plan.release == ("a",) and states(s)["a"] == "lent"


async def test_a_lent_server_is_acquired_when_demand_rises_and_is_active_once_it_heartbeats(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook)
    s.nodes["d"].pool, s.nodes["c"].pool = "lent", "lent"
    for name in ("a", "b"):
        beat(s, name, committed=2)  # every active GPU granted: no spare left
    plan = await s.pool.step()
    assert plan.acquire == ("c",) or plan.acquire == ("d",)
    name = plan.acquire[0]
    assert states(s)[name] == "acquiring"
    await settle(s)  # the hook, in the background
    assert hook.log.read_text().splitlines() == [f"acquire {name}"]
    assert states(s)[name] == "acquiring"  # until its agent says it is back
    s.nodes[name].pool_since -= 1  # the hook began a second ago
    beat(s, name)
    await s.pool.step()
    assert states(s)[name] == "active"
    assert any(v.name == name and v.schedulable for v in s.node_views())
    assert metric(s, "gpuhub_pool_actions_total", action="acquired") == 1


async def test_a_failing_release_keeps_the_server_in_service_and_is_counted(tmp_path, hook, caplog):
    s = pool_scheduler(tmp_path, hook, release="fail")
    s.nodes["d"].pool = "draining"
    with caplog.at_level(logging.ERROR):
        await s.pool.step()
        await settle(s)
    assert states(s)["d"] == "active"
    line = next(r.message for r in caplog.records if "releasing d failed" in r.message)
    assert "exited with status 3" in line and "no such node in slurm.conf" in line and "stays in service" in line
    assert metric(s, "gpuhub_pool_hook_failures_total", hook="release") == 1


async def test_a_hanging_acquire_is_killed_and_the_server_rests_while_another_is_tried(tmp_path, hook, caplog):
    s = pool_scheduler(tmp_path, hook, acquire="hang", pool_hook_timeout_s=0.5)
    s.nodes["c"].pool = s.nodes["d"].pool = "lent"
    for name in ("a", "b"):
        beat(s, name, committed=2)
    first = (await s.pool.step()).acquire[0]
    with caplog.at_level(logging.ERROR):
        await settle(s)
    assert states(s)[first] == "lent"
    assert any("killed" in r.message and first in r.message for r in caplog.records)
    second = (await s.pool.step()).acquire
    assert second and second[0] != first  # the failed one rests
    assert metric(s, "gpuhub_pool_hook_failures_total", hook="acquire") == 1
    await s.pool.close()  # its hook hangs too: killed, not left behind
    assert not s.pool._hooks


async def test_an_acquired_server_that_never_heartbeats_goes_back_to_lent(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook, pool_acquire_timeout_s=0.2)
    s.nodes["d"].pool, s.nodes["d"].pool_since = "acquiring", time.time() - 1
    s.nodes["d"].last_seen, s.nodes["d"].seen = time.time() - 60, time.monotonic() - 60
    await s.pool.step()
    assert states(s)["d"] == "lent"
    assert metric(s, "gpuhub_pool_hook_runs_total", hook="acquire", outcome="timeout") == 1


async def test_without_hooks_the_pool_only_reports(tmp_path, caplog):
    s = Scheduler(SchedulerConfig(state_dir=str(tmp_path), pool_enabled=True, pool_min_active=1,
                                  pool_release_after_s=0), agent_token="t")
    for name in ("a", "b", "c", "d", "e"):
        beat(s, name)
    with caplog.at_level(logging.INFO):
        plan = await s.pool.step()
        await s.pool.step()
    assert plan.drain
    assert set(states(s).values()) == {"active"}
    said = [r.message for r in caplog.records if "report only" in r.message]
    assert len(said) == 1 and "would drain and lend" in said[0]


def test_the_pool_state_survives_a_restart_and_a_heartbeat(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook)
    s.nodes["d"].pool = "lent"
    s.save()
    again = Scheduler(s.config, agent_token="t")
    again.load()
    beat(again, "d")  # a lent server given to Slurm keeps its agent running
    assert states(again)["d"] == "lent"


@pytest.mark.parametrize("settings, message", [
    (dict(pool_release_command="true"), "go together"),
    (dict(pool_min_active=4, pool_max_active=2), "below pool_min_active"),
])
def test_settings_that_cannot_work_are_refused(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(SchedulerConfig(state_dir=str(tmp_path), pool_enabled=True, **settings), agent_token="t")


async def test_run_hook_reports_what_went_wrong():
    assert await run_hook(f"{sys.executable} -c 'import sys; print(sys.argv[1])'", "gpu7", 5) == "gpu7"
    with pytest.raises(HookFailed, match="could not start"):
        await run_hook("/nonexistent/hook", "gpu7", 5)
    with pytest.raises(HookFailed, match="status 2: boom"):
        await run_hook(f"{sys.executable} -c 'import sys; print(\"boom\"); sys.exit(2)'", "gpu7", 5)


def test_turning_the_pool_off_puts_what_it_lent_back_in_service(tmp_path, hook, caplog):
    s = pool_scheduler(tmp_path, hook)
    s.nodes["d"].pool = "lent"
    s.save()
    off = Scheduler(SchedulerConfig(state_dir=str(tmp_path / "state"), node_timeout_s=5), agent_token="t")
    with caplog.at_level(logging.WARNING):
        off.load()
    assert off.nodes["d"].pool == ""
    said = "node d was lent by the elastic pool, which is off or only reports now"
    assert any(said in r.message for r in caplog.records)


async def test_a_lent_server_that_keeps_heartbeating_is_not_active_before_its_acquire_hook_ends(tmp_path, hook):
    # Slurm: the agent runs while the server is lent; the take hook waits for Slurm's jobs to end
    s = pool_scheduler(tmp_path, hook, acquire="slow")
    s.nodes["c"].pool = s.nodes["d"].pool = "lent"
    for name in ("a", "b"):
        beat(s, name, committed=2)
    name = (await s.pool.step()).acquire[0]
    beat(s, name)
    await s.pool.step()
    assert states(s)[name] == "acquiring"  # its hook still runs
    assert name not in (await s.pool.step()).acquire  # and it is not acquired twice
    await settle(s)
    s.nodes[name].pool_since -= 1
    beat(s, name)
    await s.pool.step()
    assert states(s)[name] == "active"


async def test_a_server_a_replica_is_on_its_way_to_is_not_released(tmp_path, hook):
    s = pool_scheduler(tmp_path, hook)
    s.nodes["d"].pool = "draining"
    s._placing["k9"] = ["b", "c", "d"]  # a kernel being created chose d before the drain
    await s.pool.step()
    await settle(s)
    assert states(s)["d"] == "draining" and not hook.log.exists()
    del s._placing["k9"]
    await s.pool.step()
    await settle(s)
    assert states(s)["d"] == "lent"


async def test_three_replicas_need_three_servers_and_a_failed_placement_is_demand(tmp_path, hook):
    # the admin's minimum is 2, but a kernel's three replicas need three servers
    s = pool_scheduler(tmp_path, hook, pool_min_active=2, pool_spare_servers=0)
    s.nodes["c"].pool = s.nodes["d"].pool = "lent"
    assert len((await s.pool.step()).acquire) == 1
    await settle(s)
    # a kernel that found no servers adds a server's GPUs to the demand for a while
    s.pool.placement_failed("k2")
    assert s.pool.current_demand() == 2
