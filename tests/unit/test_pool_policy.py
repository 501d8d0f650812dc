"""The elastic pool's rule (gpuhub/scheduler/pool.py): what it acquires, drains and releases."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhub.scheduler.pool import PoolPlan, PoolPolicy, PoolServer, PoolSettings, PoolSettingsError, RecentRequests


def servers(*specs: tuple) -> list[PoolServer]:
    """(name, state, committed, replicas) with 8 GPUs each; pending: 2 GPUs a replica."""
    return [PoolServer(n, 8, state, committed, 2 * reps, reps) for n, state, committed, reps in specs]


def test_short_of_gpus_it_undrains_first_then_acquires_the_largest_lent_servers():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=0, headroom_gpus=0))
    view = [*servers(("a", "active", 8, 1), ("b", "draining", 0, 1), ("c", "lent", 0, 0)),
            PoolServer("d", 4, "lent"), PoolServer("e", 16, "lent")]
    plan = pool.plan(view, demand_gpus=30, now=0)
    assert plan.undrain == ("b",)
    assert plan.acquire == ("e",)  # 8 + 8 + 16 >= 30: one hook, the largest server
    assert plan.wanted_gpus == 30


def test_a_spare_server_is_kept_for_the_largest_request():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=1))
    view = servers(("a", "active", 6, 3), ("b", "active", 5, 3), ("c", "lent", 0, 0))
    # 5 GPUs idle in all, but no server can grant 4 at once: acquire one
    assert pool.plan(view, demand_gpus=11, now=0, largest_request=4).acquire == ("c",)
    assert not pool.plan(view, demand_gpus=11, now=0, largest_request=3)


def test_a_surplus_drains_the_cheapest_idle_server_only_after_it_lasted():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=1, release_after_s=60))
    view = servers(("a", "active", 4, 5), ("b", "active", 0, 2), ("c", "active", 0, 1), ("d", "active", 0, 0))
    assert not pool.plan(view, 4, now=0)
    assert not pool.plan(view, 4, now=59)
    plan = pool.plan(view, 4, now=60)
    # d and c are idle and hold the fewest replicas; b stays the spare; a has GPUs granted
    assert plan.drain == ("d", "c")
    assert pool.surplus_since is None


def test_a_server_with_gpus_granted_is_never_drained_or_released():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=0, release_after_s=0))
    view = servers(("a", "active", 1, 0), ("b", "active", 1, 0), ("c", "draining", 2, 0))
    plan = pool.plan(view, 0, now=0)
    assert plan.drain == () and plan.release == ()


def test_a_drained_empty_server_is_released_and_a_rising_demand_keeps_it():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=0))
    view = servers(("a", "active", 2, 3), ("b", "draining", 0, 0))
    assert pool.plan(view, 2, now=0).release == ("b",)
    # demand above the active GPUs: the drained server is kept, not released and acquired back
    plan = pool.plan(view, 12, now=0)
    assert plan.undrain == ("b",) and plan.release == ()


def test_min_and_max_active():
    pool = PoolPolicy(PoolSettings(min_active=3, max_active=3, spare_servers=0))
    view = servers(("a", "active", 0, 0), ("b", "lent", 0, 0), ("c", "lent", 0, 0), ("d", "lent", 0, 0))
    assert pool.plan(view, 0, now=0).acquire == ("b", "c")
    full = servers(("a", "active", 8, 0), ("b", "active", 8, 0), ("c", "active", 8, 0), ("d", "lent", 0, 0))
    assert pool.plan(full, 100, now=0).acquire == ()


def test_room_for_the_replicas_placed_under_the_subscription_ratio():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=0, max_subscription_ratio=1.0, replicas=3))
    view = [PoolServer("a", 8, "active", 0, 48, 10), PoolServer("b", 8, "lent")]
    assert pool.wanted_gpus(view, 0) == 16
    assert pool.plan(view, 0, now=0).acquire == ("b",)


def test_the_spare_is_sized_for_recent_cells_only():
    recent = RecentRequests(window_s=600)
    assert recent.largest(0) == 0  # no cell yet: no size to keep a spare for
    recent.note(8, now=100)
    recent.note(1, now=500)
    recent.note(0, now=550)  # a CPU cell asks for nothing
    recent.note(8, now=50)  # an older report of the same size changes nothing
    assert recent.largest(700) == 8
    assert recent.largest(701) == 1  # the whole-server kernel has been idle for the window
    assert recent.largest(1101) == 0

    # What the pool does with it: with 8 recent, an idle whole server stays; once that is old,
    # the spare a 1-GPU cell needs is any server with a GPU idle, and the idle server drains.
    pool = PoolPolicy(PoolSettings(min_active=2, spare_servers=1, release_after_s=0))
    view = servers(("a", "active", 6, 3), ("b", "active", 5, 3), ("c", "active", 0, 0))
    assert not pool.plan(view, demand_gpus=11, now=700, largest_request=recent.largest(700))
    assert pool.plan(view, demand_gpus=11, now=701, largest_request=recent.largest(701)).drain == ("c",)
    # And a whole-server cell that waits again is recent at once: the drained server comes back.
    drained = servers(("a", "active", 6, 3), ("b", "active", 5, 3), ("c", "draining", 0, 0))
    recent.note(8, now=800)
    assert pool.plan(drained, demand_gpus=11, now=800, largest_request=recent.largest(800)).undrain == ("c",)


@pytest.mark.parametrize("bad", [dict(min_active=0), dict(min_active=4, max_active=2), dict(headroom_gpus=-1),
                                 dict(spare_servers=-1), dict(release_after_s=-1), dict(drain_step=0),
                                 dict(spare_recent_s=-1)])
def test_settings_it_cannot_use_are_refused_naming_the_setting(bad):
    with pytest.raises(PoolSettingsError, match="pool_"):
        PoolPolicy(PoolSettings(**bad))


# --- properties -------------------------------------------------------------------------------------

server_specs = st.lists(
    st.tuples(st.sampled_from(["active", "draining", "lent", "acquiring", "lost"]),
              st.integers(0, 8), st.integers(0, 6)),
    min_size=1, max_size=12)


def build(specs) -> list[PoolServer]:
    out = []
    for i, (state, committed, reps) in enumerate(specs):
        if state in ("lent", "acquiring"):
            committed, reps = 0, 0
        out.append(PoolServer(f"s{i:02d}", 8, state, committed, reps * 2, reps))
    return out


def check_plan(view: list[PoolServer], plan: PoolPlan) -> None:
    state = {v.name: v for v in view}
    named = [*plan.acquire, *plan.undrain, *plan.drain, *plan.release]
    assert len(named) == len(set(named)), "a server in two actions"
    assert all(state[n].state == "lent" for n in plan.acquire)
    assert all(state[n].state == "draining" for n in plan.undrain)
    assert all(state[n].state == "active" and state[n].committed == 0 for n in plan.drain)
    assert all(state[n].state == "draining" and state[n].committed == 0 and state[n].replicas == 0
               for n in plan.release)


def apply(view: list[PoolServer], plan: PoolPlan) -> list[PoolServer]:
    """The plan done, and the drains finished (their replicas went elsewhere), as the scheduler does."""
    new = {"acquire": "active", "undrain": "active", "drain": "draining", "release": "lent"}
    out = []
    for v in view:
        for action, to in new.items():
            if v.name in getattr(plan, action):
                v = replace(v, state=to)
        if v.state == "draining":
            v = replace(v, replicas=0, pending=0)
        if v.state in ("lent",):
            v = replace(v, committed=0, replicas=0, pending=0)
        out.append(v)
    return out


@settings(max_examples=300, deadline=None)
@given(server_specs, st.integers(0, 80), st.integers(1, 4), st.integers(0, 2), st.integers(0, 16),
       st.sampled_from([None, 1, 4, 8]))
def test_plans_are_consistent_and_consolidation_terminates(specs, demand, min_active, spare, headroom, largest):
    pool = PoolPolicy(PoolSettings(min_active=min_active, spare_servers=spare, headroom_gpus=headroom,
                                   release_after_s=0))
    view = build(specs)
    seen = []
    for _ in range(40):
        plan = pool.plan(view, demand, now=0, largest_request=largest)
        check_plan(view, plan)
        if not plan:
            break
        seen.append(plan)
        view = apply(view, plan)
    else:
        pytest.fail(f"the pool never settled: {seen[-4:]}")
    usable = [v for v in view if v.state != "lost"]
    active = [v for v in usable if v.state in ("active", "acquiring")]
    # settled: the minimum is kept whenever there are servers for it
    assert len(active) >= min(min_active, len(usable))


def test_a_server_too_subscribed_to_take_a_replica_is_no_spare():
    # b has 8 idle GPUs, but its replicas fill it to the subscription ratio: no kernel can move there
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=1, max_subscription_ratio=1.0, replicas=3))
    view = [PoolServer("a", 8, "active", 8, 0, 0), PoolServer("b", 8, "active", 0, 20, 10),
            PoolServer("c", 8, "lent")]
    assert pool.plan(view, 8, now=0, largest_request=8).acquire == ("c",)
    roomy = [view[0], replace(view[1], pending=16), view[2]]
    assert not pool.plan(roomy, 8, now=0, largest_request=8).acquire


def test_the_lent_servers_may_come_apart_from_the_others_in_the_order_to_acquire():
    pool = PoolPolicy(PoolSettings(min_active=1, spare_servers=0))
    active = [PoolServer("a", 8, "active", 8, 0, 0)]
    lent = [PoolServer("z", 8, "lent"), PoolServer("b", 8, "lent")]
    assert pool.plan(active, 12, now=0, lent=lent).acquire == ("z",)  # the caller's order
    assert pool.plan([*active, *lent], 12, now=0).acquire == ("b",)  # else largest, then by name
