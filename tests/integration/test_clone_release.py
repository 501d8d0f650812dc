"""An upgrade with the same pins starts its release as a hard-linked clone of the installed one
(roles/gpuhub_python/files/clone_release.py), with real venvs and pip, as the play runs it: the new
release runs from its own path, and installing the new gpuhub into it leaves the old one as it was."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLONE = ROOT / "roles" / "gpuhub_python" / "files" / "clone_release.py"
MARKER = ".gpuhub-release-complete"
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}


def wheel(dest: Path, name: str, version: str, module: str, script: str = "") -> Path:
    """A pure-Python wheel, written by hand (the format is a zip with three metadata files)."""
    path = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": module,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if script:
        files[f"{info}/entry_points.txt"] = f"[console_scripts]\n{script} = {name}:main\n"
    record = []
    for fname, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{fname},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for fname, text in files.items():
            z.writestr(fname, text)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def make_release(path: Path, *wheels: Path) -> None:
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(path)], check=True, timeout=120)
    subprocess.run([str(path / "bin" / "pip"), "install", "--quiet", "--no-index", *map(str, wheels)],
                   check=True, timeout=120, env=PIP_ENV)
    (path / MARKER).write_text(path.name + "\n")


def clone(releases: Path, new: Path, deps_key: str) -> str:
    r = subprocess.run(["/usr/bin/python3", str(CLONE), str(releases), str(new), deps_key],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def site_packages(venv: Path) -> Path:
    (sp,) = venv.glob("lib/python3.*/site-packages")
    return sp


def test_a_release_with_the_same_pins_is_cloned_and_only_gpuhub_reinstalled(tmp_path):
    releases, wheels = tmp_path / "venvs", tmp_path / "wheels"
    releases.mkdir()
    wheels.mkdir()
    dep = wheel(wheels, "depprobe", "1.0", "import sys\ndef main():\n    print(sys.prefix)\n", script="depprobe")
    app1 = wheel(wheels, "appprobe", "1.0", "VERSION = 1\n")
    app2 = wheel(wheels, "appprobe", "2.0", "VERSION = 2\n")
    old = releases / "deps1-aaaa"
    make_release(old, dep, app1)
    (tmp_path / "venv").symlink_to(old)  # the current release, as /opt/gpuhub/venv names it
    new = releases / "deps1-bbbb"

    assert clone(releases, new, "deps1") == "cloned from deps1-aaaa"
    assert not (new / MARKER).exists(), "the clone must not look complete before the play marks it"
    subprocess.run([str(new / "bin" / "pip"), "install", "--quiet", "--no-index", "--no-deps", "--force-reinstall",
                    str(app2)], check=True, timeout=120, env=PIP_ENV)

    # The new release runs from its own path, its scripts too, with the new gpuhub and the same deps.
    out = subprocess.run([str(new / "bin" / "python"), "-c",
                          "import sys, appprobe, depprobe; print(sys.prefix, appprobe.VERSION, depprobe.__file__)"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == [str(new), "2", str(site_packages(new) / "depprobe.py")], out
    assert subprocess.run([str(new / "bin" / "depprobe")], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip() == str(new)
    assert str(old) not in (new / "pyvenv.cfg").read_text() + (new / "bin" / "activate").read_text()
    # The dependencies are the old release's files, not copies.
    assert (site_packages(new) / "depprobe.py").stat().st_ino == (site_packages(old) / "depprobe.py").stat().st_ino
    # A kernelspec written for the new release leaves the old one's as it was.
    kernels = Path("share") / "jupyter" / "kernels"
    for release in (old, new):
        (release / kernels / "gpuhub-gpu").mkdir(parents=True, exist_ok=True)
    (old / kernels / "gpuhub-gpu" / "kernel.json").write_text(str(old))
    clone(releases, releases / "deps1-cccc", "deps1")
    assert (releases / "deps1-cccc" / kernels / "gpuhub-gpu" / "kernel.json").stat().st_ino != \
        (old / kernels / "gpuhub-gpu" / "kernel.json").stat().st_ino
    # And the old release is as it was: its gpuhub, its scripts naming its own path.
    out = subprocess.run([str(old / "bin" / "python"), "-c",
                          "import sys, appprobe; print(sys.prefix, appprobe.VERSION)"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == [str(old), "1"], out
    assert subprocess.run([str(old / "bin" / "depprobe")], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip() == str(old)
    assert (old / MARKER).exists()


def test_only_a_complete_release_with_the_same_pins_is_cloned_the_current_one_first(tmp_path):
    releases = tmp_path / "venvs"
    for name, complete in (("deps1-old", True), ("deps1-cur", True), ("deps1-newer", True), ("deps1-broken", False),
                           ("deps2-other", True)):
        (releases / name / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
        (releases / name / "lib" / "python3.11" / "site-packages" / "m.py").write_text(name)
        if complete:
            (releases / name / MARKER).write_text(name)
    os.utime(releases / "deps1-newer" / MARKER, (4e9, 4e9))
    (tmp_path / "venv").symlink_to(releases / "deps1-cur")
    assert clone(releases, releases / "deps1-new", "deps1") == "cloned from deps1-cur"
    (tmp_path / "venv").unlink()
    (tmp_path / "venv").symlink_to(releases / "deps2-other")
    assert clone(releases, releases / "deps1-new2", "deps1") == "cloned from deps1-newer"
    assert clone(releases, releases / "deps3-new", "deps3") == "no release to clone"
    assert not (releases / "deps3-new").exists()
    # A half-made clone of an interrupted run is replaced.
    assert clone(releases, releases / "deps1-new2", "deps1") == "cloned from deps1-newer"
