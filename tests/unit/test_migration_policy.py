"""The migration policy (gpuhub/scheduler/migration.py): which replica moves and where."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhub.scheduler.migration import NoMigrationTarget, plan_move
from gpuhub.scheduler.placement import NodeView


def test_the_most_subscribed_servers_replica_moves_to_the_best_fitting_server_that_can_grant():
    a, b, c = NodeView("a", 2, 6, 2), NodeView("b", 2, 9, 2), NodeView("c", 2, 4, 2)
    nodes = [a, b, c, NodeView("empty", 4, 0, 0), NodeView("half", 4, 3, 2), NodeView("full", 4, 3, 4)]
    moves = plan_move(nodes, [(0, a), (1, b), (2, c)], gpus=2, max_subscription_ratio=7.0)
    assert (moves[0].replica, moves[0].source) == (1, "b")  # b: 9 GPUs of replicas on 2 GPUs
    # "half" leaves no idle GPU over, "empty" would leave two: the empty server stays empty
    assert [m.target.name for m in moves] == ["half", "empty"]


def test_no_server_with_idle_gpus_says_so():
    a = NodeView("a", 1, 1, 1)
    with pytest.raises(NoMigrationTarget, match="no other server has 1 idle GPU"):
        plan_move([a, NodeView("b", 1, 0, 1)], [(0, a)], 1, 7.0)


def test_a_drained_or_overfull_server_takes_nothing():
    a = NodeView("a", 1, 1, 1)
    drained = NodeView("d", 1, 0, 0, schedulable=False)
    crowded = NodeView("c", 1, 3, 0)  # (3 + 1) / (1 GPU x 1 replica) over the ratio 2
    with pytest.raises(NoMigrationTarget, match="subscription ratio 2"):
        plan_move([a, drained, crowded], [(0, a)], 1, 2.0)


def test_a_cpu_cell_never_moves():
    a = NodeView("a", 1, 0, 1)
    with pytest.raises(NoMigrationTarget):
        plan_move([a, NodeView("b", 1, 0, 0)], [(0, a)], 0, 7.0)


node = st.builds(NodeView, st.sampled_from("abcdefgh"), st.integers(0, 8), st.integers(0, 30),
                 st.integers(0, 8), st.booleans())


@given(st.lists(node, min_size=1, max_size=8, unique_by=lambda n: n.name), st.integers(1, 4), st.floats(0.5, 8))
def test_a_target_can_grant_now_holds_no_replica_and_keeps_the_ratio(nodes, gpus, ratio):
    nodes = [NodeView(n.name, n.gpu_count, n.pending, min(n.committed, n.gpu_count), n.schedulable) for n in nodes]
    placed = list(enumerate(nodes[:3]))
    try:
        moves = plan_move(nodes, placed, gpus, ratio)
    except NoMigrationTarget:
        return
    assert moves[0].source in {n.name for _, n in placed}
    for m in moves:
        t = m.target
        assert t.schedulable and t.idle >= gpus and t.name not in {n.name for _, n in placed}
        assert t.ratio_after(gpus, len(placed)) <= ratio
