"""The namespace image keeps one object graph: values and every ``is`` relation survive capture
and load, as they do in a plain kernel's namespace (gpuhub/kernel/image.py)."""

from __future__ import annotations

import functools
import sys
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhub.kernel import image as images

HIDDEN = {"In", "_ih", "_oh", "_dh", "exit", "quit", "get_ipython"}


def roundtrip(ns: dict, *, min_buffer: int = images.BUFFER_MIN_BYTES) -> tuple[dict, images.Capture]:
    cap = images.capture(ns, HIDDEN, min_buffer=min_buffer)
    # a receiver gets fresh, writable memory for each out-of-band buffer, as a replica does
    buffers = [memoryview(bytearray(b)) for b in cap.buffers]
    loaded = images.load(cap.stream, buffers)
    assert "cwd" in loaded.pop(images.PROCESS)  # beside the names: gpuhub/kernel/process_state.py
    return loaded, cap


def stream_size_without_values() -> int:
    """An image's stream holds the process's state beside the names (the random generators'
    among it: some KB once NumPy or PyTorch is imported); a large value adds only its reference."""
    return len(images.capture({}, HIDDEN).stream)


def identity_shape(ns: dict) -> tuple:
    """Which (name, path) pairs reach the same object, and which arrays share memory (views): the
    graph's aliasing, comparable across copies."""
    seen: dict[int, str] = {}
    pairs = []
    arrays: list[tuple[str, np.ndarray]] = []

    def walk(value, path: str, depth: int) -> None:
        if isinstance(value, (int, float, str, bytes, bool, type(None))) or depth > 6:
            return
        first = seen.setdefault(id(value), path)
        if first != path:
            pairs.append((path, first))
            return
        if isinstance(value, np.ndarray):
            arrays.append((path, value))
        if isinstance(value, dict):
            for k in sorted(value, key=repr):
                walk(value[k], f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", depth + 1)

    for name in sorted(ns):
        walk(ns[name], name, 0)
    shared = [(p, q) for i, (p, a) in enumerate(arrays) for q, b in arrays[i + 1:]
              if a.size and b.size and np.shares_memory(a, b)]
    return tuple(pairs), tuple(shared)


def test_two_names_for_one_object_stay_one_object():
    s = [1, 2]
    ns = {"s": s, "holder": {"a": s, "b": s}, "t": (s,)}
    got, _ = roundtrip(ns)
    assert got["holder"]["a"] is got["s"] and got["holder"]["b"] is got["s"] and got["t"][0] is got["s"]
    got["s"].append(3)
    assert got["holder"]["a"] == [1, 2, 3]


def test_an_optimizer_like_object_keeps_updating_its_model():
    class Model:
        def __init__(self):
            self.weights = np.zeros(4)

    class Optimizer:
        def __init__(self, params):
            self.params = params

        def step(self):
            for p in self.params:
                p += 1

    model = Model()
    got, _ = roundtrip({"model": model, "opt": Optimizer([model.weights])})
    got["opt"].step()
    assert got["model"].weights.tolist() == [1.0] * 4


def test_views_stay_views_of_their_base_large_and_small():
    for n in (16, 300_000):  # in the stream, and out of band (2.4 MB)
        a = np.arange(n, dtype=np.float64)
        got, cap = roundtrip({"a": a, "evens": a[::2], "head": a[:3]})
        assert bool(cap.buffers) == (a.nbytes >= images.BUFFER_MIN_BYTES)
        got["a"][0] = -1
        got["a"][2] = -2
        assert got["head"][0] == -1 and got["evens"][1] == -2
        assert got["a"].flags.writeable and got["evens"].flags.writeable


def test_cycles_survive():
    a: list = []
    b = {"a": a}
    a.append(b)
    got, _ = roundtrip({"a": a, "b": b})
    assert got["a"][0] is got["b"] and got["b"]["a"] is got["a"]


def test_an_unpicklable_name_stays_behind_and_the_rest_keeps_its_sharing():
    s = {"k": 1}
    ns = {"lock": threading.Lock(), "s": s, "pair": [s, s], "Out": {1: s, 2: threading.Lock()}, "_": s}
    got, cap = roundtrip(ns)
    assert set(cap.failed) == {"lock"} and "lock" in cap.failed["lock"]
    assert got["pair"][0] is got["s"] and got["_"] is got["s"]
    assert list(got["Out"]) == [1] and got["Out"][1] is got["s"]  # the output that cannot travel is left out


def test_what_is_and_is_not_replicated():
    ns = {"x": 1, "_private": 2, "_": 3, "__": 4, "_7": 5, "_i": "x = 1", "_i7": "x", "_ih": [], "In": [],
          "__builtins__": object(), "__name__": "__main__", "Out": {}, "get_ipython": print}
    assert images.replicated_names(ns, HIDDEN) == ["x", "_private", "_", "__", "_7", "Out"]


def _carried_by_the_rule(name: str, hidden) -> bool:
    """The rule of the module docstring, spelled out once more without its cache."""
    if name == images.OUT or images.OUTPUT_NAME.fullmatch(name):
        return True
    return not (name == images.PROCESS or name in hidden or images.INPUT_NAME.fullmatch(name)
                or (name.startswith("__") and name.endswith("__")))


_NAMES = st.one_of(st.sampled_from(["_", "__", "___", "____", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "Out", "In",
                                    "__name__", "__x", "x__", "_x_", "_index", "<process>"]),
                   st.builds(lambda p, n: f"{p}{n}", st.sampled_from(["_", "_i", "__", "x", "_0"]),
                             st.integers(0, 10**6)),
                   st.from_regex(r"[_a-zA-Z][_a-zA-Z0-9]{0,6}", fullmatch=True))


@settings(max_examples=300)
@given(st.lists(st.tuples(_NAMES, st.booleans()), max_size=40))
def test_the_remembered_spelling_carries_exactly_what_the_rule_carries(named):
    # the same name hidden in one namespace and not in the next: what is remembered is only its spelling
    for flip in (False, True):
        ns = {name: 0 for name, _ in named}
        hidden = {name for name, h in named if h != flip}
        assert images.replicated_names(ns, hidden) == [n for n in ns if _carried_by_the_rule(n, hidden)]


def test_install_updates_out_in_place_and_removes_names_that_are_gone():
    out = {1: "old"}
    ns = {"x": 1, "gone": 2, "Out": out, "_i1": "x = 1"}
    images.install(ns, HIDDEN, {"x": 5, "Out": {2: "new"}})
    assert ns == {"x": 5, "Out": {2: "new"}, "_i1": "x = 1"} and ns["Out"] is out


def test_functions_defined_in_the_notebook_keep_the_namespace_as_their_globals():
    """A function defined in a cell reads and rebinds the notebook's globals (``global n``). After
    a load on another replica it must do so in that replica's namespace, not in a private copy of
    the names it used (cloudpickle's default): else ``n`` stays put while the function counts."""
    import builtins

    ns: dict = {"n": 0}
    exec("import math\ndef mark():\n    global n\n    n += 1\n    return math.floor(n)\n"
         "def twice():\n    mark()\n    return mark()\n", ns)
    cap = images.capture(ns, HIDDEN)
    target: dict = {"__builtins__": builtins}
    images.install(target, HIDDEN, images.load(cap.stream, list(cap.buffers), namespace=target))
    assert target["twice"]() == 2 and target["n"] == 2
    assert target["mark"].__globals__ is target and target["twice"].__globals__ is target
    assert target["__builtins__"] is builtins  # the namespace's own, not cloudpickle's
    target["n"] = 10  # a later cell rebinds n: the functions see it
    assert target["mark"]() == 11
    # loaded without a namespace (a tool reading an image), the functions share one globals dict
    loaded = images.load(cap.stream, list(cap.buffers))
    assert loaded["twice"]() == 2 and loaded["mark"].__globals__ is loaded["twice"].__globals__


def test_large_buffers_leave_the_stream_and_known_digests_are_used():
    big = np.ones(300_000)
    cap = images.capture({"big": big, "small": np.ones(3)}, HIDDEN, known_digest=lambda mv: "d" * 64)
    assert len(cap.buffers) == 1 and cap.buffers[0].nbytes == big.nbytes and cap.digests == ["d" * 64]
    assert len(cap.stream) < stream_size_without_values() + 1_000


def test_large_bytes_bound_to_names_leave_the_stream_and_names_sharing_one_keep_sharing_it():
    big = bytes(range(256)) * 8192  # 2 MiB: pickle would write it into the stream
    raw = bytearray(big)
    ns = {"data": big, "alias": big, "raw": raw, "nested": [b"x" * 10]}
    back, cap = roundtrip(ns)
    assert sorted(b.nbytes for b in cap.buffers) == [len(big), len(raw)]
    assert len(cap.stream) < stream_size_without_values() + 1_000
    assert type(back["data"]) is bytes and back["data"] == big and back["alias"] is back["data"]
    assert type(back["raw"]) is bytearray and back["raw"] == raw and back["nested"] == [b"x" * 10]


# --- property: random object graphs ------------------------------------------------------------
leaves = st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False),
                   st.builds(lambda n: np.arange(n, dtype=np.int64), st.integers(0, 40)))


@st.composite
def graphs(draw):
    """A namespace of containers that share objects at random, with cycles and numpy views."""
    pool: list = [draw(leaves) for _ in range(draw(st.integers(1, 6)))]
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["list", "dict", "tuple", "view", "cycle"]))
        picks = draw(st.lists(st.sampled_from(range(len(pool))), max_size=4))
        items = [pool[i] for i in picks]
        if kind == "list":
            pool.append(list(items))
        elif kind == "dict":
            pool.append({f"k{i}": v for i, v in enumerate(items)})
        elif kind == "tuple":
            pool.append(tuple(items))
        elif kind == "view":
            arrays = [v for v in pool if isinstance(v, np.ndarray) and v.size > 2]
            if arrays:
                pool.append(draw(st.sampled_from(arrays))[1::2])
        elif kind == "cycle":
            lists = [v for v in pool if isinstance(v, list)]
            if lists:
                target = draw(st.sampled_from(lists))
                target.append(draw(st.sampled_from(pool)))
    names = draw(st.lists(st.sampled_from(range(len(pool))), min_size=1, max_size=6))
    return {f"v{i}": pool[j] for i, j in enumerate(names)}


def values_equal(a, b, seen=None) -> bool:
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y, seen) for x, y in zip(a, b, strict=True))
    return a == b


@settings(max_examples=200, deadline=None)
@given(ns=graphs(), oob=st.booleans())
def test_random_graphs_keep_values_and_identities(ns, oob):
    # min_buffer 64 bytes sends most arrays out of band, as large ones go in practice
    got, _ = roundtrip(ns, min_buffer=64 if oob else images.BUFFER_MIN_BYTES)
    assert set(got) == set(ns)
    for name in ns:
        assert values_equal(ns[name], got[name])
    assert identity_shape(got) == identity_shape(ns)
    # twice over (a follower's image becomes the next executor's): still the same graph
    again, _ = roundtrip(got, min_buffer=64 if oob else images.BUFFER_MIN_BYTES)
    assert identity_shape(again) == identity_shape(ns)


def test_finding_what_cannot_pickle_copies_no_large_buffer(monkeypatch):
    """An unpicklable value (a thread, a lock, an open file) makes every capture look for it,
    value by value; that search must leave large buffers out of band, not copy them into its
    throwaway streams (2 s per GiB, every cell, while such a value stayed)."""
    copied: list[int] = []
    real = images._dumps

    def spy(value, take, namespace=None, sealed=None):
        def watched(pb):
            in_band = take(pb)
            if in_band and pb.raw().nbytes >= images.BUFFER_MIN_BYTES:
                copied.append(pb.raw().nbytes)
            return in_band
        return real(value, watched, namespace, sealed)

    monkeypatch.setattr(images, "_dumps", spy)
    ns = {"big": np.ones(1 << 18), "lock": threading.Lock(), "Out": {1: np.ones(1 << 18), 2: threading.Lock()}}
    cap = images.capture(ns, set())
    assert set(cap.failed) == {"lock"} and "big" in cap.names
    assert copied == []
    assert len(cap.buffers) == 2  # big and Out[1], out of band


def test_the_address_of_a_read_only_buffer_needs_no_numpy(monkeypatch):
    """A cluster's kernels may have no numpy: a large bytes value's buffer is read-only, and its
    address (for the write tracker) came from numpy, which failed every GPU cell there."""
    data = bytes(range(256)) * 8192
    view = memoryview(data)
    expected = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy raises ImportError now
    assert images.address_of(view) == expected and images.address_of(view[10:]) == expected + 10


def test_written_finds_the_buffers_a_cell_changed_in_place():
    kept, changed, replaced = np.ones(300_000), np.ones(300_000), np.ones(300_000)
    before = images.buffer_digests({"k": memoryview(kept), "c": memoryview(changed), "r": memoryview(replaced)})
    assert before == {(images.address_of(memoryview(a)), a.nbytes): d
                      for a, d in ((kept, "k"), (changed, "c"), (replaced, "r"))}
    new_value = np.zeros(300_000)  # a new array (`x = x + 1`): nothing to learn about it yet
    after = {"k": memoryview(kept), "c2": memoryview(changed), "n": memoryview(new_value)}
    assert images.written(before, after) == {(images.address_of(after["c2"]), changed.nbytes)}
    assert images.written({}, after) == set() and images.written(before, {}) == set()


def test_a_buffer_to_hash_instead_is_not_tracked_and_its_digest_not_vouched_for():
    hot, cold = np.ones(300_000), np.ones(300_000) * 2
    resident = {"h" * 64: memoryview(hot), "c" * 64: memoryview(cold)}
    hot_key = (images.address_of(memoryview(hot)), hot.nbytes)
    tracker, known_digest = images.track(resident, mode="in-process", sentinel=True, hash_instead={hot_key})
    try:
        assert hot_key not in tracker.armed
        assert known_digest(memoryview(hot)) is None  # the capture hashes it
        assert known_digest(memoryview(cold)) == "c" * 64  # the other one is tracked as before
    finally:
        tracker.close()
    tracker, _ = images.track(resident, mode="in-process", sentinel=True)
    try:
        assert hot_key in tracker.armed and len(tracker) == 2
    finally:
        tracker.close()


WRAPPED = """
import functools
@functools.lru_cache(maxsize=None)
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
fib(20)
fib.note = "kept"
@functools.lru_cache(maxsize=8, typed=True)
def sq(n):
    return n * n
@functools.cache
def cube(n):
    return n ** 3
class Lazy:
    @functools.cached_property
    def heavy(self):
        return 42
lazy = Lazy()
@functools.singledispatch
def show(x):
    return "any"
@show.register
def _(x: int):
    return "int"
import typing
T = typing.TypeVar("T")
class Box(typing.Generic[T]):
    def __init__(self, v: T):
        self.v = v
box = Box(1)
"""


@functools.singledispatch
def library_dispatch(x):  # a library's: it stays the library's (pickled by reference)
    return "library"


class _Registered:
    """A library's object standing for a notebook function, as decorators that copy the
    function's ``__module__`` onto themselves make them, pickled by that function's name."""

    def __init__(self, name: str) -> None:
        self.__module__ = "__main__"
        self.name = name

    def __reduce__(self):
        return self.name


def test_functools_wrappers_of_notebook_functions_travel_by_value(monkeypatch):
    """``@lru_cache`` pickled by its name (``__main__.fib``): another replica, or a GPU cell's
    fresh process, could not look it up as it loaded the image, and the kernel's next cell failed.
    ``cached_property`` (its lock, Python 3.11) and ``singledispatch`` (its weak references) did not
    pickle at all (gpuhub/kernel/wrappers.py)."""
    import builtins
    import types

    def notebook() -> dict:  # a kernel's namespace is its __main__ module's, as IPython makes it
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        monkeypatch.setitem(sys.modules, "__main__", main)
        return main.__dict__

    ns = notebook()
    exec(WRAPPED, ns)
    ns["THE_ONE"] = _Registered("THE_ONE")
    ns["dispatch"] = library_dispatch
    cap = images.capture(ns, HIDDEN)
    assert set(cap.failed) == {"THE_ONE"} and "pickles by its name in the notebook" in cap.failed["THE_ONE"]
    target = notebook()  # another replica: none of these names yet
    images.install(target, HIDDEN, images.load(cap.stream, list(cap.buffers), namespace=target))
    fib, sq, cube = target["fib"], target["sq"], target["cube"]
    assert fib(30) == 832040 and fib.__wrapped__.__globals__ is target and fib.note == "kept"
    assert fib.cache_parameters() == {"maxsize": None, "typed": False}
    assert sq.cache_parameters() == {"maxsize": 8, "typed": True} and sq(3) == 9 and cube(2) == 8
    assert target["lazy"].heavy == 42 and "heavy" in vars(target["lazy"])
    assert target["Lazy"]().heavy == 42
    assert (target["show"](1), target["show"]("x")) == ("int", "any")
    assert "THE_ONE" not in target and target["dispatch"] is library_dispatch
    assert target["box"].v == 1 and type(target["box"]) is target["Box"] and target["T"].__name__ == "T"
