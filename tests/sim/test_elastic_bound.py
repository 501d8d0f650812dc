"""bench/elastic_bound.py: the clairvoyant lower bound on provisioned / reserved must be below what
the real pool achieves on the same trace, and consistent with itself."""

from bench.elastic_bound import bounds_for, pool_ratio
from gpuhub.sim.generate import GenConfig, generate


def test_the_bound_is_below_the_pool_and_each_relaxation_lowers_it():
    trace = generate(GenConfig(seed=1))
    b = bounds_for(trace)
    r = pool_ratio(trace)
    pool = r.gpu_hours_provisioned / r.gpu_hours_reserved
    for f in (3, 0):
        # no acquire lead <= with it; the delay slack only lowers it
        assert 0 < b[f"phys{f}"] <= b[f"lead{f}"], b
        assert b[f"guar{f}"] <= b[f"lead{f}"], b
        # the pool's spare rule, even idealised, keeps at least what the running cells need
        assert b[f"phys{f}"] <= b[f"spare{f}"], b
    assert b["lead0"] < b["lead3"] < pool, (b, pool)
    assert b["guar3"] <= pool
