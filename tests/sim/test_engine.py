import pytest

from gpuhub.sim.engine import SimConfig, SimError, default_nodes, percentile, simulate
from gpuhub.sim.trace import Session, Trace


def T(*sessions):
    return Trace(
        [Session(sid, s, e, g, list(cells)) for sid, s, e, g, cells in sessions]
    )


def run(trace, **kw):
    return simulate(trace, SimConfig(**kw))


def test_reservation_gpu_hours_exact():
    tr = T(
        ("a", 0, 3600, 2, [(0, 600, 2)]),
        ("b", 1800, 9000, 1, [(2000, 100, 1), (3000, 50, 0)]),
    )
    r = run(tr, policy="reservation", nodes=2, gpus_per_node=2)
    assert r.gpu_hours_reserved == pytest.approx(2 * 1 + 1 * 2)
    assert r.gpu_hours_committed == pytest.approx(4.0)
    assert r.gpu_hours_busy == pytest.approx((2 * 600 + 100) / 3600)
    assert r.gpu_hours_saved_vs_reservation == 0.0
    assert r.delay_max_s == 0.0 and r.cells == 3
    assert r.gpu_hours_provisioned == pytest.approx(2 * 2 * 9000 / 3600)


@pytest.mark.parametrize("policy", ["reservation", "batch", "gpuhub"])
def test_free_gpu_means_zero_delay(policy):
    tr = T(("a", 0, 1000, 1, [(10, 100, 1), (500, 20, 1)]))
    r = run(tr, policy=policy, nodes=3, gpus_per_node=1, batch_start_cost_s=0.0)
    assert r.delay_p99_s == 0.0 and r.frac_started_within_1s == 1.0
    if policy != "reservation":
        assert r.gpu_hours_committed == pytest.approx(120 / 3600)
        assert r.gpu_hours_saved_vs_reservation == pytest.approx((1000 - 120) / 3600)


def test_gpuhub_full_cluster_delay_equals_wait():
    # one node, one GPU, one replica: b's cell waits until a's cell ends at 100
    tr = T(("a", 0, 1000, 1, [(0, 100, 1)]), ("b", 0, 1000, 1, [(10, 50, 1)]))
    r = run(tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1)
    assert sorted(r.delays) == [0.0, 90.0]
    assert r.gpu_hours_committed == pytest.approx(150 / 3600)


def test_gpuhub_waits_for_any_replica_node():
    # 3 nodes x 1 GPU, R=3: three long cells fill the cluster; the fourth waits for the first to end
    cells = [(f"s{i}", 0, 1000, 1, [(i, 100 + 10 * i, 1)]) for i in range(3)]
    tr = T(*cells, ("late", 0, 1000, 1, [(5, 10, 1)]))
    r = run(tr, policy="gpuhub", nodes=3, gpus_per_node=1, replicas=3)
    assert sorted(r.delays) == [
        0.0,
        0.0,
        0.0,
        95.0,
    ]  # s0's cell ends at 100, submitted at 5


def test_a_gpu_kernels_cell_that_uses_no_gpu_still_takes_them_as_the_product_does():
    """A GPU kernel cannot know beforehand that a cell will not touch a GPU: each cell takes the
    kernel's GPUs. Busy hours stay what the cells use; committed counts what they held."""
    tr = T(
        ("a", 0, 1000, 1, [(0, 500, 1)]), ("b", 0, 1000, 1, [(10, 5, 0), (20, 5, 1)])
    )
    r = run(tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1)
    assert sorted(r.delays) == [0.0, 485.0, 490.0]  # b's CPU-only cell waits for the GPU a holds, then its next
    assert r.gpu_hours_busy == pytest.approx(505 / 3600)
    assert r.gpu_hours_committed == pytest.approx(510 / 3600)


def test_gpuhub_cpu_cells_never_wait_when_cells_take_only_the_gpus_they_use():
    tr = T(
        ("a", 0, 1000, 1, [(0, 500, 1)]), ("b", 0, 1000, 1, [(10, 5, 0), (20, 5, 1)])
    )
    r = run(tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1, cells_take_kernel_gpus=False)
    assert sorted(r.delays) == [0.0, 0.0, 480.0]
    # a CPU kernel's cells never take a GPU, whatever the setting
    tr = T(("a", 0, 1000, 1, [(0, 500, 1)]), ("c", 0, 1000, 0, [(10, 5, 0)]))
    assert sorted(run(tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1).delays) == [0.0, 0.0]


def test_batch_delay_is_wait_plus_start_cost():
    tr = T(("a", 0, 1000, 1, [(0, 100, 1)]), ("b", 0, 1000, 1, [(10, 50, 1)]))
    r = run(tr, policy="batch", nodes=1, gpus_per_node=1, batch_start_cost_s=5.0)
    # a: holds 0..105 (5 s start, 100 s run); b: waits to 105, starts running at 110
    assert sorted(r.delays) == [5.0, 100.0]
    assert r.gpu_hours_committed == pytest.approx((105 + 55) / 3600)


def test_batch_fifo_head_blocks():
    # 2 GPUs: a holds 1 until 100; b wants 2 (waits); c wants 1 and could fit, but FIFO keeps it behind b
    tr = T(
        ("a", 0, 900, 1, [(0, 100, 1)]),
        ("b", 0, 900, 2, [(1, 10, 2)]),
        ("c", 0, 900, 1, [(2, 10, 1)]),
    )
    r = run(tr, policy="batch", nodes=1, gpus_per_node=2, batch_start_cost_s=0.0)
    assert sorted(r.delays) == [0.0, 99.0, 108.0]


def test_cells_of_a_session_run_one_at_a_time():
    tr = T(("a", 0, 1000, 0, [(0, 100, 0), (10, 10, 0)]))
    r = run(tr, policy="gpuhub", nodes=3)
    assert sorted(r.delays) == [0.0, 90.0]


def test_closed_loop_keeps_think_time():
    # b's first cell waits 90 s for a's GPU; in closed loop b's second cell comes 20 s (the trace's think
    # time) after the first actually ended, so it does not wait; in open loop it queues behind the first
    tr = T(
        ("a", 0, 1000, 1, [(0, 100, 1)]), ("b", 0, 1000, 1, [(10, 10, 1), (40, 10, 1)])
    )
    closed = run(
        tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1, closed_loop=True
    )
    opened = run(tr, policy="gpuhub", nodes=1, gpus_per_node=1, replicas=1)
    assert sorted(closed.delays) == [0.0, 0.0, 90.0]
    assert sorted(opened.delays) == [0.0, 70.0, 90.0]


def test_unplaceable_session_waits_for_placement():
    # SR cap 1/3 with G=1, R=3 admits one 1-GPU kernel per node: b waits until a ends at 100
    tr = T(("a", 0, 100, 1, [(0, 10, 1)]), ("b", 50, 500, 1, [(60, 10, 1)]))
    r = run(tr, policy="gpuhub", nodes=3, gpus_per_node=1, max_subscription_ratio=1 / 3)
    assert r.sessions_waited == 1 and r.session_wait_max_s == pytest.approx(50.0)
    assert sorted(r.delays) == [0.0, 40.0]


def test_reservation_session_queues_when_full():
    tr = T(("a", 0, 100, 1, [(0, 10, 1)]), ("b", 50, 500, 1, [(60, 10, 1)]))
    r = run(tr, policy="reservation", nodes=1, gpus_per_node=1)
    assert sorted(r.delays) == [0.0, 40.0]
    assert r.gpu_hours_committed == pytest.approx((100 + 400) / 3600)


def test_errors():
    tr = T(("a", 0, 100, 8, [(0, 10, 8)]))
    with pytest.raises(SimError, match="8 GPUs but nodes have 4"):
        run(tr, gpus_per_node=4)
    with pytest.raises(SimError, match="at least 3 nodes"):
        run(tr, nodes=2)
    with pytest.raises(SimError, match="never got"):
        run(tr, nodes=3, max_subscription_ratio=0.1)
    with pytest.raises(SimError, match="unknown policy"):
        run(tr, policy="magic")


def test_autoscale_follows_demand_and_scales_in():
    # a burst of GPU work in the first hour, then only idle sessions
    sessions = [(f"s{i}", 0, 20000, 8, [(0, 3000, 8)]) for i in range(6)]
    sessions += [(f"late{i}", 10000, 20000, 1, [(10000, 60, 1)]) for i in range(2)]
    tr = T(*sessions)
    fixed = run(tr, policy="batch", nodes=12, batch_start_cost_s=0.0)
    auto = run(
        tr,
        policy="batch",
        nodes=12,
        autoscale=True,
        batch_start_cost_s=0.0,
        record_timeline=True,
    )
    assert auto.peak_active_nodes <= 12 and auto.scale_outs > 0 and auto.scale_ins > 0
    assert auto.gpu_hours_provisioned < fixed.gpu_hours_provisioned
    assert auto.cells == fixed.cells == 8
    for _, held, active in auto.timeline:
        assert held <= active * 8


def test_default_nodes_fit_the_reservation_peak():
    tr = T(("a", 0, 100, 8, []), ("b", 50, 150, 4, []), ("c", 120, 200, 8, []))
    assert default_nodes(tr, 8, 3) == 2 + 3


def test_percentile_nearest_rank():
    xs = list(range(1, 101))
    assert (
        percentile(xs, 50) == 50
        and percentile(xs, 95) == 95
        and percentile(xs, 100) == 100
    )
    assert percentile([], 50) == 0.0


# --- the elastic pool (--elastic): the product's pool rule, gpuhub/scheduler/pool.py -----------------

def _day_and_night():
    """Busy hours (four whole-server cells at once), then a long idle night, then one more cell."""
    busy = [(f"b{i}", 0, 20000, 8, [(10, 3600, 8)]) for i in range(4)]
    late = [("late", 0, 20000, 2, [(3700 + 1800, 60, 2), (15000, 60, 2)])]
    return T(*busy, *late)


def test_elastic_acquires_for_demand_releases_after_and_counts_what_was_on():
    from gpuhub.scheduler.pool import PoolSettings

    tr = _day_and_night()
    pool = PoolSettings(min_active=3, spare_servers=1, release_after_s=300)
    r = run(tr, policy="gpuhub", nodes=8, gpus_per_node=8, elastic=True, pool=pool, acquire_s=30.0)
    fixed = run(tr, policy="gpuhub", nodes=8, gpus_per_node=8)
    assert r.cells == 6 and r.cells_over_grant_timeout == 0
    assert r.servers_acquired >= 2 and r.servers_released >= 2
    # four 8-GPU cells at once on 3 active servers: the fourth waits for an acquired server
    assert 30.0 <= r.delay_max_s <= 30.0 + 10.0 + 5.0
    # the night is spent on the minimum, not on 8 servers
    assert r.gpu_hours_provisioned < fixed.gpu_hours_provisioned / 2
    assert r.gpu_hours_saved_provisioned == pytest.approx(r.gpu_hours_reserved - r.gpu_hours_provisioned)
    # whole servers: the 2-GPU cells count 8 GPUs each
    assert r.gpu_hours_physical_limit == pytest.approx(32 + 2 * 8 * 60 / 3600)
    # every replica of a drained server moved where placement put it; nothing lost or doubled
    assert r.replica_moves >= 0 and r.migrations >= 1


def test_elastic_never_releases_a_server_whose_cell_runs():
    from gpuhub.scheduler.pool import PoolSettings

    # one long cell on one server; the others idle: the pool shrinks to the minimum around it
    tr = T(("long", 0, 10000, 4, [(0, 9000, 4)]), ("idle", 0, 10000, 1, [(9500, 10, 1)]))
    r = run(tr, policy="gpuhub", nodes=6, gpus_per_node=8, elastic=True,
            pool=PoolSettings(min_active=3, spare_servers=0, release_after_s=0))
    assert r.delays[0] == 0.0 and r.cells_over_grant_timeout == 0
    assert r.servers_released == 0  # it starts with the minimum, which it keeps
    assert r.gpu_hours_provisioned == pytest.approx(3 * 8 * 10000 / 3600)


def test_elastic_moves_the_replica_of_a_running_cpu_cell_only_once_it_ended():
    """The product's drain waits for a CPU cell as for a GPU one (gpuhub/platform/move_fence.py)."""
    from gpuhub.scheduler.pool import PoolSettings

    # b and the CPU kernel share the first server; a moves to a second one for its long cell. When
    # b is gone the first server is surplus, but the CPU kernel's cell runs there until 5100.
    tr = T(("b", 0, 1001, 4, [(0, 1000, 4)]), ("cpu", 1, 10000, 0, [(100, 5000, 0)]),
           ("a", 2, 10000, 8, [(2, 8000, 8)]))
    r = run(tr, policy="gpuhub", nodes=4, gpus_per_node=8, replicas=1, elastic=True, record_timeline=True,
            pool=PoolSettings(min_active=1, spare_servers=0, release_after_s=0, replicas=1))
    assert r.servers_released == 1 and r.migrations == 1 and r.cells_over_grant_timeout == 0
    servers_on = {round(t): on for t, _held, on in r.timeline}
    assert servers_on[1000] == 2 and servers_on[5100] == 1  # released when the CPU cell ended
    assert all(on == 2 for t, _held, on in r.timeline if 42 <= t < 5100)


def test_elastic_refuses_what_it_cannot_run():
    tr = T(("a", 0, 100, 1, [(0, 10, 1)]))
    with pytest.raises(SimError, match="choose one"):
        run(tr, policy="gpuhub", nodes=3, elastic=True, autoscale=True)
    with pytest.raises(SimError, match="gpuhub"):
        run(tr, policy="batch", nodes=3, elastic=True)
