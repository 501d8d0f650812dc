"""``gpuhub backup`` / ``gpuhub restore`` on a fake root: what goes in, a restore that gives back the
same files with their modes, and archives that are refused (damaged, foreign paths)."""

from __future__ import annotations

import io
import json
import sqlite3
import tarfile
from pathlib import Path

import pytest

from gpuhub.admin import backup
from gpuhub.admin.cli import main as cli_main


@pytest.fixture
def hub_root(tmp_path):
    root = tmp_path / "hub"
    hub = root / "var/lib/gpuhub/hub"
    hub.mkdir(parents=True)
    db = sqlite3.connect(hub / "jupyterhub.sqlite")
    # As a running hub holds it: open, in WAL mode, its recent writes only in the -wal file so far.
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('alice')")
    db.commit()
    (hub / "jupyterhub_cookie_secret").write_text("c00kie")
    (hub / "jupyterhub_cookie_secret").chmod(0o600)
    sched = root / "var/lib/gpuhub/scheduler"
    sched.mkdir(parents=True)
    (sched / "books.json").write_text('{"kernels": {}}')
    secrets = root / "etc/gpuhub/secrets"
    (secrets / "proxy").mkdir(parents=True)
    (secrets / "agent.token").write_text("agent-token")
    (secrets / "agent.token").chmod(0o640)
    (secrets / "proxy" / "tls.key").write_text("KEY")
    (secrets / "proxy" / "tls.key").chmod(0o600)
    (secrets / "proxy").chmod(0o750)
    (secrets / "link").symlink_to("agent.token")  # not state: left out
    (root / "etc/gpuhub/tls").mkdir()
    (root / "etc/gpuhub/tls/hub.crt").write_text("CERT")
    (root / "etc/gpuhub/agent.toml").write_text("not a secret, written by the roles")
    yield root
    db.close()


def users(root: Path) -> list[str]:
    db = sqlite3.connect(root / backup.HUB_DB)
    try:
        return [r[0] for r in db.execute("SELECT name FROM users")]
    finally:
        db.close()


def test_a_backup_restores_the_hub_state_onto_a_wiped_host(hub_root, tmp_path):
    archive = tmp_path / "out" / "hub.tar.gz"
    entries = backup.create(archive, root=hub_root)
    assert archive.stat().st_mode & 0o777 == 0o600
    paths = {e.path for e in entries if not e.directory}
    assert paths == {backup.HUB_DB, "var/lib/gpuhub/hub/jupyterhub_cookie_secret",
                     "var/lib/gpuhub/scheduler/books.json", "etc/gpuhub/secrets/agent.token",
                     "etc/gpuhub/secrets/proxy/tls.key", "etc/gpuhub/tls/hub.crt"}

    fresh = tmp_path / "rebuilt"
    (fresh / "var/lib/gpuhub/hub").mkdir(parents=True)
    (fresh / (backup.HUB_DB + "-wal")).write_text("a side file of the database this replaces")
    backup.restore(archive, root=fresh, check_services=False)
    assert (hub_root / (backup.HUB_DB + "-wal")).stat().st_size > 0  # the hub's writes were not checkpointed
    assert users(fresh) == ["alice"]  # the online copy has them all the same
    assert not (fresh / (backup.HUB_DB + "-wal")).exists()
    for rel in paths - {backup.HUB_DB}:
        assert (fresh / rel).read_bytes() == (hub_root / rel).read_bytes(), rel
        assert (fresh / rel).stat().st_mode & 0o777 == (hub_root / rel).stat().st_mode & 0o777, rel
    assert (fresh / "etc/gpuhub/secrets/proxy").stat().st_mode & 0o777 == 0o750
    assert not (fresh / "etc/gpuhub/agent.toml").exists() and not (fresh / "etc/gpuhub/secrets/link").exists()


def test_a_backup_needs_the_hub_database(tmp_path):
    with pytest.raises(backup.BackupError, match="run this on the hub host"):
        backup.create(tmp_path / "x.tar.gz", root=tmp_path)
    assert not (tmp_path / "x.tar.gz").exists()


def rewrite(archive: Path, out: Path, change) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    change(files)
    with tarfile.open(out, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_damaged_or_foreign_archives_are_refused_before_anything_is_written(hub_root, tmp_path):
    archive = tmp_path / "hub.tar.gz"
    backup.create(archive, root=hub_root)
    target = tmp_path / "target"
    target.mkdir()

    def tamper(files):
        files["etc/gpuhub/secrets/agent.token"] = b"someone else's token"

    def escape(files):
        manifest = json.loads(files[backup.MANIFEST])
        manifest["entries"].append({"path": "etc/../root/.ssh/authorized_keys", "mode": "0o600", "owner": "root",
                                    "group": "root", "sha256": ""})
        files[backup.MANIFEST] = json.dumps(manifest).encode()

    def foreign(files):
        files.pop(backup.MANIFEST)

    for change, message in ((tamper, "checksum"), (escape, "refusing"), (foreign, "not a gpuhub backup")):
        bad = rewrite(archive, tmp_path / f"{change.__name__}.tar.gz", change)
        with pytest.raises(backup.BackupError, match=message):
            backup.restore(bad, root=target, check_services=False)
        assert not any(target.iterdir()), change.__name__
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar at all")
    with pytest.raises(backup.BackupError, match="cannot read"):
        backup.restore(tmp_path / "junk.tar.gz", root=target, check_services=False)


def test_an_owner_this_host_lacks_stops_the_restore_before_it_writes(hub_root, tmp_path):
    archive = tmp_path / "hub.tar.gz"
    backup.create(archive, root=hub_root)

    def unknown_owner(files):
        manifest = json.loads(files[backup.MANIFEST])
        manifest["entries"][-1]["owner"] = "no-such-user-here"
        files[backup.MANIFEST] = json.dumps(manifest).encode()

    bad = rewrite(archive, tmp_path / "owner.tar.gz", unknown_owner)
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(backup.BackupError, match="run site\\.yml on it first"):
        backup.restore(bad, root=target, check_services=False)
    assert not any(target.iterdir())


def test_cli_says_what_is_wrong(tmp_path, capsys):
    assert cli_main(["restore", str(tmp_path / "missing.tar.gz")]) == 2
    assert "cannot read" in capsys.readouterr().err
