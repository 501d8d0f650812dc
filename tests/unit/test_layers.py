"""The tree is the process map: a package imports another process's package only through a
documented interface (docs/architecture.md, "The map"). Checked on the source, without importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuhub

ROOT = Path(gpuhub.__file__).parent

# Pure policy modules: the daemons and the simulator run the same rules.
POLICY = {"gpuhub.scheduler.placement", "gpuhub.scheduler.migration", "gpuhub.scheduler.pool",
          "gpuhub.agent.leases", "gpuhub.replication.election"}

# What each package may import besides itself, gpuhub/platform and the policy modules: whole
# packages by name, or single modules by their dotted path.
ALLOWED = {
    "platform": set(),
    "gpus": set(),
    "monitoring": set(),
    "agent": {"gpus"},
    "scheduler": set(),
    "hub": set(),
    "server": set(),
    "kernel": {"replication"},
    "replication": set(),
    "sim": set(),
    # `gpuhub sim`, `gpuhub local-kernel`; `gpuhub nodes` reads the scheduler's config file on the hub,
    # `gpuhub quota grant` the agent's (its min_uid)
    "admin": {"sim", "dev", "gpuhub.scheduler.config", "gpuhub.agent.config"},
    "dev": None,  # the harness starts every process: it may import anything
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gpuhub" else None


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every gpuhub import in ``path``, also inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("gpuhub.")]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and (node.module == "gpuhub" or node.module.startswith("gpuhub."))):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def is_policy(module: str, names: list[str]) -> bool:
    """``import gpuhub.agent.leases``, ``from gpuhub.agent.leases import LeaseBook`` or
    ``from gpuhub.agent import leases``."""
    return module in POLICY or (bool(names) and all(f"{module}.{n}" in POLICY for n in names))


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if len(rel.parts) < 3:
            continue  # gpuhub/__init__.py: the version
        own = rel.parts[1]
        if own not in ALLOWED:
            found.append(f"{rel}: package {own!r} is not in the process map (add it to ALLOWED and the docs)")
            continue
        allowed = ALLOWED[own]
        if allowed is None:
            continue
        for line, module, names in imports(path):
            targets = {package_of(f"{module}.{n}") for n in names} if module == "gpuhub" else {package_of(module)}
            if targets <= {None, own, "platform"} | allowed or module in allowed or is_policy(module, names):
                continue
            found.append(f"{rel}:{line}: {own} imports {module}")
    return found


def test_no_package_reaches_into_another_process():
    assert violations() == []


def test_the_check_catches_a_back_edge(tmp_path):
    """The rule is not vacuous: a scheduler module importing the kernel is reported, its use of a
    policy module is not."""
    fake = tmp_path / "gpuhub"
    (fake / "scheduler").mkdir(parents=True)
    (fake / "scheduler" / "bad.py").write_text(
        "from gpuhub.scheduler.placement import place_replicas\nfrom gpuhub.kernel import kernel\n")
    assert violations(fake) == ["gpuhub/scheduler/bad.py:2: scheduler imports gpuhub.kernel"]
