"""gpuhub-agent's settings: the keys of /etc/gpuhub/agent.toml (``gpuhub-agent --help-all`` lists them)."""

from __future__ import annotations

import os

from traitlets import Dict, Enum, Float, Int, List, TraitError, Unicode, default, validate

from gpuhub.platform.http_server import HttpLimits, MetricsAccess
from gpuhub.platform.tls import TlsSettings, api_scheme


class AgentConfig(HttpLimits, MetricsAccess, TlsSettings):
    """The agent's settings; in the TOML file as top-level keys."""

    node_name = Unicode(config=True, help="This node's name in the scheduler's books (default: the host name).")
    listen_address = Unicode("127.0.0.1", config=True, help="Address the agent's HTTP API listens on.")
    port = Int(8601, min=1, max=65535, config=True, help="Port of the agent's HTTP API.")
    advertise_url = Unicode(
        config=True,
        help="URL the scheduler and the hub reach this agent at (default: http(s)://{kernel_ip}:{port},\n"
             "https when tls_cert_file is set).",
    )
    kernel_ip = Unicode("127.0.0.1", config=True,
                        help="Address kernel units listen on (their ZMQ, Raft and blob ports).")
    token_file = Unicode("/etc/gpuhub/secrets/agent.token", config=True,
                         help="File with the token callers of this agent's API present, or sha256:<its hex "
                              "digest> (what the roles install: the host never holds the token; mode 0600).")
    scheduler_url = Unicode(config=True, help="gpuhub-scheduler's URL to heartbeat to; empty: no heartbeats.")
    scheduler_token_file = Unicode("/etc/gpuhub/secrets/scheduler.token", config=True,
                                   help="File with the scheduler's token, read only when scheduler_url is set.")
    state_dir = Unicode("/var/lib/gpuhub/agent", config=True, help="Directory of the agent's state (units, leases).")
    runtime_dir = Unicode("/run/gpuhub", config=True, help="Directory of the units' runtime files.")
    venv = Unicode("/opt/gpuhub/venv", config=True, help="The gpuhub virtual environment units run from.")
    unit_backend = Enum(["systemd", "process"], default_value="systemd", config=True,
                        help="How units run: 'systemd' (transient units) or 'process' (plain child processes, "
                             "for development).")
    min_uid = Int(1000, config=True, help="Lowest uid a unit may run as (keeps system accounts out).")
    roles = List(Unicode(), default_value=["gpu", "notebook"], config=True,
                 help="What this node hosts: 'gpu' (kernel replicas) and/or 'notebook' (users' Jupyter servers).")
    heartbeat_interval_s = Float(5.0, config=True, help="Seconds between heartbeats to the scheduler.")
    lease_check_interval_s = Float(2.0, config=True, help="Seconds between checks for expired GPU leases.")
    gpu_linger_s = Float(30.0, min=0.0, config=True,
                         help="Seconds a GPU cell's process (its CUDA context and GPU memory) stays for the "
                              "kernel's next cell while no other kernel asks for its GPUs; 0: never.")
    # Below Linux's ephemeral range (32768-60999), so no outgoing connection grabs one between
    # allocation and bind, and a known range to open between GPU nodes and notebook hosts in a firewall.
    kernel_ports = List(Int(), default_value=[20000, 29999], config=True,
                        help="[first, last]: the ports of kernel units (5 Jupyter + Raft + blob each), "
                             "at least 7, from 1024 up.")
    gpus = Dict(config=True,
                help="GPU inventory: backend = 'auto', 'nvml', 'fake' or 'none'; fake = [{name, memory_mib}].")
    server_tls_cert_file = Unicode(config=True,
                                   help="Certificate (PEM) users' servers on this host serve https with; empty: plain\n"
                                        "http. Its names must include kernel_ip, where the proxy reaches them.")
    server_tls_key_file = Unicode(config=True, help="The key of server_tls_cert_file (each server gets a copy its "
                                                    "user alone can read).")
    device_policy = Enum(["closed", "open"], default_value="closed", config=True,
                         help="'closed': a unit opens systemd's pseudo devices, unit_devices and (kernels) the\n"
                              "GPU driver's control node, and a GPU's device node only while a cell holds its\n"
                              "grant. 'open': units open every device (no DevicePolicy=; the lease is advisory).")
    unit_devices = List(Unicode(), config=True,
                        help="More devices every kernel and server unit may open under device_policy 'closed':\n"
                             "paths under /dev/ or systemd's char-<driver> / block-<driver> (e.g. /dev/fuse,\n"
                             "char-infiniband_verbs).")
    limits = Dict(config=True, help="Resource limits of units: kernel_memory_max, kernel_cpu_quota, "
                                    "server_memory_max, server_cpu_quota (systemd values).")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # Empty (unset, or "" in the file): derived once, from the final kernel_ip and port.
        if not self.advertise_url:
            self.advertise_url = f"{api_scheme(self.tls_cert_file)}://{self.kernel_ip}:{self.port}"

    @default("node_name")
    def _default_node_name(self) -> str:
        return os.uname().nodename

    @validate("unit_devices")
    def _check_unit_devices(self, proposal) -> list:
        for d in proposal.value:
            if not d.startswith(("/dev/", "char-", "block-")) or any(c.isspace() for c in d):
                raise TraitError(f"unit_devices: {d!r} is not a path under /dev/ nor char-<driver> / block-<driver> "
                                 "(access is always rw; no spaces)")
        return proposal.value

    @validate("kernel_ports")
    def _check_kernel_ports(self, proposal) -> list:
        ports = proposal.value
        if (len(ports) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
                or not 1024 <= ports[0] <= ports[1] - 6 <= 65535 - 6):
            raise TraitError(f"kernel_ports must be [first, last] with 1024 <= first and at least 7 ports "
                             f"up to 65535, not {ports!r}")
        return ports
