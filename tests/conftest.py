"""Shared fixtures: real gpuhub daemons on 127.0.0.1 (see gpuhub.dev.cluster); the unit /
integration / cluster marker of every test, from its directory; the unit tests' isolation guard."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

# Caches of this run's own, set before anything reads them (jedi and matplotlib fix their
# directories on import): the kernels a run starts (plain ipykernels among them, killed mid-write by
# the tests of failures) write jedi's completion cache there, and a cache file a killed kernel left
# truncated in the machine's ~/.cache broke completion for every later run (2026-11-28). pip keeps
# the machine's cache: a clean venv of tests/integration/test_install.py reuses its wheels.
_HOME_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
os.environ.setdefault("PIP_CACHE_DIR", os.path.join(_HOME_CACHE, "pip"))
RUN_CACHE = tempfile.mkdtemp(prefix="gpuhub-tests-cache-")
os.environ["XDG_CACHE_HOME"] = RUN_CACHE

import pytest  # noqa: E402

from gpuhub.dev.cluster import AgentProcess, DevCluster, SchedulerProcess, current_user  # noqa: E402, F401

TESTS = Path(__file__).resolve().parent
# What a test starts decides where it lives, and so its marker (declared in pyproject.toml):
#   unit         nothing: no process, no socket (pure code, in this process; os.fork is allowed)
#   integration  real daemons / replicas / ipykernels / Prometheus on 127.0.0.1
#   cluster      the podman cluster (scripts/cluster.sh)
KIND_OF_DIR = {"unit": "unit", "sim": "unit", "integration": "integration", "monitoring": "integration",
               "cluster": "cluster"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue  # not one of ours
        kind = KIND_OF_DIR.get(top)
        if kind is None:
            raise pytest.UsageError(
                f"{item.nodeid}: a test lives in one of tests/{{{','.join(KIND_OF_DIR)}}}/ (what it starts "
                "decides which: tests/conftest.py KIND_OF_DIR)")
        item.add_marker(kind)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(RUN_CACHE, ignore_errors=True)


def pytest_sessionstart(session):
    # matplotlib builds its font cache on first use by running fc-list: a subprocess, which the unit
    # tests' guard refuses. Build it here, before any test, so a fresh machine behaves as a used one.
    try:
        import matplotlib.font_manager  # noqa: F401  (importing builds the cache)
    except ImportError:
        pass


class IsolationError(AssertionError):
    """A unit test opened a socket or started a process: it belongs in tests/integration/."""


@pytest.fixture(autouse=True)
def _unit_isolation(request, monkeypatch):
    """Unit tests may not connect or bind a socket, nor start a subprocess. Each attempt raises
    (not an OSError, which the code under test might swallow) and, in case something caught it
    anyway, fails the test at teardown."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    attempts: list[str] = []

    def refuse(what):
        def refused(*args, **kwargs):
            attempts.append(what)
            raise IsolationError(f"a unit test may not {what}: move it to tests/integration/")
        return refused

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, refuse(f"{name} a socket"))
    # every subprocess (run, check_output, asyncio's) goes through Popen._execute_child
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("start a subprocess"))
    for name in ("system", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp", "execvpe"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"call os.{name}"))
    yield
    if attempts:
        pytest.fail(f"a unit test tried to {', '.join(sorted(set(attempts)))}: it belongs in tests/integration/")


@pytest.fixture
def make_agent(tmp_path):
    agents = []

    def make(name: str = "node1", gpus: int = 2, extra: dict | None = None) -> AgentProcess:
        a = AgentProcess(tmp_path, name, gpus, extra).start()
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()


@pytest.fixture
def cluster(tmp_path):
    """A scheduler and three agents (2 fake GPUs each) heartbeating to it, all on 127.0.0.1."""
    c = DevCluster(tmp_path).start()
    yield {"scheduler": c.scheduler, "agents": c.agents, "user_token": c.user_token, "dev": c}
    c.stop()
