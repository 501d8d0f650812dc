"""Placement: distinct nodes, capacity-aware, subscription-ratio admission, least-loaded first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuhub.scheduler.placement import NodeView, PlacementError, place_replicas


def test_least_loaded_first_and_distinct():
    nodes = [NodeView("a", 2, 0, 2), NodeView("b", 2, 0, 0), NodeView("c", 2, 6, 1), NodeView("d", 2, 0, 1)]
    chosen = place_replicas(nodes, gpus=1, replicas=3, max_subscription_ratio=7.0)
    assert [n.name for n in chosen] == ["b", "d", "c"]


def test_admission_by_subscription_ratio():
    nodes = [NodeView("a", 1, 3, 0), NodeView("b", 1, 0, 0)]
    with pytest.raises(PlacementError, match="subscription ratio"):
        place_replicas(nodes, gpus=1, replicas=2, max_subscription_ratio=1.0)
    assert [n.name for n in place_replicas(nodes, 1, 1, 1.0)] == ["b"]


def test_too_big_and_dead_nodes_are_skipped():
    nodes = [NodeView("a", 2, 0, 0), NodeView("b", 8, 0, 0, schedulable=False)]
    with pytest.raises(PlacementError, match="at least 4"):
        place_replicas(nodes, gpus=4, replicas=1, max_subscription_ratio=7.0)


def test_a_replacement_avoids_the_kernels_nodes_and_counts_its_replicas_in_the_ratio():
    nodes = [NodeView("a", 1, 0, 0), NodeView("b", 1, 0, 0), NodeView("c", 1, 0, 0), NodeView("d", 1, 2, 1)]
    chosen = place_replicas(nodes, 1, 3, 7.0, exclude=["a", "b", "c"], count=1)
    assert [n.name for n in chosen] == ["d"]
    # d already holds 2 pending GPUs: (2 + 1) / (1 GPU * 3 replicas) = 1.0 is admitted, 0.9 is not
    with pytest.raises(PlacementError, match="cannot place 1 replica"):
        place_replicas(nodes, 1, 3, 0.9, exclude=["a", "b", "c"], count=1)


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 30), st.integers(0, 8), st.booleans()), max_size=10),
       st.integers(0, 8), st.integers(1, 4), st.floats(0.5, 10))
def test_placement_invariants(raw, gpus, replicas, ratio):
    nodes = [NodeView(f"n{i}", g, p, min(c, g), s) for i, (g, p, c, s) in enumerate(raw)]
    try:
        chosen = place_replicas(nodes, gpus, replicas, ratio)
    except PlacementError:
        return
    assert len(chosen) == replicas == len({n.name for n in chosen})
    for n in chosen:
        assert n.schedulable and n.gpu_count >= gpus
        assert gpus == 0 or n.ratio_after(gpus, replicas) <= ratio
