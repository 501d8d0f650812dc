"""The simulator as a command (python -m gpuhub.sim), in a child process; the rest of the CLI is
tested in-process in tests/sim/test_cli.py."""

import json
import os
import subprocess
import sys

from gpuhub.sim.cli import main


def test_python_dash_m(tmp_path):
    out = str(tmp_path / "gen")
    main(["generate", out, "--sessions", "3", "--hours", "3"])
    env = dict(os.environ)
    p = subprocess.run(
        [sys.executable, "-m", "gpuhub.sim", "run", out, "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["policy"] == "gpuhub"
    p = subprocess.run(
        [sys.executable, "-m", "gpuhub.sim", "run", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "not a directory" in p.stderr
