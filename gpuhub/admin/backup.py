"""``gpuhub backup`` and ``gpuhub restore``: the hub host's state in one archive (docs/backup.md).

What a rebuilt hub host needs to pick up where the old one left off: JupyterHub's database (users,
their servers, API tokens) and cookie secret (logged-in browsers stay logged in), the TLS certificate
(users' bookmarks and pinned certificates), every secret under /etc/gpuhub/secrets, and the
scheduler's books (kernels and their keys). GPU servers need no backup: each kernel's state lives in
three replicas, and a lost server's replicas are replaced.

The database is copied with SQLite's online backup, so a backup needs no downtime. A restore writes
each file atomically with its recorded mode and owner (by name: a rebuilt host may number its
service users differently), and only while JupyterHub and the scheduler are stopped.
"""

from __future__ import annotations

import grp
import hashlib
import io
import json
import os
import pwd
import sqlite3
import stat
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import gpuhub
from gpuhub.platform import releases

HUB_DB = "var/lib/gpuhub/hub/jupyterhub.sqlite"
# What a backup holds, relative to the root: single files, and directories taken whole.
FILES = (HUB_DB, "var/lib/gpuhub/hub/jupyterhub_cookie_secret", "var/lib/gpuhub/scheduler/books.json")
DIRS = ("etc/gpuhub/secrets", "etc/gpuhub/tls")
MANIFEST = "MANIFEST.json"
FORMAT = "gpuhub-backup/1"
# Stopped during a restore: they hold the database and the books open.
SERVICES = ("jupyterhub.service", "gpuhub-scheduler.service")


class BackupError(Exception):
    """A backup or restore that cannot be done; the message says why and what to do."""


@dataclass
class Entry:
    path: str  # relative to the root, e.g. etc/gpuhub/secrets/agent.token
    mode: int
    owner: str
    group: str
    sha256: str = ""
    directory: bool = False

    def to_dict(self) -> dict:
        return {"path": self.path, "mode": oct(self.mode), "owner": self.owner, "group": self.group,
                "sha256": self.sha256, "directory": self.directory}

    @classmethod
    def from_dict(cls, d: dict) -> Entry:
        return cls(path=str(d["path"]), mode=int(str(d["mode"]), 8), owner=str(d["owner"]), group=str(d["group"]),
                   sha256=str(d.get("sha256", "")), directory=bool(d.get("directory", False)))


def _names(st: os.stat_result) -> tuple[str, str]:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return owner, group


def _entry(root: Path, rel: str, data: bytes | None) -> Entry:
    st = (root / rel).stat()
    owner, group = _names(st)
    return Entry(path=rel, mode=stat.S_IMODE(st.st_mode), owner=owner, group=group,
                 sha256=hashlib.sha256(data).hexdigest() if data is not None else "", directory=data is None)


def _sqlite_copy(path: Path) -> bytes:
    """A consistent copy of a live SQLite database (the online backup API), as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy.sqlite"
        src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        dst = sqlite3.connect(copy)
        try:
            src.backup(dst)
        finally:
            dst.close()
            src.close()
        return copy.read_bytes()


def _collect(root: Path) -> list[tuple[Entry, bytes | None]]:
    found: list[tuple[Entry, bytes | None]] = []
    for rel in DIRS:
        top = root / rel
        if not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            d = Path(dirpath)
            found.append((_entry(root, d.relative_to(root).as_posix(), None), None))
            for name in sorted(filenames):
                f = d / name
                if f.is_symlink() or not f.is_file():
                    continue  # only plain files are state; links and sockets are remade by the roles
                data = f.read_bytes()
                found.append((_entry(root, f.relative_to(root).as_posix(), data), data))
    for rel in FILES:
        f = root / rel
        if not f.is_file():
            continue
        data = _sqlite_copy(f) if rel == HUB_DB else f.read_bytes()
        found.append((_entry(root, rel, data), data))
    return found


def create(archive: Path, root: Path = Path("/")) -> list[Entry]:
    """Write the hub host's state under ``root`` to ``archive`` (a .tar.gz readable by root only)."""
    found = _collect(root)
    if not any(e.path == HUB_DB for e, _ in found):
        raise BackupError(f"no JupyterHub database at /{HUB_DB}: run this on the hub host")
    manifest = {"format": FORMAT, "created": time.time(), "host": os.uname().nodename,
                "version": gpuhub.__version__, "release": releases.release_name(),
                "entries": [e.to_dict() for e, _ in found]}
    archive.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        _add(tar, MANIFEST, json.dumps(manifest, indent=2).encode())
        for entry, data in found:
            if data is not None:
                _add(tar, entry.path, data)
    os.replace(tmp, archive)
    return [e for e, _ in found]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _allowed(rel: str) -> bool:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return False
    return rel in FILES or any(rel == d or rel.startswith(d + "/") for d in DIRS)


def read(archive: Path) -> tuple[dict, dict[str, bytes]]:
    """The manifest and the files of ``archive``, checked: known paths only, every checksum right."""
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = {m.name: m for m in tar.getmembers()}
            if MANIFEST not in members:
                raise BackupError(f"{archive} is not a gpuhub backup (no {MANIFEST})")
            manifest = json.loads(tar.extractfile(members[MANIFEST]).read())
            if manifest.get("format") != FORMAT:
                raise BackupError(f"{archive}: format {manifest.get('format')!r}, this gpuhub reads {FORMAT}")
            files: dict[str, bytes] = {}
            for d in manifest["entries"]:
                e = Entry.from_dict(d)
                if not _allowed(e.path):
                    raise BackupError(f"{archive}: refusing {e.path!r}, which is not part of a gpuhub backup")
                if e.directory:
                    continue
                m = members.get(e.path)
                if m is None or not m.isfile():
                    raise BackupError(f"{archive}: {e.path} is listed but missing")
                data = tar.extractfile(m).read()
                if hashlib.sha256(data).hexdigest() != e.sha256:
                    raise BackupError(f"{archive}: {e.path} does not match its checksum (a damaged archive)")
                files[e.path] = data
    except (tarfile.TarError, OSError, EOFError, ValueError, KeyError) as exc:
        raise BackupError(f"cannot read {archive}: {exc}") from exc
    return manifest, files


def _ids(e: Entry) -> tuple[int, int]:
    try:
        uid = pwd.getpwnam(e.owner).pw_uid
        gid = grp.getgrnam(e.group).gr_gid
    except KeyError as exc:
        raise BackupError(f"{e.path} belongs to {e.owner}:{e.group}, which this host does not have: "
                          "run site.yml on it first (it creates the service users)") from exc
    return uid, gid


def running_services() -> list[str]:
    proc = subprocess.run(["systemctl", "is-active", *SERVICES], capture_output=True, text=True)
    states = proc.stdout.split()
    if len(states) != len(SERVICES):
        raise BackupError(f"cannot tell whether {', '.join(SERVICES)} are stopped: {proc.stderr.strip()}")
    return [s for s, state in zip(SERVICES, states, strict=True) if state in ("active", "activating", "reloading")]


def restore(archive: Path, root: Path = Path("/"), check_services: bool = True) -> list[Entry]:
    """Put the files of ``archive`` back under ``root``, each atomically, with its mode and owner."""
    manifest, files = read(archive)
    if check_services:
        busy = running_services()
        if busy:
            raise BackupError(f"stop {' and '.join(busy)} first (they hold the database and the books open): "
                              f"systemctl stop {' '.join(SERVICES)}")
    entries = [Entry.from_dict(d) for d in manifest["entries"]]
    ids = {e.path: _ids(e) for e in entries}  # every owner known before anything is written
    # First: SQLite would apply the replaced database's side files to the restored one, even after a
    # restore that stopped halfway.
    for suffix in ("-wal", "-shm", "-journal"):
        (root / (HUB_DB + suffix)).unlink(missing_ok=True)
    for e in sorted((e for e in entries if e.directory), key=lambda e: e.path.count("/")):
        d = root / e.path
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, *ids[e.path])
        os.chmod(d, e.mode)
    for e in entries:
        if e.directory:
            continue
        dest = root / e.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(files[e.path])
            os.chown(tmp, *ids[e.path])
            os.chmod(tmp, e.mode)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return entries
