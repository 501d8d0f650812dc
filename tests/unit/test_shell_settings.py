"""Settings cells make in libraries (gpuhub/kernel/shell_settings.py): captured as plain data,
taken on by another process (here: this one, after the settings were undone)."""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import warnings

import matplotlib as mpl
import numpy as np
import pandas as pd
import pytest

from gpuhub.kernel import shell_settings


@pytest.fixture(autouse=True)
def _restored():
    """Each test leaves this process's settings as it found them."""
    filters = list(warnings.filters)
    printoptions = np.get_printoptions()
    rc = dict(mpl.rcParams)
    shell_settings.take_baseline()
    shell_settings._refused.clear()
    yield
    warnings.filters[:] = filters
    warnings._filters_mutated()
    np.set_printoptions(**printoptions)
    pd.reset_option("display.max_rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated keys among them
        mpl.rcParams.update(rc)


def _undone() -> None:
    """What a process forked from the replica has: none of the cells' settings."""
    shell_settings.apply({})  # warnings back to the baseline, nothing else changes
    np.set_printoptions(precision=8)
    pd.reset_option("display.max_rows")
    mpl.rcdefaults()


def test_an_unchanged_process_carries_no_warnings_and_the_same_data_each_time():
    first = shell_settings.capture()
    assert "warnings" not in first
    assert shell_settings.capture() == first
    assert pickle.loads(pickle.dumps(first)) == first  # plain data: an image always pickles it


def test_settings_are_taken_on_in_another_process():
    warnings.filterwarnings("ignore", message="noisy", category=UserWarning)
    np.set_printoptions(precision=3)
    pd.set_option("display.max_rows", 7)
    mpl.rcParams["figure.figsize"] = (3.0, 2.0)
    mpl.rcParams["axes.prop_cycle"] = mpl.cycler(color=["red", "blue"])
    state = pickle.loads(pickle.dumps(shell_settings.capture()))
    _undone()
    assert np.get_printoptions()["precision"] == 8
    shell_settings.apply(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("noisy thing", stacklevel=1)
        warnings.warn("other thing", stacklevel=1)
    assert [str(w.message) for w in caught] == ["other thing"]
    assert repr(np.array([1 / 3])) == "array([0.333])"
    assert pd.get_option("display.max_rows") == 7
    assert mpl.rcParams["figure.figsize"] == [3.0, 2.0]
    assert mpl.rcParams["axes.prop_cycle"].by_key()["color"] == ["red", "blue"]
    assert shell_settings.capture() == state


def test_settings_a_cell_undid_are_undone_in_the_other_process_too():
    pd.set_option("display.max_rows", 7)
    mpl.rcParams["figure.figsize"] = (3.0, 2.0)
    state = shell_settings.capture()
    pd.reset_option("display.max_rows")
    mpl.rcdefaults()
    undone = shell_settings.capture()
    shell_settings.apply(state)
    shell_settings.apply(undone)
    assert pd.get_option("display.max_rows") == 60
    assert mpl.rcParams["figure.figsize"] == mpl.rcParamsDefault["figure.figsize"]


def test_a_setting_this_process_cannot_take_is_skipped_and_logged_once(caplog):
    warnings.filterwarnings("ignore", message="kept", category=UserWarning)
    state = shell_settings.capture()
    state["warnings"].insert(0, ["ignore", "", "no_such_module_here:FancyWarning", "", 0])
    state["pandas"]["no.such.option"] = 1
    _undone()
    caplog.set_level(logging.WARNING, logger="gpuhub.kernel.shell_settings")
    shell_settings.apply(state)
    shell_settings.apply(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("kept", stacklevel=1)
        warnings.warn("shown", stacklevel=1)
    assert [str(w.message) for w in caught] == ["shown"]
    assert caplog.text.count("no_such_module_here:FancyWarning") == 1


def test_whatever_a_state_holds_apply_never_raises():
    for state in (None, "x", {"warnings": "x"}, {"numpy": {"precision": "many"}}, {"pandas": 3},
                  {"matplotlib": {"figure.figsize": "big"}}, {"extensions": 5}):
        shell_settings.apply(state)


def test_the_root_loggers_level_and_its_handlers_to_the_notebook_are_taken_on():
    root, level = logging.getLogger(), logging.getLogger().level
    ours = lambda: [h for h in root.handlers if type(h) is logging.StreamHandler]  # noqa: E731
    handler = logging.StreamHandler(sys.stderr)  # as logging.basicConfig makes it
    handler.setFormatter(logging.Formatter("{levelname} {message}", style="{"))
    handler.setLevel(logging.DEBUG)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        state = pickle.loads(pickle.dumps(shell_settings.capture()))
        root.removeHandler(handler)
        root.setLevel(level)
        shell_settings.apply(state)
        [made] = ours()
        assert (made.stream, made.level, made.formatter._fmt, root.level) == (
            sys.stderr, logging.DEBUG, "{levelname} {message}", logging.INFO)
        assert made.formatter.format(logging.makeLogRecord({"levelname": "INFO", "msg": "x"})) == "INFO x"
        shell_settings.apply({})  # a state from before basicConfig: none again
        assert ours() == [] and root.level == level
    finally:
        for h in ours():
            root.removeHandler(h)
        root.setLevel(level)


def test_paths_a_cell_added_around_the_replicas_own_are_added_around_anothers():
    base = list(sys.path)
    try:
        sys.path.insert(0, "/notebook/src")
        sys.path.append("/notebook/extra")
        state = shell_settings.capture()
        assert state["path"] == [["/notebook/src"], ["/notebook/extra"]]
        sys.path[:] = base
        shell_settings._baseline_path = ["/this/replicas/own", *base]  # another server's
        sys.path.insert(0, "/this/replicas/own")
        shell_settings.apply(state)
        assert sys.path == ["/notebook/src", "/this/replicas/own", *base, "/notebook/extra"]
        shell_settings.apply({})  # a state from before: the replica's own path again
        assert sys.path == ["/this/replicas/own", *base]
    finally:
        sys.path[:] = base


def test_a_path_a_cell_edited_inside_keeps_each_replicas_own_entries():
    base = list(sys.path)
    try:
        sys.path.insert(1, "/notebook/src")
        sys.path.remove(base[-1])
        state = shell_settings.capture()
        sys.path[:] = base
        own = [f"/other/server/{i}" for i in range(len(base))]  # another server's, as long
        shell_settings._baseline_path = own
        sys.path[:] = own
        shell_settings.apply(state)
        assert sys.path == [own[0], "/notebook/src", *own[1:-1]]  # none of this server's entries
        shell_settings._baseline_path = ["/short"]  # another install: its own path where it stood
        shell_settings.apply(state)
        assert sys.path == ["/short", "/notebook/src"]
    finally:
        sys.path[:] = base


def test_a_handler_or_filter_a_cell_built_by_hand_never_breaks_the_capture():
    class Colored(logging.Formatter):
        def __init__(self):  # as some libraries do: logging.Formatter's fields never set
            pass

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(Colored())
    root.addHandler(handler)
    try:
        state = shell_settings.capture()
        assert state.get("logging", {}).get("handlers", []) == []  # not rebuilt elsewhere as another class
    finally:
        root.removeHandler(handler)
    warnings.filters.insert(0, ("ignore", None, object(), None, 0))  # no class: a cell's own hack
    warnings._filters_mutated()
    assert "warnings" not in shell_settings.capture()


def test_a_gpu_replica_leaves_the_code_a_setting_names_to_the_cells_process():
    """An extension may start CUDA as it loads (and a warning category's module as it imports):
    a GPU kernel's replica runs neither, each cell's process does."""
    state = {"warnings": [["ignore", "", "gh_deferred_category:LateWarning", "", 0],
                          ["ignore", "kept", "builtins:UserWarning", "", 0]]}
    module = type(sys)("gh_deferred_category")
    module.LateWarning = type("LateWarning", (UserWarning,), {"__module__": "gh_deferred_category"})
    loaded = []
    sys.meta_path.insert(0, _Finder(module, loaded))
    try:
        shell_settings.defer_code()
        shell_settings.apply(state)
        assert loaded == [] and "gh_deferred_category" not in sys.modules
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("kept", stacklevel=1)
        assert caught == []  # the rest is taken on in the replica
        shell_settings.apply_deferred()  # in the cell's process
        assert loaded == ["gh_deferred_category"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("late", module.LateWarning, stacklevel=1)
        assert caught == []
    finally:
        shell_settings.defer_code(False)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        sys.modules.pop("gh_deferred_category", None)


class _Finder:
    """Imports one made-up module and notes each import."""

    def __init__(self, module, loaded: list) -> None:
        self.module, self.loaded = module, loaded

    def find_spec(self, name, path=None, target=None):
        if name != self.module.__name__:
            return None
        import importlib.util
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        self.loaded.append(spec.name)
        return self.module

    def exec_module(self, module) -> None:
        pass


def test_numpys_print_options_taken_on_in_another_thread_reach_the_cells_thread_again():
    np.set_printoptions(precision=3)
    state = shell_settings.capture()
    _undone()
    joining = threading.Thread(target=shell_settings.apply, args=(state,))  # a replica catching up
    joining.start()
    joining.join()
    shell_settings.reapply()
    assert np.get_printoptions()["precision"] == 3



def test_numpys_floating_point_error_handling_is_taken_on():
    """``np.seterr(...)`` stays for the cells after it in a plain kernel's process. (PyTorch's
    gradient mode: tests/integration/test_torch_training.py, importing torch starts processes.)"""
    before = np.seterr(divide="ignore", invalid="raise")
    try:
        state = pickle.loads(pickle.dumps(shell_settings.capture()))
        np.seterr(**before)
        shell_settings.apply(state)
        assert (np.geterr()["divide"], np.geterr()["invalid"]) == ("ignore", "raise")
        shell_settings.apply({k: v for k, v in state.items() if k != "numpy_errors"})
        assert np.geterr()["divide"] == "ignore"  # an image without it (an earlier gpuhub's) leaves it
    finally:
        np.seterr(**before)


def test_levels_set_on_named_loggers_are_taken_on_and_set_back():
    """``transformers.logging.set_verbosity_error()`` sets its library's logger's level: it lives in
    the process, not in a variable. A level this replica's own cell set, which a later cell on
    another replica set back, is set back here too (this replica never took it from an image)."""
    quiet, ours = logging.getLogger("gh_library"), logging.getLogger("gpuhub.kernel.gh_test")
    raft, started = logging.getLogger("pysyncobj.gh_test"), logging.getLogger("gh_started")
    try:
        started.setLevel(logging.INFO)  # as at the kernel's start
        shell_settings.take_baseline()
        quiet.setLevel(logging.ERROR)
        ours.setLevel(logging.DEBUG)  # the replica's own: each replica's
        raft.setLevel(logging.DEBUG)
        started.setLevel(logging.NOTSET)
        state = pickle.loads(pickle.dumps(shell_settings.capture()))
        assert state["logging"]["levels"] == [["gh_library", logging.ERROR], ["gh_started", logging.NOTSET]]
        quiet.setLevel(logging.NOTSET)
        ours.setLevel(logging.NOTSET)
        raft.setLevel(logging.NOTSET)
        started.setLevel(logging.INFO)
        shell_settings.apply(state)
        assert (quiet.level, started.level, ours.level, raft.level) == (logging.ERROR, logging.NOTSET, 0, 0)
        quiet.setLevel(logging.WARNING)  # this replica's own cell
        shell_settings.apply({})  # then an image from cells elsewhere that set nothing
        assert (quiet.level, started.level) == (logging.NOTSET, logging.INFO)
    finally:
        for logger in (quiet, ours, raft, started):
            logger.setLevel(logging.NOTSET)


def test_the_recursion_limit_a_cell_set_is_taken_on_and_set_back():
    start = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(start + 500)
        state = pickle.loads(pickle.dumps(shell_settings.capture()))
        sys.setrecursionlimit(start)
        shell_settings.apply(state)
        assert sys.getrecursionlimit() == start + 500
        shell_settings.apply({})  # a later image: a cell set it back
        assert sys.getrecursionlimit() == start
    finally:
        sys.setrecursionlimit(start)
