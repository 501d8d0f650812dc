"""Every systemd service gpuhub installs or tightens gets its sandbox from one template
(roles/systemd_hardening), so the settings cannot drift apart between roles; what a unit needs
beyond it is declared where the role includes it. Rendered here with Jinja as Ansible's template
module does (trim_blocks; the one Ansible filter the roles pass in, dirname). Not with Ansible's own
templating: importing it patches sys.intern for the whole test process, which breaks PyTorch's
compiler in later tests. The cluster tests read the same settings back from systemd
(tests/cluster/test_e2e.py)."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "systemd_hardening"
# Debian's (or Grafana's) own units that the roles tighten with a drop-in.
PACKAGED = {"prometheus.service", "prometheus-alertmanager.service", "prometheus-node-exporter.service",
            "grafana-server.service"}
# Always on, whatever the unit declares.
FIXED = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectKernelTunables": "yes",
         "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes",
         "ProtectHostname": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes", "RestrictNamespaces": "yes",
         "LockPersonality": "yes", "SystemCallArchitectures": "native"}
# Settings through which systemd closes devices (a device allow-list or a private /dev).
CLOSES_DEVICES = {"PrivateDevices": "yes", "ProtectClock": "yes"}


def _tasks(items):
    for task in items or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks(task.get(key))


def sandboxes() -> dict[str, dict]:
    """unit -> the variables its role includes systemd_hardening with."""
    found = {}
    for path in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        for task in _tasks(yaml.safe_load(path.read_text())):
            include = task.get("ansible.builtin.include_role") or {}
            if include.get("name") == "systemd_hardening":
                variables = task["vars"]
                assert variables["systemd_hardening_unit"] not in found, f"{path}: a second sandbox"
                found[variables["systemd_hardening_unit"]] = variables
    return found


def render(variables: dict) -> dict[str, str]:
    """The drop-in's settings, as the template module would write them."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    env.filters["dirname"] = os.path.dirname
    context = {**yaml.safe_load((ROLE / "defaults" / "main.yml").read_text()),
               **yaml.safe_load((ROOT / "roles/gpuhub/defaults/main.yml").read_text()),
               "alertmanager_storage_dir": "/var/lib/prometheus/alertmanager", "ansible_managed": "managed"}

    def value(v):
        if isinstance(v, list):
            return [value(item) for item in v]
        return env.from_string(v).render(context) if isinstance(v, str) else v

    context.update({k: value(v) for k, v in variables.items()})
    text = env.from_string((ROLE / "templates" / "hardening.conf.j2").read_text()).render(context)
    settings = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            assert key not in settings, f"{key} written twice"
            settings[key] = value
    return settings


def test_every_service_the_roles_install_or_tighten_has_the_sandbox():
    installed = {p.name.removesuffix(".j2") for p in (ROOT / "roles").glob("*/templates/*.service.j2")}
    assert len(installed) >= 5
    assert installed | PACKAGED <= set(sandboxes()), "a service without roles/systemd_hardening's drop-in"


def test_no_unit_file_carries_a_sandbox_of_its_own():
    keys = set(render({"systemd_hardening_unit": "x.service"}))
    for path in (ROOT / "roles").glob("*/templates/*.service.j2"):
        own = {line.split("=", 1)[0] for line in path.read_text().splitlines() if "=" in line} & keys
        assert not own, f"{path.relative_to(ROOT)} sets {sorted(own)}: declare them where it includes systemd_hardening"


@pytest.mark.parametrize("unit", sorted(sandboxes()))
def test_each_sandbox_keeps_the_fixed_settings(unit):
    settings = render(sandboxes()[unit])
    assert {k: settings.get(k) for k in FIXED} == FIXED
    assert settings["UMask"] in ("0077", "0027", "0022")
    assert "{" not in settings.get("ReadWritePaths", "")
    if settings.get("SystemCallFilter"):
        assert settings["SystemCallErrorNumber"] == "EPERM"  # an unexpected call fails, it does not kill


def test_the_agent_can_open_the_gpus_and_the_other_daemons_cannot():
    # ProtectClock= puts a device allow-list in force: on a cgroup v2 host it would close /dev/nvidia*
    # to the agent, and NVML with it. PrivateDevices= closes the others' devices (it implies a closed
    # device policy); ProtectClock is off only where the clock's state is read (the node exporter).
    for unit, variables in sandboxes().items():
        settings = render(variables)
        closes = {k for k, v in CLOSES_DEVICES.items() if settings[k] == v}
        assert not {"DeviceAllow", "DevicePolicy"} & set(settings)
        if unit == "gpuhub-agent.service":
            assert not closes, settings
        elif unit == "prometheus-node-exporter.service":
            assert closes == {"PrivateDevices"} and "adjtimex" in settings["SystemCallFilter"].split(), settings
        else:
            assert closes == set(CLOSES_DEVICES), f"{unit} keeps the host's devices"


def test_only_the_agent_and_the_proxy_keep_capabilities():
    kept = {unit: render(v)["CapabilityBoundingSet"] for unit, v in sandboxes().items()}
    assert kept.pop("gpuhub-agent.service").split() == ["CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE",
                                                         "CAP_DAC_READ_SEARCH", "CAP_KILL"]
    assert kept.pop("configurable-http-proxy.service") == "CAP_NET_BIND_SERVICE"
    assert kept.pop("gpuhub-cert-metrics.service").split() == ["CAP_DAC_READ_SEARCH", "CAP_DAC_OVERRIDE"]
    assert set(kept.values()) == {""}


def test_units_in_a_user_namespace_of_their_own_get_no_protect_proc():
    # Debian's prometheus.service has PrivateUsers=yes: systemd cannot mount a /proc that hides other
    # users' processes inside a user namespace without a PID namespace, so with ProtectProc= the
    # service failed to start (226/NAMESPACE; the cluster deploy found it). Grafana's unit is not
    # tried here at all.
    for unit in ("prometheus.service", "grafana-server.service"):
        assert "ProtectProc" not in render(sandboxes()[unit]), unit


def test_the_certificate_metrics_command_line_names_only_the_watched_files():
    # The template module's trim_blocks eats the newline after a block tag that ends a line: a comment
    # put right below the ExecStart= line became arguments of the command (found on the cluster).
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True)
    watched = ["/etc/gpuhub/tls/host.crt", "/etc/gpuhub/secrets/proxy/tls.crt"]
    text = env.from_string((ROOT / "roles/gpuhub/templates/gpuhub-cert-metrics.service.j2").read_text()).render(
        ansible_managed="managed", gpuhub_cert_metrics_file="/m/certs.prom", gpuhub_common_watched_certs=watched)
    (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.split()[-len(watched) - 2:] == ["--output", "/m/certs.prom", *watched]
