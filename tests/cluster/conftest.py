"""Fixtures for the end-to-end tests against a running local cluster (scripts/cluster.sh).

The cluster is chosen by GPUHUB_CLUSTER (default: the first of ``ci``, ``demo``, ``dev`` that has a
generated inventory under .cache/). Without one, the cluster tests skip and say how to start one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "scripts" / "containers.conf"


@dataclass
class Cluster:
    name: str
    inventory_dir: Path
    hosts: dict[str, str]  # inventory name -> address
    containers: dict[str, str]  # inventory name -> podman container
    groups: dict[str, list[str]]
    agent_tokens: dict[str, str] = field(repr=False)  # inventory name -> that host's agent token
    passwords: dict[str, str] = field(default_factory=dict, repr=False)
    ca_file: str = ""  # the cluster CA and the hub's certificate: HTTPS is verified against them

    @property
    def hub(self) -> str:
        return self.hosts[self.groups["hub"][0]]

    @property
    def hub_url(self) -> str:
        return f"https://{self.hub}"

    def agent_url(self, node: str) -> str:
        return f"https://{self.hosts[node]}:8601"

    def agent_auth(self, node: str) -> dict[str, str]:
        """The header that opens ``node``'s agent API (its own token; no other agent takes it)."""
        return {"Authorization": f"Bearer {self.agent_tokens[node]}"}

    @property
    def scheduler_url(self) -> str:
        return f"https://{self.hub}:8600"

    def exec(self, node: str, *argv: str, check: bool = True) -> str:
        """Run a command inside a cluster host (as root), like an admin on its console."""
        env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
        proc = subprocess.run(
            ["podman", "exec", self.containers[node], *argv], capture_output=True, text=True, env=env, timeout=60
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{node}: {' '.join(argv)} failed: {proc.stderr or proc.stdout}")
        return proc.stdout


def ansible_playbook(cluster: Cluster, playbook: str, *args: str, tree: Path = ROOT, timeout: float = 1500) -> str:
    """``ansible-playbook PLAYBOOK ARGS`` from ``tree`` (a gpuhub checkout) against the cluster's
    inventory, as an admin runs it; its output. Fails the test with the output's tail if it fails.
    The GPU servers go all at once, as ``scripts/cluster.sh deploy`` sends them; ``-e
    gpuhub_gpu_nodes_serial=N`` in ARGS comes later and wins."""
    binary = Path(sys.executable).parent / "ansible-playbook"
    env = dict(os.environ, ANSIBLE_CONFIG=str(tree / "ansible.cfg"), CONTAINERS_CONF=str(CONTAINERS_CONF))
    started = time.monotonic()
    argv = [str(binary), "-i", str(cluster.inventory_dir / "hosts.yml"), playbook,
            "-e", "gpuhub_gpu_nodes_serial=100%", *args]
    proc = subprocess.run(argv, cwd=tree,
                          env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{playbook} from {tree}: {time.monotonic() - started:.0f} s")
    assert proc.returncode == 0, f"{playbook} from {tree} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _find_cluster() -> Path | None:
    wanted = os.environ.get("GPUHUB_CLUSTER")
    names = [wanted] if wanted else ["ci", "demo", "dev"]
    for name in names:
        inv = ROOT / ".cache" / name / "inventory"
        if (inv / "hosts.yml").is_file() and (inv / "credentials" / "scheduler.token").is_file():
            return inv
    return None


def load_cluster(ca_dir: Path) -> Cluster | str:
    """The deployed cluster (see _find_cluster), or why there is none to use. ``ca_dir`` receives
    the hub's certificate, which HTTPS clients verify against."""
    inv = _find_cluster()
    if inv is None:
        return ("no deployed cluster: run `scripts/cluster.sh up NAME && scripts/cluster.sh deploy NAME` "
                "(or `make test-cluster`) and set GPUHUB_CLUSTER=NAME")
    data = yaml.safe_load((inv / "hosts.yml").read_text())["all"]
    hosts = {h: v["ansible_host"] for h, v in data["hosts"].items()}
    containers = {h: v["gpuhub_container"] for h, v in data["hosts"].items()}
    groups = {g: list((v or {}).get("hosts", {}) or {}) for g, v in data.get("children", {}).items()}
    creds = inv / "credentials"
    passwords = {p.name: p.read_text().split()[0] for p in sorted((creds / "users").glob("*"))}
    c = Cluster(
        name=inv.parent.name,
        inventory_dir=inv,
        hosts=hosts,
        containers=containers,
        groups=groups,
        agent_tokens={p.stem: p.read_text().strip() for p in sorted((creds / "agents").glob("*.token"))},
        passwords=passwords,
    )
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    running = subprocess.run(
        ["podman", "ps", "--format", "{{.Names}}"], capture_output=True, text=True, env=env
    ).stdout.split()
    missing = [ctr for ctr in containers.values() if ctr not in running]
    if missing:
        return f"cluster {c.name} is not running ({', '.join(missing)} down): scripts/cluster.sh up {c.name}"
    # The cluster CA, which signed the hub's certificate and the agents' and the scheduler's, and the
    # hub's own certificate (self-signed when the inventory turns the cluster's TLS off).
    ca = ca_dir / "trusted.pem"
    ca.write_text(c.exec(c.groups["hub"][0], "cat", "/etc/gpuhub/secrets/proxy/tls.crt")
                  + (creds / "tls" / "ca.crt").read_text())
    c.ca_file = str(ca)
    return c


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    found = load_cluster(tmp_path_factory.mktemp("tls"))
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed cluster test keeps every host's journal from the test's start: a flaky failure is
    understood from what it left, not from a rerun that passes."""
    report = yield
    cluster = item.funcargs.get("cluster")
    if report.when == "call" and report.failed and isinstance(cluster, Cluster):
        # not under .cache/<cluster>/, which `scripts/cluster.sh down` (molecule's destroy in CI) removes
        dest = ROOT / ".cache" / "failed-tests" / cluster.name / re.sub(r"[^A-Za-z0-9_.-]", "_", item.name)
        dest.mkdir(parents=True, exist_ok=True)
        for host in cluster.containers:
            journal = cluster.exec(host, "journalctl", "--no-pager", "-o", "short-precise",
                                   "--since", f"@{call.start - 5:.0f}", check=False)
            (dest / f"{host}.journal").write_text(journal)
        report.sections.append(("journals", f"every host's journal since the test began: {dest}"))
    return report
