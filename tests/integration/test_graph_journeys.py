"""Random object graphs keep their values and every ``is`` relation on their whole journey through
a replicated GPU kernel, as they would in a plain kernel's namespace: made in a cell's child
process, pickled into the cell's image, loaded by the replica that ran the cell (whose next child
sees them), loaded by a follower from the log, and used there when the follower becomes the
executor. (tests/unit/test_image.py checks the same property in-process over many more graphs.)"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from gpuhub.dev.cluster import DevCluster
from gpuhub.kernel import image as images
from tests.integration.test_replicated import ReplicatedKernel, executor_node, ok, take_the_gpu
from tests.unit.test_image import graphs

# The graph's fingerprint, computed the same way here and inside the kernel: each name's value as
# nested lists, a container or array met again written as a reference to where it was first met
# (so aliasing and cycles are part of it), and which arrays share memory (views of one base).
FINGERPRINT = '''
def _gpuhub_fingerprint(ns):
    import json
    import numpy as np
    seen, arrays = {}, []

    def canon(v):
        if isinstance(v, (list, tuple, dict, np.ndarray)):
            if id(v) in seen:
                return ["@", seen[id(v)]]
            seen[id(v)] = len(seen)
        if isinstance(v, np.ndarray):
            arrays.append((seen[id(v)], v))
            return ["nd", str(v.dtype), v.tolist()]
        if isinstance(v, list):
            return ["l", [canon(x) for x in v]]
        if isinstance(v, tuple):
            return ["t", [canon(x) for x in v]]
        if isinstance(v, dict):
            return ["d", [[k, canon(x)] for k, x in v.items()]]
        return [type(v).__name__, repr(v)]

    values = {name: canon(ns[name]) for name in sorted(ns)}
    shared = [[i, j] for n, (i, a) in enumerate(arrays) for j, b in arrays[n + 1:]
              if a.size and b.size and np.shares_memory(a, b)]
    return json.dumps([values, shared])
'''
_scope: dict = {}
exec(FINGERPRINT, _scope)  # the test's own source, run here as in the kernel
fingerprint = _scope["_gpuhub_fingerprint"]

# Replaces the last example's names with the new graph (image.load: views stay views on the way in).
LOAD = """import base64 as _b64, re as _re
from gpuhub.kernel import image as _gi
for _n in [n for n in globals() if _re.fullmatch(r"v\\d+", n)]:
    del globals()[_n]
globals().update(_gi.load(_b64.b64decode({stream!r}), []))"""
SHOW = "print(_gpuhub_fingerprint({n: globals()[n] for n in globals() if __import__('re').fullmatch(r'v\\d+', n)}))"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = DevCluster(tmp_path_factory.mktemp("graphs"), nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gpu_kernel(cluster):
    k = ReplicatedKernel(cluster, gpus=1)
    ok(k, FINGERPRINT)
    yield k
    k.close()


_hogs = [0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ns=graphs())
def test_random_graphs_survive_child_parent_follower_and_a_new_executor(gpu_kernel, cluster, ns):
    expected = fingerprint(ns)
    cap = images.capture(ns, set())
    assert not cap.buffers  # small arrays: the whole graph is in the stream
    ok(gpu_kernel, LOAD.format(stream=base64.b64encode(cap.stream).decode()))
    here = executor_node(gpu_kernel)
    # the next child of the same replica starts from the image its parent loaded
    assert json.loads(ok(gpu_kernel, SHOW)["stdout"]) == json.loads(expected)
    # the executor's GPU is taken: a follower, which loaded the image from the log, runs the cell
    _hogs[0] += 1
    agent = cluster.agent(here)
    token, lease_id = take_the_gpu(agent, f"graph-hog{_hogs[0]}")
    try:
        got = ok(gpu_kernel, SHOW, timeout=60)["stdout"]
        assert executor_node(gpu_kernel) != here
    finally:
        agent.call("DELETE", f"/api/v1/leases/{lease_id}", token=token)
    assert json.loads(got) == json.loads(expected)


def test_the_fingerprint_sees_aliasing_and_views():
    """The test above could not fail if the fingerprint ignored sharing: it does not."""
    a = np.arange(6)
    s = [1]
    assert fingerprint({"x": s, "y": s}) != fingerprint({"x": [1], "y": [1]})
    assert fingerprint({"a": a, "v": a[1::2]}) != fingerprint({"a": a, "v": a[1::2].copy()})
