"""The daemons' command line, as an admin runs it: ``gpuhub-agent --help-all`` documents every setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhub.agent.config import AgentConfig
from gpuhub.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,settings", [("gpuhub.agent.main", AgentConfig),
                                             ("gpuhub.scheduler.main", SchedulerConfig)])
def test_help_all_lists_every_setting_with_its_help(script, settings):
    out = subprocess.run([sys.executable, "-m", script, "--help-all"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "--config=<Unicode>" in out and "--log-level=" in out
    for name, trait in settings.class_traits(config=True).items():
        assert f"--{settings.__name__}.{name}=" in out
        assert trait.help, name
    assert "logging_config" not in out  # only the daemon's own settings
