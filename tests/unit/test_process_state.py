"""The working directory and environment changes an image carries (gpuhub/kernel/process_state.py):
another process takes on exactly the cells' changes, never what gpuhub sets per replica or grant."""

from __future__ import annotations

import logging
import os

import pytest

from gpuhub.kernel import process_state


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """This process as a replica at its start: a known environment and working directory."""
    start = {"PATH": "/usr/bin", "HOME": "/home/u", "GPUHUB_REPLICA_ID": "0", "CUDA_VISIBLE_DEVICES": "",
             "HOME_SUFFIXED": "/home/u"}
    monkeypatch.setattr(os, "environ", os._Environ(dict(start), str, str, str, str))  # not the real one
    monkeypatch.setattr(os, "putenv", lambda name, value: None)  # nor this process's C environment
    monkeypatch.setattr(os, "unsetenv", lambda name: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(process_state, "_unreachable", set())
    process_state.take_baseline()
    yield start
    monkeypatch.setattr(process_state, "_baseline", None)
    monkeypatch.setattr(process_state, "_start_dir", None)


def test_only_the_cells_changes_are_carried_and_taken_on(fresh, tmp_path):
    (tmp_path / "data").mkdir()
    os.chdir(tmp_path / "data")
    os.environ.update(NOTEBOOK_A="1", PATH="/opt/bin:/usr/bin", GPUHUB_REPLICA_ID="7",
                      CUDA_VISIBLE_DEVICES="GPU-1", HOME_SUFFIXED="/home/u2")
    del os.environ["HOME"]
    state = process_state.capture()
    state["set"].pop("PYTEST_CURRENT_TEST", None)  # pytest's own, set in this test's environment
    assert state == {"cwd": str(tmp_path / "data"),  # not a list of paths extended: the whole value
                     "set": {"HOME_SUFFIXED": "/home/u2", "NOTEBOOK_A": "1", "PATH": ("/opt/bin:", "")},
                     "unset": ["HOME"]}

    # another replica, at its own start (its own GPUHUB_*, PATH and a variable of its own server)
    (tmp_path / "home").mkdir()
    os.chdir(tmp_path / "home")
    os.environ.clear()
    os.environ.update(PATH="/bin:/usr/bin", HOME="/home/u", GPUHUB_REPLICA_ID="1", SERVER_ONLY="x")
    process_state.take_baseline()
    os.environ["STALE"] = "from an earlier image"
    process_state.apply(state)
    assert dict(os.environ) == {"PATH": "/opt/bin:/bin:/usr/bin", "GPUHUB_REPLICA_ID": "1", "SERVER_ONLY": "x",
                                "NOTEBOOK_A": "1", "HOME_SUFFIXED": "/home/u2"}
    assert os.getcwd() == str(tmp_path / "data")
    # a cell back where this replica's executor started: each replica goes back to its own start
    process_state.apply({"cwd": None, "set": {}, "unset": []})
    assert os.getcwd() == str(tmp_path / "home")


def test_a_directory_this_server_lacks_is_logged_and_skipped(fresh, tmp_path, caplog):
    process_state.apply({"cwd": str(tmp_path / "elsewhere"), "set": {"A": "1"}, "unset": []})
    assert os.getcwd() == str(tmp_path) and os.environ["A"] == "1"
    assert f"cannot change to the notebook's working directory {tmp_path / 'elsewhere'}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        process_state.apply({"cwd": str(tmp_path / "elsewhere"), "set": {}, "unset": []})
    assert os.getcwd() == str(tmp_path) and "A" not in os.environ and not caplog.text  # said once


def cells_set() -> dict:
    """The variables an image carries as set, but pytest's own (PYTEST_CURRENT_TEST, set as each
    phase of a test begins)."""
    return {k: v for k, v in process_state.capture()["set"].items() if not k.startswith("PYTEST_")}


def test_each_capture_sees_the_environment_as_it_is_now(fresh):
    """Captures reuse the last one's environment changes while nothing changed (a cheap check per
    image): a change, and a change undone, show in the next capture."""
    assert cells_set() == {}
    os.environ["SEED"] = "1"
    assert cells_set() == {"SEED": "1"}
    assert cells_set() == {"SEED": "1"}
    os.environ["SEED"] = "2"
    del os.environ["HOME"]
    assert cells_set() == {"SEED": "2"} and process_state.capture()["unset"] == ["HOME"]
    os.environ["HOME"] = "/home/u"
    del os.environ["SEED"]
    assert cells_set() == {} and process_state.capture()["unset"] == []
