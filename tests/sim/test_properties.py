"""Invariants over random small traces, for every policy."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhub.sim.engine import SimConfig, as_kernels_run_it, simulate
from gpuhub.sim.trace import Session, Trace

G = 4


@st.composite
def traces(draw):
    n = draw(st.integers(1, 8))
    sessions = []
    for i in range(n):
        start = draw(st.integers(0, 500))
        length = draw(st.integers(0, 2000))
        gpus = draw(st.sampled_from([0, 1, 2, 4]))
        k = draw(st.integers(0, 6))
        submits = sorted(
            draw(st.lists(st.integers(start, start + length), min_size=k, max_size=k))
        )
        cells = [
            (
                float(t),
                float(draw(st.integers(0, 600))),
                draw(st.sampled_from(sorted({0, gpus}))),
            )
            for t in submits
        ]
        sessions.append(
            Session(f"s{i}", float(start), float(start + length), gpus, cells)
        )
    return Trace(sessions)


configs = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["reservation", "batch", "gpuhub"]),
        "nodes": st.integers(3, 6),
        "replicas": st.integers(1, 3),
        "autoscale": st.booleans(),
        "closed_loop": st.booleans(),
        "batch_start_cost_s": st.sampled_from([0.0, 2.5]),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), configs)
def test_invariants(trace, cfg):
    r = simulate(trace, SimConfig(gpus_per_node=G, record_timeline=True, **cfg))
    eps = 1e-9
    # every cell ran, none started before it was submitted
    assert r.cells == trace.cell_count
    assert all(d >= -eps for d in r.delays)
    # committed GPUs never exceed the physical (active) ones
    assert r.peak_committed_gpus <= r.nodes * G
    for _, held, active in r.timeline:
        assert 0 <= held <= active * G
    # GPU-hours: busy <= committed <= provisioned; saved <= reserved - busy
    assert r.gpu_hours_busy <= r.gpu_hours_committed + eps
    assert r.gpu_hours_committed <= r.gpu_hours_provisioned + eps
    assert (
        r.gpu_hours_saved_vs_reservation
        <= r.gpu_hours_reserved - r.gpu_hours_busy + eps
    )
    assert 0.0 <= r.frac_started_within_1s <= r.frac_started_within_10s <= 1.0
    assert r.delay_p50_s <= r.delay_p95_s <= r.delay_p99_s <= r.delay_max_s
    if cfg["policy"] == "gpuhub":
        # GPUs held only while cells run (each of a GPU kernel's cells holds the kernel's GPUs, also
        # one that uses none), and while a replica moves for a cell (SimConfig.migration_s)
        moving_h = r.migrations * 3.0 * G / 3600
        held_h = as_kernels_run_it(trace).busy_gpu_seconds() / 3600
        assert -1e-6 < r.gpu_hours_committed - held_h <= moving_h + 1e-6
    else:
        assert r.migrations == 0
