"""A wrong inventory variable fails the run at once, with the argument_specs message naming it.

Fast (a few seconds) and local: ansible-playbook against localhost (connection local), with an
inventory in a temporary directory. It never reaches a task that changes anything: playbooks/facts.yml
only gathers facts and validates; the role-level check runs in check mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def run_playbook(tmp_path: Path, playbook: str, bad: dict, *extra: str) -> subprocess.CompletedProcess:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-playbook is not installed next to this Python (make venv)")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "hosts": {"localhost": local},
            "children": {g: {"hosts": {"localhost": None}} for g in ("hub", "notebook_hosts", "gpu_nodes")},
            "vars": bad,
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(tmp_path / "hosts.yml"), str(ROOT / playbook), *extra],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"gpuhub_max_subscription_ratio": "abc"}, "'gpuhub_max_subscription_ratio' is of type"),
        ({"gpuhub_agent_gpu_backend": "cuda"}, "gpuhub_agent_gpu_backend must be one of: auto, nvml, fake, none"),
        ({"gpuhub_users": [{"name": "alice"}]}, "missing required arguments: uid"),
        ({"gpuhub_profiles": [{"name": "gpu1", "display": "1 GPU", "gpus": "one"}]}, "'gpus' is of type"),
    ],
)
def test_inventory_is_checked_before_anything_runs(tmp_path, bad, message):
    proc = run_playbook(tmp_path, "playbooks/facts.yml", bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Validation of arguments failed" in out and message in out, out
    assert "changed=0" in out, out


def test_role_refuses_a_wrong_variable_itself(tmp_path):
    """The role's own meta/argument_specs.yml, when a play uses the role directly."""
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{
        "name": "Use the scheduler role alone", "hosts": "hub", "gather_facts": False,
        "roles": [{"role": "gpuhub_scheduler"}],
    }]))
    (tmp_path / "credentials").mkdir()
    proc = run_playbook(tmp_path, str(play), {"gpuhub_max_subscription_ratio": "abc",
                                               "gpuhub_credentials_dir": str(tmp_path / "credentials"),
                                               "gpuhub_address": "127.0.0.1"},
                        "--check", "--tags", "never_matches_anything_but_validation")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Validation of arguments failed" in out and "gpuhub_max_subscription_ratio" in out, out
