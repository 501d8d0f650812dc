"""Outputs are pickled once, by the cell that made them, and carried by reference in later images,
keeping every ``is`` relation with the rest of the namespace (gpuhub/kernel/sealed_outputs.py)."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from gpuhub.kernel import image as images
from gpuhub.kernel import sealed_outputs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen


@pytest.fixture(autouse=True)
def new_session():
    sealed_outputs.reset()
    yield
    sealed_outputs.reset()
    plt.close("all")


def load(cap: images.Capture, namespace: dict | None = None) -> dict:
    got = images.load(cap.stream, [memoryview(bytearray(b)) for b in cap.buffers], namespace)
    got.pop(images.PROCESS)
    return got


def count_seals(monkeypatch) -> list:
    made: list = []
    real = images._dump_alone

    def spy(value, *args, **kw):
        made.append(value)
        return real(value, *args, **kw)

    monkeypatch.setattr(images, "_dump_alone", spy)
    return made


def notebook(outputs: dict, **names) -> dict:
    """A namespace as IPython leaves it: ``Out``, and ``_N`` and ``_`` bound to the last result."""
    ns = {**names, "Out": outputs}
    for n, value in outputs.items():
        ns[f"_{n}"] = value
    if outputs:
        ns["_"] = outputs[max(outputs)]
    return ns


def test_an_output_is_pickled_once_and_keeps_what_it_shares_with_the_namespace(monkeypatch):
    made = count_seals(monkeypatch)
    shared = {"k": [1, 2]}
    ns = notebook({1: [shared, "own"], 2: shared, 3: (6 * 7, "answer")}, s=shared)
    images.capture(ns, set())
    assert len(made) == 3  # Out[2], a name's value, seals as a reference to it
    second, third = images.capture(ns, set()), images.capture(ns, set())
    assert len(made) == 3 and third.stream == second.stream  # nothing pickled again, nothing new to commit
    got = load(second)
    assert got["Out"][1] == [shared, "own"] and got["Out"][3] == (42, "answer")
    assert got["Out"][1][0] is got["s"] and got["Out"][2] is got["s"]
    assert got["_1"] is got["Out"][1] and got["_"] is got["Out"][3] and got["_3"] is got["Out"][3]


def test_a_replica_that_loaded_the_image_carries_the_same_sealed_streams_on(monkeypatch):
    big = [list(range(2000)) for _ in range(4)]  # a stream large enough to leave as a blob of its own
    ns = notebook({1: big, 2: "small"}, x=1)
    cap = images.capture(ns, set())
    assert len(cap.buffers) == 1 and cap.digests[0] is not None  # its digest is the seal's: never hashed again
    made = count_seals(monkeypatch)
    other: dict = {"Out": {}}
    images.install(other, set(), images.load(cap.stream, [memoryview(bytearray(b)) for b in cap.buffers], other))
    other["y"] = 2  # the next cell, on the replica that took over
    again = images.capture(other, set())
    assert made == [] and again.digests == cap.digests
    assert load(again)["Out"][1] == big


def deferred_load(cap: images.Capture) -> tuple[dict, dict]:
    """A replica's load (outputs left pending) into a namespace of its own, and its hidden part."""
    ns: dict = {"Out": {}}
    hidden: dict = {}
    buffers = [memoryview(bytearray(b)) for b in cap.buffers]
    images.install(ns, hidden, images.load(cap.stream, buffers, ns, defer_outputs=True))
    return ns, hidden


def test_a_replicas_load_leaves_outputs_pending_and_carries_them_until_they_are_read(monkeypatch):
    shared = {"k": [1, 2]}
    ns = notebook({1: [shared, "own"], 2: (6 * 7, "answer")}, s=shared)
    cap = images.capture(ns, set())
    built = []
    real = sealed_outputs._build
    monkeypatch.setattr(sealed_outputs, "_build", lambda *a: built.append(a) or real(*a))
    other, hidden = deferred_load(cap)
    assert built == [] and type(other["Out"][1]) is sealed_outputs.Pending and other["_1"] is other["Out"][1]
    other["y"] = 2  # a cell ran elsewhere: this replica's next image carries the outputs unbuilt
    made = count_seals(monkeypatch)
    again = load(images.capture(other, set()))
    assert made == [] and again["Out"][1] == [shared, "own"] and again["Out"][1][0] is again["s"]
    built.clear()
    images.build_outputs(other, hidden)
    assert len(built) == 2  # once each, though three names hold the last
    assert other["Out"] == {1: [shared, "own"], 2: (42, "answer")} and other["Out"][1][0] is other["s"]
    assert other["_1"] is other["Out"][1] and other["_"] is other["Out"][2] and other["_2"] is other["Out"][2]
    assert sealed_outputs.seal_of(other["Out"][1]) is not None  # still carried by its stream
    images.build_outputs(other, hidden)
    assert len(built) == 2


def test_a_pending_output_pickled_once_sealing_ended_loads_as_its_value():
    shared = [1]
    other, _ = deferred_load(images.capture(notebook({1: {"held": shared}}, s=shared), set()))
    sealed_outputs.disable()  # (a cell elsewhere reached Out; this replica loads that image next)
    got = load(images.capture(other, set()))
    assert got["Out"][1] == {"held": [1]} and got["Out"][1]["held"] is got["s"]


def test_an_output_that_cannot_be_built_is_left_out_and_the_rest_kept():
    other, hidden = deferred_load(images.capture(notebook({1: ["first"], 2: ["second"]}), set()))
    other["Out"][1].stream = b"not a pickle"
    images.build_outputs(other, hidden)
    assert other["Out"] == {2: ["second"]} and "_1" not in other and other["_"] == ["second"]


def test_outputs_sealed_in_one_capture_are_all_sealed_though_their_pickles_reuse_ids():
    """A replica that took over seals every output in one capture. Each output's pickle ends before
    the next starts, so the next reuses its temporaries' ids: not objects the two share."""
    import pandas as pd

    df = pd.DataFrame({"a": np.arange(100), "b": np.arange(100) / 3})
    ns = notebook({n: df.head() for n in range(1, 31)}, df=df)
    images.capture(ns, set())
    assert [n for n, v in ns["Out"].items() if sealed_outputs.seal_of(v) is None] == []


def test_a_cell_that_names_the_output_history_ends_sealing_and_its_changes_replicate():
    ns = notebook({1: [1, 2]})
    images.capture(ns, set())
    code = "Out[1].append(3)"
    sealed_outputs.note_cell(code)
    exec(code, {}, ns)
    cap = images.capture(ns, set())
    assert not sealed_outputs.enabled()
    assert load(cap)["Out"][1] == [1, 2, 3]
    # ... and a replica that loads that image does not seal either (it may run the next cell)
    sealed_outputs.reset()
    images.install({"Out": {}}, set(), images.load(cap.stream, []))
    assert not sealed_outputs.enabled()


def test_two_outputs_that_share_an_object_only_between_them_keep_sharing_it():
    """A replica that took over has not tried the outputs before: several are sealed in one capture."""
    only_theirs = [1]
    ns = notebook({1: only_theirs, 2: {"again": only_theirs}})
    got = load(images.capture(ns, set()))
    assert got["Out"][2]["again"] is got["Out"][1]


def test_outputs_holding_large_arrays_or_open_figures_go_with_the_namespace(monkeypatch):
    _, ax = plt.subplots()
    lines = ax.plot([1, 2])  # the figure stays open: pyplot hands it back to later cells
    ns = notebook({1: np.ones(1 << 18), 2: lines})
    cap = images.capture(ns, set())
    assert sealed_outputs.seal_of(ns["Out"][1]) is None and sealed_outputs.seal_of(lines) is None
    got = load(cap)
    assert (got["Out"][1] == 1).all() and got["Out"][2][0].get_ydata().tolist() == [1, 2]


def test_a_closed_figures_output_is_sealed_and_an_unchanged_figure_gives_the_same_stream():
    lines = plt.plot([3, 1, 2])
    plt.close("all")  # as the inline backend closes figures after each cell
    fig, ax = plt.subplots()  # a figure kept in a name: pickled with the namespace, every cell
    ns = notebook({1: lines}, fig=fig)
    counter = repr(ax.callbacks._cid_gen)
    first = images.capture(ns, set())
    assert sealed_outputs.seal_of(lines) is not None
    assert images.capture(ns, set()).stream == images.capture(ns, set()).stream  # pickling no longer changes it
    assert repr(ax.callbacks._cid_gen) == counter
    got = load(first)
    assert got["Out"][1][0].get_ydata().tolist() == [3, 1, 2]
    assert got["fig"].axes[0].callbacks.connect("xlim_changed", print) == ax.callbacks.connect("xlim_changed", print)


@pytest.mark.parametrize(("code", "reaches"), [
    ("x = 1", False),
    ("for _ in range(3):\n    pass\na, _ = 1, 2\ndel _", False),
    ("df.head()", False),
    ("print(_)", True),
    ("Out[3].append(1)", True),
    ("_12.x = 1", True),
    ("__", True),
    ("def later():\n    return Out[1]", True),
    ("globals()['y'] = 1", True),
    ("eval('1')", True),
    ("import __main__", True),
    ("get_ipython().user_ns", True),
    ("shell.user_ns['Out']", True),
    ("%matplotlib inline\nx = 2", False),
    ("%config InlineBackend.figure_format = 'svg'", False),
    ("%timeit -n1 x + 1", False),
    ("%timeit -n1 Out[1]", True),
    ("%%time\ny = 2", False),
    ("%%time\ny = _", True),
    ("!ls {x}", False),
    ("files = !ls", False),
    ("x?", False),
    ("%run script.py", True),
    ("x = (", False),  # does not compile: runs nothing
])
def test_which_cells_could_reach_the_output_history(code, reaches):
    assert sealed_outputs.may_reach_outputs(code) is reaches
