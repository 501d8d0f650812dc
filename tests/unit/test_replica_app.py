"""A replica's ipykernel parts: its application's logging and the cell sources it caches."""

from __future__ import annotations

import functools
import linecache
import logging
from types import SimpleNamespace

from ipykernel.compiler import XCachingCompiler

from gpuhub.kernel.__main__ import ReplicaApp
from gpuhub.kernel.kernel import GpuhubKernel


def test_the_application_logger_takes_its_handlers_level():
    """traitlets leaves the logger at DEBUG and filters at the handler: every ipykernel debug
    line of a cell's path would build a record only to drop it."""
    for level in (logging.WARNING, logging.DEBUG):
        config = ReplicaApp(log_level=level).get_default_logging_config()
        assert config["loggers"]["ReplicaApp"]["level"] == logging.getLevelName(level)
        assert config["handlers"]["console"]["level"] == logging.getLevelName(level)


def a_follower(transform):
    """What ``_remember_cell`` uses of a kernel: its shell's compiler and transform."""
    kernel = SimpleNamespace(shell=SimpleNamespace(compile=XCachingCompiler(), transform_cell=transform))
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
