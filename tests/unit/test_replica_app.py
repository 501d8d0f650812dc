"""A replica's ipykernel parts: its application's logging and the cell sources it caches."""

from __future__ import annotations

import functools
import linecache
import logging
from types import SimpleNamespace

import pytest
from ipykernel.compiler import XCachingCompiler
from IPython.core.compilerop import CachingCompiler

from gpuhub.kernel.__main__ import ReplicaApp
from gpuhub.kernel.kernel import GpuhubKernel


@pytest.fixture
def app_logger():
    """The logger a ReplicaApp configures, as it was before the test."""
    logger = logging.getLogger("ReplicaApp")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.parametrize("log_level,config,want", [
    (logging.WARNING, {}, logging.WARNING),
    (logging.DEBUG, {}, logging.DEBUG),
    # an admin's handler below log_level still gets its records
    (logging.WARNING, {"handlers": {"console": {"level": "INFO"}}}, logging.INFO),
])
def test_the_application_logger_takes_its_handlers_lowest_level(app_logger, log_level, config, want):
    """traitlets leaves the logger at DEBUG and filters at the handler: every ipykernel debug
    line of a cell's path would build a record only to drop it."""
    app = ReplicaApp(log_level=log_level, logging_config=config)
    app.log.debug("configured")  # the log's default configures logging
    assert app_logger.level == want
    assert min(h.level for h in app_logger.handlers) == want


@pytest.fixture(autouse=True)
def no_cells_left_in_linecache():
    before = set(linecache.cache)
    yield
    for name in set(linecache.cache) - before:
        del linecache.cache[name]


def a_follower(transform, compiler=None):
    """What ``_remember_cell`` uses of a kernel: its shell's compiler and transform."""
    kernel = SimpleNamespace(shell=SimpleNamespace(compile=compiler or XCachingCompiler(), transform_cell=transform))
    kernel._transformed = functools.partial(GpuhubKernel._transformed, kernel)
    return kernel


def test_a_cell_run_elsewhere_is_cached_under_the_executors_name_and_transformed_when_read():
    calls = []

    def transform(code):
        calls.append(code)
        return code.replace("%time ", "get_ipython().run_line_magic('time', '') or ")

    code = "def f():\n    return 1 / 0\n%time f()\n"
    executor_name = XCachingCompiler().get_code_name(code, transform(code), 7)  # what it compiled under
    calls.clear()
    follower = a_follower(transform)
    GpuhubKernel._remember_cell(follower, code, 7)
    assert follower.shell.compile._filename_map[executor_name] == 7  # tracebacks say Cell In[7]
    assert calls == []  # nothing transformed until something reads the lines
    assert linecache.getlines(executor_name) == [
        "def f():\n", "    return 1 / 0\n", "get_ipython().run_line_magic('time', '') or f()\n"]
    assert linecache.getline(executor_name, 2) == "    return 1 / 0\n"
    assert calls == [code]  # once: the entry is a plain one now
    linecache.checkcache()  # what tracebacks call: entries without a file stay
    assert linecache.getline(executor_name, 1) == "def f():\n"


def test_a_cell_ipython_cannot_transform_is_cached_as_written():
    def transform(code):
        raise SyntaxError("no")

    code = "x = (\n"
    follower = a_follower(transform)
    GpuhubKernel._remember_cell(follower, code, 3)
    name = XCachingCompiler().get_code_name(code, code, 3)
    assert linecache.getlines(name) == ["x = (\n"]


def magic_to_call(code):
    return code.replace("%time ", "get_ipython().run_line_magic('time', '') or ")


@pytest.mark.parametrize("how", ["a <...> name", "IPython's own compiler"])
def test_where_linecache_would_not_read_a_lazy_entry_the_transform_is_cached_at_once(monkeypatch, how):
    """linecache never reads a lazy entry under a ``<...>`` name (IPYKERNEL_CELL_NAME, which
    nbclient sets), and IPython's own compiler names a cell after its transform."""
    code = "%time y = 2\n"
    want = ["get_ipython().run_line_magic('time', '') or y = 2\n"]
    if how == "a <...> name":
        monkeypatch.setenv("IPYKERNEL_CELL_NAME", "<IPY-INPUT>")
        follower, name = a_follower(magic_to_call), "<IPY-INPUT>"
    else:
        follower = a_follower(magic_to_call, CachingCompiler())
        name = CachingCompiler().get_code_name(code, magic_to_call(code), 5)
    GpuhubKernel._remember_cell(follower, code, 5)
    assert linecache.cache[name][2] == want
    assert follower.shell.compile._filename_map[name] == 5
