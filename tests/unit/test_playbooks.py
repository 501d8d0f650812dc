"""The plays run as most sites run them: Ansible logs in as an ordinary admin account and becomes
root (sudo) where the work needs it, while what runs on the controller never asks for sudo there
(docs/install.md, "How Ansible logs in"). Checked on the YAML; the cluster tests run the same plays
through such an account (scripts/cluster.sh)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# Only gathers facts and checks the inventory against the argument specs: nothing to be root for.
UNPRIVILEGED_PLAYS = {("playbooks/facts.yml", "Learn the addresses of all gpuhub hosts and check the inventory")}
# Modules that never execute anything on a host (Ansible runs them inside the controller's process).
CONTROLLER_ONLY = {"set_fact", "debug", "assert", "fail", "include_tasks", "import_tasks", "include_role",
                   "import_role", "meta", "include_vars"}


def _plays():
    for path in [*sorted((ROOT / "playbooks").glob("*.yml")), ROOT / "site.yml"]:
        for play in yaml.safe_load(path.read_text()) or []:
            if "ansible.builtin.import_playbook" not in play and "import_playbook" not in play:
                yield path.relative_to(ROOT).as_posix(), play


def _tasks(items):
    for task in items or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks(task.get(key))


def _module(task: dict) -> str:
    names = [k for k in task if k.startswith("ansible.builtin.") or k in CONTROLLER_ONLY]
    return names[0].removeprefix("ansible.builtin.") if names else ""


def test_every_play_that_changes_hosts_becomes_root():
    plays = list(_plays())
    assert len(plays) >= 6
    missing = [(path, play["name"]) for path, play in plays
               if (path, play["name"]) not in UNPRIVILEGED_PLAYS and play.get("become") is not True]
    assert not missing, f"plays without become: true (they fail when Ansible logs in as a sudo user): {missing}"


def test_what_runs_on_the_controller_never_asks_for_sudo_there():
    delegated = []
    for path in sorted((ROOT / "roles").glob("*/*/*.yml")):
        if path.parent.name not in ("tasks", "handlers"):
            continue
        for task in _tasks(yaml.safe_load(path.read_text())):
            if task.get("delegate_to") in ("localhost", "127.0.0.1") and _module(task) not in CONTROLLER_ONLY:
                delegated.append(task)
                assert task.get("become") is False, (
                    f"{path.relative_to(ROOT)}: {task.get('name')!r} runs on the controller under the play's "
                    "become: set become: false (the controller need not have sudo)")
    assert delegated, "no task delegated to the controller found: did the roles' layout change?"
