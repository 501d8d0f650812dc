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


def test_gpu_servers_upgrade_in_batches_that_stop_at_the_first_failure():
    """An upgrade restarts the agents a batch at a time (serial) and leaves the rest alone once one
    fails (docs/upgrades.md); each batch waits until its agents answer from the new release."""
    (play,) = [p for path, p in _plays() if path == "playbooks/gpu_nodes.yml"]
    assert "gpuhub_gpu_nodes_serial" in str(play.get("serial")) and play.get("max_fail_percentage") == 0
    tasks = yaml.safe_load((ROOT / "roles/gpuhub_agent/tasks/main.yml").read_text())
    names = [t["name"] for t in tasks]
    flush = next(i for i, t in enumerate(tasks) if t.get("ansible.builtin.meta") == "flush_handlers")
    wait = next(i for i, t in enumerate(tasks) if "ansible.builtin.uri" in t)
    assert flush < wait, names
    assert tasks[wait]["no_log"] is True  # the request carries the agent token


def test_a_new_release_is_built_beside_the_running_one_and_switched_atomically():
    """The venv is never changed under running processes: a release is built in its own directory
    (skipped when it exists), then the symlink is switched with the file module."""
    tasks = yaml.safe_load((ROOT / "roles/gpuhub_python/tasks/main.yml").read_text())
    build = next(t for t in tasks if "block" in t)
    switch = next(i for i, t in enumerate(tasks) if t.get("ansible.builtin.file", {}).get("state") == "link")
    assert tasks.index(build) < switch
    assert "release_built" in build["when"]
    targets = [str(t.get("ansible.builtin.command", {}).get("argv", "")) for t in _tasks(build["block"])]
    assert any("gpuhub_python_release" in a and "pip" in a for a in targets)
    assert not any("gpuhub_python_venv" in a for a in targets), "the build must not touch the current venv"


def test_each_tier_and_each_monitoring_role_of_site_yml_can_be_run_alone_by_tag():
    """`ansible-playbook site.yml --tags hub` (or monitoring, prometheus, ...) runs that part only;
    the facts play runs whatever is selected, since every other play needs its facts. The gpuhub
    roles have no tag of their own: under one, Ansible would count the base role they depend on as
    run (its argument check is tagged always) and skip its tasks, which define their tokens."""
    imported = {step["ansible.builtin.import_playbook"].removeprefix("playbooks/")
                for step in yaml.safe_load((ROOT / "site.yml").read_text())}
    untagged, monitoring_roles = [], {}
    for path, play in _plays():
        if path.removeprefix("playbooks/") not in imported | {"facts.yml"}:
            continue
        tags = play.get("tags") or []
        if not tags:
            untagged.append((path, play["name"]))
        if path == "playbooks/facts.yml":
            assert tags == ["always"], tags
        for role in play.get("roles") or []:
            name = role if isinstance(role, str) else role["role"]
            if name.startswith("gpuhub"):
                assert isinstance(role, str) or not role.get("tags"), f"{path}: {name} has a tag of its own"
            else:
                monitoring_roles[name] = role.get("tags") if isinstance(role, dict) else None
    assert not untagged, f"plays without tags: {untagged}"
    assert monitoring_roles == {r: [r] for r in ("node_exporter", "prometheus", "alertmanager", "grafana")}
