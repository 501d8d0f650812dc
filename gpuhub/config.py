"""Daemon configuration: TOML files under /etc/gpuhub/, validated with clear errors."""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file is missing, malformed, or has a wrong value; the message says which and where."""


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def read_secret(path: str | os.PathLike, what: str) -> str:
    """Read a token file; refuse files others can read (a leaked token is an open cluster)."""
    p = Path(path)
    try:
        st = p.stat()
        value = p.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"{what}: token file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"{what}: cannot read token file {path} (permission denied)") from None
    if st.st_mode & (stat.S_IRWXO):
        raise ConfigError(f"{what}: token file {path} is readable by others; chmod 600 it")
    if len(value) < 16:
        raise ConfigError(f"{what}: token in {path} is shorter than 16 characters")
    return value


def build(cls, raw: dict[str, Any], source: str):
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types by name."""
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(sorted(unknown))}")
    kwargs = {}
    for name, value in raw.items():
        expected = known[name].type
        kwargs[name] = _check_type(value, expected, f"{source}: {name}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list, "dict": dict}


def _check_type(value, annotation, where):
    base = str(annotation).split("[")[0].split("|")[0].strip()
    expected = _TYPES.get(base)
    if expected is None:
        return value
    if isinstance(value, bool) and base in ("int", "float"):
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(f"{where} must be of type {base}, not {type(value).__name__} ({value!r})")
    return float(value) if base == "float" else value


@dataclass
class AgentConfig:
    node_name: str = field(default_factory=lambda: os.uname().nodename)
    listen_address: str = "127.0.0.1"
    port: int = 8601
    advertise_url: str = ""
    kernel_ip: str = "127.0.0.1"
    token_file: str = "/etc/gpuhub/secrets/agent.token"
    scheduler_url: str = ""
    scheduler_token_file: str = "/etc/gpuhub/secrets/scheduler.token"
    state_dir: str = "/var/lib/gpuhub/agent"
    runtime_dir: str = "/run/gpuhub"
    venv: str = "/opt/gpuhub/venv"
    unit_backend: str = "systemd"
    min_uid: int = 1000
    roles: list = field(default_factory=lambda: ["gpu", "notebook"])
    heartbeat_interval_s: float = 5.0
    lease_check_interval_s: float = 2.0
    # Ports of kernel units (5 Jupyter + Raft + blob each), [first, last]. Below Linux's ephemeral
    # range (32768-60999), so no outgoing connection grabs one between allocation and bind, and a
    # known range to open between GPU nodes and notebook hosts in a firewall.
    kernel_ports: list = field(default_factory=lambda: [20000, 29999])
    gpus: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unit_backend not in ("systemd", "process"):
            raise ConfigError(f"unit_backend must be 'systemd' or 'process', not {self.unit_backend!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1..65535, not {self.port}")
        if (len(self.kernel_ports) != 2 or not all(isinstance(p, int) for p in self.kernel_ports)
                or not 1024 <= self.kernel_ports[0] <= self.kernel_ports[1] - 6 <= 65535 - 6):
            raise ConfigError(f"kernel_ports must be [first, last] with 1024 <= first and at least 7 ports "
                              f"up to 65535, not {self.kernel_ports!r}")
        if not self.advertise_url:
            self.advertise_url = f"http://{self.kernel_ip}:{self.port}"


@dataclass
class SchedulerConfig:
    listen_address: str = "127.0.0.1"
    port: int = 8600
    token_file: str = "/etc/gpuhub/secrets/scheduler.token"
    agent_token_file: str = "/etc/gpuhub/secrets/agent.token"
    hub_api_url: str = "http://127.0.0.1:8081/hub/api"
    state_dir: str = "/var/lib/gpuhub/scheduler"
    max_subscription_ratio: float = 7.0
    node_timeout_s: float = 30.0
    # A replica whose unit has been dead this long on a live node is replaced (see Scheduler.why_lost).
    replica_dead_grace_s: float = 10.0
    # Development only: fixed user tokens instead of asking JupyterHub (token -> user name).
    static_user_tokens: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_subscription_ratio <= 0:
            raise ConfigError("max_subscription_ratio must be positive")
        if self.node_timeout_s <= 0 or self.replica_dead_grace_s < 0:
            raise ConfigError("node_timeout_s must be positive and replica_dead_grace_s not negative")


def load_agent_config(path: str) -> AgentConfig:
    return build(AgentConfig, load_toml(path), path)


def load_scheduler_config(path: str) -> SchedulerConfig:
    return build(SchedulerConfig, load_toml(path), path)
