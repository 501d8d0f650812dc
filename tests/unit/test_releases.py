"""Releases: units are pinned to the release the venv symlink names when they start, and pruning
removes only old releases that no process runs from."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuhub.admin.cli import main as cli_main
from gpuhub.platform import releases


def make_release(root: Path, name: str, mtime: float, complete: bool = True) -> Path:
    d = root / name
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    if complete:
        (d / releases.COMPLETE_MARKER).write_text("")
    os.utime(d, (mtime, mtime))
    return d


def fake_proc(tmp_path: Path, commands: dict[int, list[str]]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "self").mkdir()  # not a pid: skipped
    for pid, argv in commands.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (proc / "999").mkdir()  # a process that ended while we looked: no cmdline
    return proc


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "venvs"
    old = make_release(root, "aaa-111", 1000)
    mid = make_release(root, "aaa-222", 2000)
    new = make_release(root, "aaa-333", 3000)
    venv = tmp_path / "venv"
    venv.symlink_to(new)
    return SimpleNamespace(root=root, venv=venv, old=old, mid=mid, new=new)


def test_pin_rewrites_the_symlink_to_the_release_it_names_now(site):
    venv, mid, new = site.venv, site.mid, site.new
    argv = [f"{venv}/bin/batchspawner-singleuser", f"{venv}/bin/jupyterhub-singleuser", "--ip=0.0.0.0",
            f"{venv}x/not-ours"]
    env = {"PATH": f"{venv}/bin:/usr/bin", "HOME": "/home/alice"}
    pinned_argv, pinned_env = releases.pin(argv, env, str(venv))
    assert pinned_argv == [f"{new}/bin/batchspawner-singleuser", f"{new}/bin/jupyterhub-singleuser", "--ip=0.0.0.0",
                           f"{venv}x/not-ours"]
    assert pinned_env == {"PATH": f"{new}/bin:/usr/bin", "HOME": "/home/alice"}
    assert env["PATH"].startswith(str(venv))  # the caller's copy is untouched
    # After the switch, a unit started now gets the new target; one started before kept its own.
    venv.unlink()
    venv.symlink_to(mid)
    assert releases.pin(argv, env, str(venv) + "/")[0][0] == f"{mid}/bin/batchspawner-singleuser"


def test_pin_leaves_a_plain_venv_alone(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    argv, env = releases.pin([f"{venv}/bin/python"], {"PATH": f"{venv}/bin"}, str(venv))
    assert argv == [f"{venv}/bin/python"] and env == {"PATH": f"{venv}/bin"}


def test_list_marks_the_current_release_and_who_runs_from_each(site, tmp_path):
    root, venv, old, new = site.root, site.venv, site.old, site.new
    make_release(root, "aaa-444", 4000, complete=False)
    proc = fake_proc(tmp_path, {10: [f"{old}/bin/python", "-m", "gpuhub.kernel"], 11: ["/usr/bin/sleep", "1"],
                                12: [f"{new}/bin/python", f"{new}/bin/gpuhub-agent"]})
    found = {r.name: r for r in releases.list_releases(root, venv, proc)}
    assert [r.name for r in releases.list_releases(root, venv, proc)] == ["aaa-444", "aaa-333", "aaa-222", "aaa-111"]
    assert found["aaa-333"].current and not found["aaa-222"].current
    assert found["aaa-111"].pids == [10] and found["aaa-333"].pids == [12] and found["aaa-222"].pids == []
    assert not found["aaa-444"].complete


def test_prune_keeps_the_current_the_newest_others_and_any_in_use(site, tmp_path):
    root, venv, old, mid, new = site.root, site.venv, site.old, site.mid, site.new
    unfinished = make_release(root, "aaa-444", 4000, complete=False)
    proc = fake_proc(tmp_path, {10: [f"{old}/bin/python", "-m", "gpuhub.kernel"]})
    removed, busy = releases.prune(root, venv, keep=1, proc=proc)
    assert sorted(r.name for r in removed) == ["aaa-222", "aaa-444"]  # the unfinished one too
    assert [r.name for r in busy] == ["aaa-111"]
    assert new.is_dir() and old.is_dir() and not mid.exists() and not unfinished.exists()
    # Once its last kernel ended, the old release goes as well.
    removed, busy = releases.prune(root, venv, keep=1, proc=fake_proc(tmp_path / "later", {}))
    assert [r.name for r in removed] == ["aaa-111"] and not busy
    assert venv.resolve() == new


def test_prune_keeps_the_previous_release_for_a_rollback(site, tmp_path):
    root, venv, mid, new = site.root, site.venv, site.mid, site.new
    removed, _ = releases.prune(root, venv, keep=2, proc=fake_proc(tmp_path, {}))
    assert [r.name for r in removed] == ["aaa-111"] and mid.is_dir() and new.is_dir()
    with pytest.raises(ValueError, match="at least 1"):
        releases.prune(root, venv, keep=0, proc=fake_proc(tmp_path / "p2", {}))


def test_release_name_is_the_release_directory_only_when_complete(site, tmp_path):
    root, venv, new = site.root, site.venv, site.new
    assert releases.release_name(new) == "aaa-333"
    assert releases.release_name(venv) == "aaa-333"  # through the link: the release it names
    assert releases.release_name(make_release(root, "aaa-555", 5000, complete=False)) == ""


def test_cli_lists_and_prunes(site, capsys):
    root, venv = site.root, site.venv
    assert cli_main(["releases", "--root", str(root), "--venv", str(venv)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("* aaa-333") and lines[1].startswith("  aaa-222")
    assert cli_main(["releases", "prune", "--keep", "2", "--root", str(root), "--venv", str(venv)]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed aaa-111"]
    assert cli_main(["releases", "prune", "--keep", "2", "--root", str(root), "--venv", str(venv)]) == 0
    assert capsys.readouterr().out.splitlines() == ["unchanged"]
    assert cli_main(["releases", "prune", "--keep", "0", "--root", str(root), "--venv", str(venv)]) == 2
