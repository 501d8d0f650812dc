#!/usr/bin/python3
"""Start a new release's venv as a clone of an installed release with the same dependency pins.

Usage: clone_release.py RELEASES_DIR NEW_RELEASE DEPS_KEY

Releases are named <deps key>-<gpuhub hash> (docs/upgrades.md). An upgrade that changes only gpuhub's
own code would otherwise install every pinned dependency again: with torch in the extra requirements
that is gigabytes and minutes per server, and as much disk again for every release kept. A complete
release with the same deps key holds exactly those files, so the new one hard-links them (no copy,
no extra disk) and the playbook then reinstalls only the gpuhub wheel into it.

Why this is safe: installed releases are never written in place. pip unlinks a file before it
writes one, Python writes bytecode to a new file it renames, and a release is removed as a whole.
So the packages (lib/ and share/, where JupyterLab's and JupyterHub's static files are) are hard
links. Copied, with the old release's path replaced by the new one's: the files that name the
venv's own path (the scripts in bin/ by their shebang, pyvenv.cfg) and the few small ones outside
lib/ and share/, and the kernelspecs (share/jupyter/kernels/), which the play writes again for the
new release. The release's completeness marker is never copied: the playbook writes it once the
new release is built.

Prints "cloned from NAME" or "no release to clone"; exit status 0 either way (the playbook then
installs everything), 1 on an error that left NEW_RELEASE half-made (the playbook removes it).
Debian's python3 runs this: standard library only.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

COMPLETE_MARKER = ".gpuhub-release-complete"  # gpuhub/platform/releases.py


def pick_source(releases_dir: Path, new_name: str, deps_key: str) -> Path | None:
    """The complete release to clone: the current one (the venv link's) if its pins match, else
    the newest other one that matches."""
    candidates = [p for p in releases_dir.glob(f"{deps_key}-*")
                  if p.name != new_name and p.is_dir() and not p.is_symlink() and (p / COMPLETE_MARKER).is_file()]
    current = (releases_dir.parent / "venv").resolve()
    for p in candidates:
        if p.resolve() == current:
            return p
    return max(candidates, key=lambda p: (p / COMPLETE_MARKER).stat().st_mtime, default=None)


def is_shared(rel: Path) -> bool:
    """Whether the clone hard-links this file (a path relative to the release) instead of copying it."""
    parts = rel.parts
    return parts[0] in ("lib", "share") and parts[:3] != ("share", "jupyter", "kernels")


def copy_with_new_path(src: Path, dst: Path, old: bytes, new: bytes) -> None:
    data = src.read_bytes()
    dst.write_bytes(data.replace(old, new))
    shutil.copystat(src, dst)


def clone(source: Path, target: Path) -> None:
    old, new = str(source).encode(), str(target).encode()
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath)
        rel_dir = here.relative_to(source)
        (target / rel_dir).mkdir(exist_ok=True)
        shutil.copystat(here, target / rel_dir)
        for name in [*dirnames, *filenames]:
            src, rel = here / name, rel_dir / name
            dst = target / rel
            if src.is_symlink():  # bin/python, lib64 -> lib (os.walk does not descend into it)
                os.symlink(os.readlink(src).replace(str(source), str(target)), dst)
            elif name in dirnames:
                continue  # made when the walk gets there
            elif rel == Path(COMPLETE_MARKER):
                continue
            elif is_shared(rel):
                try:
                    os.link(src, dst)
                except FileNotFoundError:
                    continue  # a bytecode file's temporary name, renamed meanwhile: nothing to keep
                except OSError:  # another filesystem: a copy does as well
                    shutil.copy2(src, dst)
            else:
                copy_with_new_path(src, dst, old, new)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    releases_dir, new_release, deps_key = Path(argv[1]), Path(argv[2]), argv[3]
    source = pick_source(releases_dir, new_release.name, deps_key)
    if source is None:
        print("no release to clone")
        return 0
    if new_release.exists():
        shutil.rmtree(new_release)
    clone(source, new_release)
    print(f"cloned from {source.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
