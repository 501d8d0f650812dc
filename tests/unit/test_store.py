"""The atomic JSON store under the agent's state file and the scheduler's books."""

from __future__ import annotations

import os
import stat

import pytest

from gpuhub.platform import store as store_mod
from gpuhub.platform.store import CorruptStore, JsonStore


def test_round_trip(tmp_path):
    s = JsonStore(tmp_path / "state.json")
    assert s.load() is None  # no file yet
    doc = {"units": {"a": {"gpus": 2, "key": "sëcret"}}, "leases": [1, 2.5, None, True]}
    s.save(doc)
    assert s.load() == doc
    s.save({"units": {}})
    assert JsonStore(tmp_path / "state.json").load() == {"units": {}}


def test_mode_and_missing_directory(tmp_path):
    s = JsonStore(tmp_path / "new" / "dir" / "books.json")
    old = os.umask(0)  # the file's mode must not depend on the daemon's umask
    try:
        s.save({"key": "k"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(s.path.parent.stat().st_mode) == 0o700
    public = JsonStore(tmp_path / "public.json", mode=0o644)
    public.save([])
    assert stat.S_IMODE(public.path.stat().st_mode) == 0o644


def test_save_replaces_a_file_that_had_a_wider_mode(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{}")
    path.chmod(0o644)
    JsonStore(path).save({"key": "k"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_crash_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    s = JsonStore(tmp_path / "state.json")
    s.save({"v": 1})

    def crash(src, dst):
        raise KeyboardInterrupt  # killed between the write and the rename

    monkeypatch.setattr(store_mod.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        s.save({"v": 2})
    monkeypatch.undo()
    assert s.load() == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary file left


def test_a_failed_dump_keeps_the_old_file(tmp_path):
    s = JsonStore(tmp_path / "state.json")
    s.save({"v": 1})
    with pytest.raises(TypeError):
        s.save({"v": object()})  # not JSON: fails half-way through writing
    assert s.load() == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_temporary_file_left_by_a_crash_does_not_matter(tmp_path):
    s = JsonStore(tmp_path / "state.json")
    s.save({"v": 1})
    (tmp_path / ".state.json.abc.tmp").write_text('{"v": ')  # what a power loss may leave
    assert s.load() == {"v": 1}
    s.save({"v": 2})
    assert s.load() == {"v": 2}


@pytest.mark.parametrize("raw", [b'{"units": {', b"", b"\xff\xfe not utf-8"])
def test_a_corrupt_file_is_a_clear_error(tmp_path, raw):
    path = tmp_path / "state.json"
    path.write_bytes(raw)
    with pytest.raises(CorruptStore, match=r"state\.json is corrupt") as info:
        JsonStore(path).load()
    assert info.value.path == path
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("durable,fsyncs", [(True, 2), (False, 0)])
def test_only_a_durable_store_flushes_to_disk(tmp_path, monkeypatch, durable, fsyncs):
    """The file and its directory entry for a durable store (the scheduler's books); none for the
    agent's state, saved on every GPU cell's path, whose content a power loss ends anyway."""
    calls = []
    real = store_mod.os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: calls.append(fd) or real(fd))
    s = JsonStore(tmp_path / "state.json", durable=durable)
    s.save({"v": 1})
    assert len(calls) == fsyncs
    assert s.load() == {"v": 1}
