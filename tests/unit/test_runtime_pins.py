"""requirements/runtime.txt: every pin exact and hash-checked (the wheelhouse is built with
pip --require-hashes from it, scripts/build-wheelhouse.sh)."""

from __future__ import annotations

import re
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "requirements" / "runtime.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ]+) \\$")
HASH = re.compile(r"^    --hash=sha256:[0-9a-f]{64}( \\)?$")


def pins() -> dict[str, list[str]]:
    """name -> its hash lines, failing on any line that is neither a comment, a pin nor a hash."""
    found: dict[str, list[str]] = {}
    name = None
    for line in RUNTIME.read_text().splitlines():
        if line.startswith("#"):
            continue
        if m := PIN.match(line):
            name = m.group(1).lower()
            assert name not in found, f"{name} pinned twice"
            found[name] = []
        else:
            assert HASH.match(line) and name is not None, f"not a pin or a hash line: {line!r}"
            found[name].append(line)
    return found


def test_every_runtime_pin_is_exact_and_carries_at_least_one_hash():
    found = pins()
    assert {"jupyterhub", "pysyncobj", "pyzmq", "ipykernel"} <= set(found)
    assert [n for n, hashes in found.items() if not hashes] == []
    for hashes in found.values():  # the last hash of a pin ends it: no continuation into the next pin
        assert not hashes[-1].endswith("\\") and all(h.endswith("\\") for h in hashes[:-1])
