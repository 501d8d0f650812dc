"""GPU quotas, the pure parts: weeks, the settings, the scheduler's ledger and views, and the
agent's meter and gate (gpuhub/scheduler/quotas.py, gpuhub/agent/quota_gate.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuhub.agent.leases import Lease
from gpuhub.agent.quota_gate import QuotaGate, QuotaRefused, UsageMeter
from gpuhub.platform.quota_text import usage_line
from gpuhub.platform.weeks import split_by_week, week_key, week_start
from gpuhub.scheduler.quotas import LiveLease, QuotaConfigError, QuotaPolicy, Quotas, UsageLedger

TUESDAY = dt.datetime(2026, 11, 24, 13, 0, tzinfo=dt.UTC).timestamp()
MONDAY = dt.datetime(2026, 11, 23, tzinfo=dt.UTC).timestamp()


def test_a_week_runs_from_monday_midnight_utc_and_a_lease_over_it_is_split():
    assert week_start(TUESDAY) == MONDAY and week_key(TUESDAY) == "2026-11-23"
    assert week_key(MONDAY) == "2026-11-23" and week_key(MONDAY - 1) == "2026-11-16"
    assert split_by_week(MONDAY - 10, MONDAY + 5) == [("2026-11-16", 10.0), ("2026-11-23", 5.0)]
    assert split_by_week(5, 5) == []


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"users": {"alice": {"gpus": -1}}}, "quota_users.alice.gpus must be a whole number >= 0"),
    ({"users": {"alice": {"gpus": 1.5}}}, "quota_users.alice.gpus"),
    ({"users": {"alice": {"gpu_hours": 3}}}, "unknown key(s) gpu_hours; use gpus, gpu_hours_per_week"),
    ({"users": {"alice": 3}}, "quota_users.alice must be a table"),
    ({"default": {"gpu_hours_per_week": "lots"}}, "quota_default.gpu_hours_per_week must be a number"),
    ({"groups": {"lab": {"gpus": 2}}}, "quota_groups.lab.members must list"),
    ({"groups": {"lab": {"members": ["a"], "cpus": 2}}}, "unknown key(s) cpus"),
])
def test_limits_that_cannot_be_used_are_refused_naming_the_setting(kwargs, words):
    with pytest.raises(QuotaConfigError) as err:
        QuotaPolicy(**kwargs)
    assert words in str(err.value)


def test_a_users_own_limits_replace_the_default_and_their_groups_apply_too():
    p = QuotaPolicy(default={"gpus": 1}, users={"alice": {"gpu_hours_per_week": 30}},
                    groups={"lab": {"members": ["alice", "bob"], "gpus": 4}})
    assert [(lim.name, lim.gpus, lim.gpu_hours) for lim in p.limits_for("alice")] == [
        ("alice", None, 30.0), ("group lab", 4, None)]
    assert [(lim.name, lim.gpus) for lim in p.limits_for("carol")] == [("carol", 1)]
    assert not QuotaPolicy().enabled and QuotaPolicy().limits_for("x") == []


def test_the_ledger_adds_each_usage_batch_once_and_refuses_a_malformed_one():
    ledger = UsageLedger()
    batch = {"seq": 7, "weeks": {"2026-11-23": {"alice": 10.0}}}
    assert ledger.apply("gpu1", batch) == 7
    assert ledger.apply("gpu1", batch) == 7  # its answer was lost: sent again, counted once
    assert ledger.closed == {"2026-11-23": {"alice": 10.0}}
    ledger.apply("gpu2", {"seq": 1, "weeks": {"2026-11-23": {"alice": 5}}})  # another server's numbers
    assert ledger.closed["2026-11-23"]["alice"] == 15.0
    for bad in ({"weeks": {}}, {"seq": True}, {"seq": 8, "weeks": {"w": {"alice": -1}}},
                {"seq": 8, "weeks": {"w": {"alice": float("nan")}}}, {"seq": 8, "weeks": []}):
        with pytest.raises(ValueError):
            ledger.apply("gpu1", bad)
    assert ledger.closed["2026-11-23"]["alice"] == 15.0
    assert UsageLedger.from_dict(ledger.to_dict()).to_dict() == ledger.to_dict()


def test_old_weeks_are_pruned_from_the_books():
    ledger = UsageLedger()
    ledger.closed = {"2020-01-06": {"a": 1.0}, "2026-11-23": {"a": 2.0}}
    ledger.prune(TUESDAY)
    assert list(ledger.closed) == ["2026-11-23"]


def test_a_servers_view_counts_ended_and_live_leases_of_other_servers_only():
    q = Quotas(QuotaPolicy(users={"alice": {"gpus": 2, "gpu_hours_per_week": 1}}))
    q.ledger.closed = {"2026-11-23": {"alice": 600.0}}
    leases = [LiveLease("gpu1", "alice", "k1", 1, TUESDAY - 60), LiveLease("gpu2", "alice", "k2", 2, TUESDAY - 30),
              LiveLease("gpu2", "bob", "k3", 1, TUESDAY - 30)]
    view = q.node_view("gpu1", {"alice"}, TUESDAY, leases)
    (lim,) = view["limits"]
    assert lim["used_s"] == 600 + 2 * 30 and lim["held_elsewhere"] == {"k2": 2}  # gpu1's own: the agent's
    st = q.status("alice", TUESDAY, leases)
    assert st["gpu_hours_used"] == pytest.approx((600 + 60 + 60) / 3600, abs=1e-4) and st["gpus_held"] == 3
    q.ledger.add_extra("alice", 2, TUESDAY)
    assert q.status("alice", TUESDAY, leases)["limits"][0]["gpu_hours"] == 3
    line = usage_line(q.status("alice", TUESDAY, leases))
    assert line == "GPU-hours this week: 0.2 of 3 (resets Monday 00:00 UTC); GPUs at once: up to 2"


def lease(user, kernel, gpus, granted_at):
    return Lease("l1", "unit", tuple(range(gpus)), granted_at, user=user, kernel_id=kernel)


def view(limits, extra=None, week="2026-11-23"):
    return {"week": week, "limits": limits, "extra_hours": extra or {}}


def test_the_gate_refuses_past_the_hours_with_the_words_the_notebook_shows():
    gate, meter = QuotaGate(), UsageMeter()
    gate.check("alice", "k1", 1, [], meter, TUESDAY)  # no view yet: never held back
    gate.update(view([{"name": "alice", "kind": "user", "members": ["alice"], "gpus": None, "gpu_hours": 30,
                       "used_s": 29.5 * 3600, "held_elsewhere": {}}]))
    gate.check("alice", "k1", 1, [], meter, TUESDAY)
    meter.record("alice", 1, TUESDAY - 1800, TUESDAY)  # half an hour on this server, not reported yet
    with pytest.raises(QuotaRefused) as err:
        gate.check("alice", "k1", 1, [], meter, TUESDAY)
    assert str(err.value) == "used 30.0 of 30 GPU-hours this week; resets Monday 00:00 UTC"
    assert err.value.limit == "gpu_hours"
    gate.check("bob", "k9", 1, [], meter, TUESDAY)  # not a member: not limited
    gate.update(view(gate.view["limits"], extra={"alice": 1}))
    gate.check("alice", "k1", 1, [], meter, TUESDAY)
    gate.check("alice", "k1", 1, [], meter, TUESDAY + 7 * 86400)  # a new week: hours start from zero


def test_the_gate_counts_a_groups_members_and_other_kernels_only_against_gpus_at_once():
    gate, meter = QuotaGate(), UsageMeter()
    gate.update(view([{"name": "group lab", "kind": "group", "members": ["alice", "bob"], "gpus": 2,
                       "gpu_hours": None, "used_s": 0, "held_elsewhere": {"k2": 1}}]))
    local = [lease("bob", "k3", 1, TUESDAY - 5)]
    with pytest.raises(QuotaRefused) as err:
        gate.check("alice", "k1", 1, local, meter, TUESDAY)
    assert "group lab already holds 2 of its 2 at once in other kernels" in str(err.value)
    gate.check("alice", "k2", 1, local, meter, TUESDAY)  # k2's own grant elsewhere is its last cell's
    with pytest.raises(QuotaRefused, match="asks for 3 GPU"):
        gate.check("alice", "k9", 3, [], meter, TUESDAY)


def test_a_kernel_seen_holding_on_two_servers_counts_once():
    # A replica that lost a cell's election gives its grant back, but its server's last heartbeat may
    # still show it beside the winner's: one kernel, one cell, its GPUs counted once (the CI failure
    # "you already hold 2 of your 1").
    q = Quotas(QuotaPolicy(users={"alice": {"gpus": 1}}))
    leases = [LiveLease("gpu2", "alice", "busy", 1, TUESDAY - 2), LiveLease("gpu3", "alice", "busy", 1, TUESDAY - 1)]
    (lim,) = q.node_view("gpu1", {"alice"}, TUESDAY, leases)["limits"]
    assert lim["held_elsewhere"] == {"busy": 1}
    assert q.status("alice", TUESDAY, leases)["gpus_held"] == 1
    gate, meter = QuotaGate(), UsageMeter()
    gate.update(view([{**lim, "used_s": 0}]))
    with pytest.raises(QuotaRefused) as err:
        gate.check("alice", "other", 1, [lease("alice", "busy", 1, TUESDAY - 2)], meter, TUESDAY)
    assert "you already hold 1 of your 1 at once in other kernels" in str(err.value)


def test_a_new_kernels_limits_are_merged_into_the_view_by_name():
    gate = QuotaGate()
    gate.merge(view([{"name": "alice", "members": ["alice"], "gpus": 1}]))
    gate.merge(view([{"name": "bob", "members": ["bob"], "gpus": 2}], extra={"bob": 1}))
    gate.merge(view([{"name": "alice", "members": ["alice"], "gpus": 3}]))
    assert {lim["name"]: lim["gpus"] for lim in gate.view["limits"]} == {"alice": 3, "bob": 2}
    assert gate.view["extra_hours"] == {"bob": 1}
    gate.merge({"week": 3})
    gate.update("nonsense")
    assert len(gate.view["limits"]) == 2


def test_the_meter_sends_one_batch_until_it_is_acknowledged():
    meter = UsageMeter()
    assert meter.batch() is None
    meter.record("alice", 2, TUESDAY, TUESDAY + 10)
    first = meter.batch()
    meter.record("alice", 1, TUESDAY, TUESDAY + 5)
    assert meter.batch() is first and first["weeks"] == {"2026-11-23": {"alice": 20.0}}  # again, unchanged
    assert meter.unreported_s({"alice"}, "2026-11-23") == 25.0
    meter.acked(first["seq"] - 1)
    assert meter.batch() is first
    meter.acked(first["seq"])
    second = meter.batch()
    assert second["seq"] == first["seq"] + 1 and second["weeks"] == {"2026-11-23": {"alice": 5.0}}
    restored = UsageMeter.from_dict(meter.to_dict())
    assert restored.batch() == second and restored.next_seq >= meter.next_seq


def render_scheduler_toml(tmp_path, **quotas):
    """roles/gpuhub_scheduler/templates/scheduler.toml.j2 as the role renders it, into a file."""
    import json
    from pathlib import Path

    import jinja2
    import yaml

    roles = Path(__file__).parents[2] / "roles"
    role = roles / "gpuhub_scheduler"
    # The base role's cluster-wide defaults (the pool, the quotas), then the scheduler's own.
    values = {**yaml.safe_load((roles / "gpuhub" / "defaults" / "main.yml").read_text()),
              **yaml.safe_load((role / "defaults" / "main.yml").read_text()),
              "ansible_managed": "Ansible managed", "gpuhub_hub_address": "10.0.0.2", "gpuhub_hub_api_port": 8081,
              "gpuhub_scheduler_port": 8600, "gpuhub_tls": True, "gpuhub_profiles": [{"gpus": 0}, {"gpus": 4}],
              **quotas}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters["to_json"] = json.dumps
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).strip().lower() in ("1", "on", "true", "yes")
    text = env.from_string((role / "templates" / "scheduler.toml.j2").read_text()).render(**values)
    out = tmp_path / "scheduler.toml"
    out.write_text(text)
    return out


def test_the_scheduler_file_carries_the_inventorys_limits_and_its_check_names_a_misspelt_key(tmp_path, capsys):
    import tomllib

    from gpuhub.scheduler.quotas import check_file

    good = render_scheduler_toml(tmp_path, gpuhub_quota_default={"gpus": 2, "gpu_hours_per_week": 30},
                                 gpuhub_quota_users={"alice": {"gpus": 4}, "d.o-e": {"gpu_hours_per_week": 1.5}},
                                 gpuhub_quota_groups={"lab": {"members": ["alice", "bob"], "gpus": 6}})
    raw = tomllib.loads(good.read_text())
    policy = QuotaPolicy(raw["quota_default"], raw["quota_groups"], raw["quota_users"])
    assert [(lim.name, lim.gpus, lim.gpu_hours) for lim in policy.limits_for("alice")] == [
        ("alice", 4, None), ("group lab", 6, None)]
    assert policy.limits_for("d.o-e")[0].gpu_hours == 1.5 and check_file(str(good)) == 0
    defaults = tomllib.loads(render_scheduler_toml(tmp_path).read_text())  # the role's defaults: no limits
    assert not [key for key in defaults if key.startswith("quota")]

    typo = render_scheduler_toml(tmp_path, gpuhub_quota_users={"alice": {"gpus": 4, "gpu_hours": 100}})
    assert check_file(str(typo)) == 1
    assert "quota_users.alice: unknown key(s) gpu_hours" in capsys.readouterr().err


def test_limits_a_new_kernel_brought_stay_until_an_answer_covers_its_user():
    gate = QuotaGate()
    alice = {"name": "alice", "kind": "user", "members": ["alice"], "gpus": 1, "gpu_hours": None, "used_s": 0,
             "held_elsewhere": {}}
    bob = {**alice, "name": "bob", "members": ["bob"]}
    gate.update({**view([alice]), "users": ["alice"]}, {"alice"})
    gate.merge(view([bob], extra={"bob": 2}))  # bob's new kernel's unit, before the books list it
    gate.update({**view([alice]), "users": ["alice"]}, {"alice", "bob"})
    assert {lim["name"] for lim in gate.view["limits"]} == {"alice", "bob"} and gate.view["extra_hours"] == {"bob": 2}
    gate.update({**view([alice, {**bob, "gpus": 3}]), "users": ["alice", "bob"]}, {"alice", "bob"})
    assert {lim["name"]: lim["gpus"] for lim in gate.view["limits"]} == {"alice": 1, "bob": 3}
    gate.update({**view([alice]), "users": ["alice"]}, {"alice"})  # bob's kernel ended here
    assert [lim["name"] for lim in gate.view["limits"]] == ["alice"]


@pytest.mark.parametrize("bad", [
    {"gpus": "2"}, {"gpu_hours": "lots"}, {"used_s": None}, {"held_elsewhere": []}, {"held_elsewhere": {"k": "x"}},
    {"members": "alice"},
])
def test_a_malformed_view_is_ignored_not_turned_into_errors(bad):
    gate, meter = QuotaGate(), UsageMeter()
    good = {"name": "alice", "kind": "user", "members": ["alice"], "gpus": 0, "gpu_hours": None, "used_s": 0,
            "held_elsewhere": {}}
    gate.update(view([good]))
    gate.update(view([{**good, **bad}]))
    assert gate.view["limits"] == [good]
    with pytest.raises(QuotaRefused):
        gate.check("alice", "k1", 1, [], meter, TUESDAY)


def test_the_scheduler_file_carries_the_elastic_pool_settings(tmp_path):
    import tomllib

    from gpuhub.scheduler.config import SchedulerConfig

    path = render_scheduler_toml(tmp_path, gpuhub_pool_enabled="yes", gpuhub_pool_min_active=4,
                                 gpuhub_pool_release_command="/usr/local/sbin/gpuhub-power off",
                                 gpuhub_pool_acquire_command='/usr/local/sbin/take "gpu pool"')
    data = tomllib.loads(path.read_text())
    assert data["pool_enabled"] is True and data["pool_min_active"] == 4
    assert data["pool_acquire_command"] == '/usr/local/sbin/take "gpu pool"'
    config = SchedulerConfig(**{k: v for k, v in data.items() if k.startswith("pool_")})
    assert config.pool_problem() is None and config.pool_release_after_s == 180.0
    off = tomllib.loads(render_scheduler_toml(tmp_path).read_text())
    assert off["pool_enabled"] is False and off["pool_release_command"] == ""
