"""Daemon config files: TOML into traitlets settings, with errors that name the setting and the file."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli_w

from gpuhub.agent import main as agent_main
from gpuhub.agent.config import AgentConfig
from gpuhub.platform.config import ConfigError, load_config_file, load_settings, read_secret
from gpuhub.platform.daemon import access_log
from gpuhub.scheduler import main as scheduler_main
from gpuhub.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def keep_root_logger():
    """Daemon.initialize sets up the root logger, as in a daemon; put this process's back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def write(tmp_path: Path, text: str, name: str = "agent.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def token_file(tmp_path: Path, name: str, mode: int = 0o600, value: str = "t" * 32) -> Path:
    p = tmp_path / name
    p.write_text(value)
    p.chmod(mode)
    return p


def test_a_good_file_as_the_ansible_template_writes_it(tmp_path):
    p = write(tmp_path, '''
node_name = "gpu1"
listen_address = "0.0.0.0"
port = 8601
advertise_url = "http://10.0.0.5:8601"
kernel_ip = "10.0.0.5"
token_file = "/etc/gpuhub/secrets/agent.token"
scheduler_url = "http://10.0.0.1:8600"
state_dir = "/var/lib/gpuhub/agent"
unit_backend = "systemd"
min_uid = 1000
device_policy = "closed"
unit_devices = ["/dev/fuse", "char-infiniband_verbs"]
roles = ["gpu"]
heartbeat_interval_s = 5
kernel_ports = [20000, 29999]

[gpus]
backend = "fake"
fake = [
  { name = "A100", memory_mib = 40960, device = "/dev/gpuhub-fake-gpu0" },
]

[limits]
kernel_memory_max = "32G"
''')
    c = load_settings(AgentConfig, p)
    assert (c.node_name, c.listen_address, c.port, c.roles) == ("gpu1", "0.0.0.0", 8601, ["gpu"])
    assert c.heartbeat_interval_s == 5.0 and isinstance(c.heartbeat_interval_s, float)
    assert c.gpus == {"backend": "fake", "fake": [{"name": "A100", "memory_mib": 40960,
                                                    "device": "/dev/gpuhub-fake-gpu0"}]}
    assert c.device_policy == "closed" and c.unit_devices == ["/dev/fuse", "char-infiniband_verbs"]
    assert c.limits == {"kernel_memory_max": "32G"}
    assert c.lease_check_interval_s == 2.0 and c.venv == "/opt/gpuhub/venv"  # defaults stay


def test_defaults_and_the_derived_advertise_url(tmp_path):
    c = AgentConfig()
    assert c.port == 8601 and c.kernel_ports == [20000, 29999] and c.unit_backend == "systemd"
    assert c.node_name and c.advertise_url == "http://127.0.0.1:8601"
    c = load_settings(AgentConfig, write(tmp_path, 'advertise_url = ""\nkernel_ip = "10.0.0.7"\nport = 8700\n'))
    assert c.advertise_url == "http://10.0.0.7:8700"
    s = SchedulerConfig(state_dir=str(tmp_path), node_timeout_s=5)
    assert s.node_timeout_s == 5.0 and s.max_subscription_ratio == 7.0 and s.port == 8600


def test_the_file_becomes_the_settings_section_of_a_traitlets_config(tmp_path):
    config = load_config_file(AgentConfig, write(tmp_path, "port = 8700\n"))
    assert config.AgentConfig.port == 8700
    assert AgentConfig(config=config).port == 8700


@pytest.mark.parametrize("text,message", [
    ("port = \n", "not valid TOML"),
    ("prot = 1\n", r"unknown setting\(s\) prot"),
    ('port = "eighty"\n', r"port must be an integer, not str \('eighty'\)"),
    ("port = true\n", "port must be an integer, not bool"),
    ("heartbeat_interval_s = \"5\"\n", "heartbeat_interval_s must be a number"),
    ('roles = "gpu"\n', "roles must be of type list"),
    ('roles = ["gpu", 1]\n', r"roles\[1\] must be of type str"),
    ("gpus = 3\n", "gpus must be of type dict"),
    ('unit_backend = "docker"\n', "unit_backend must be 'systemd' or 'process', not 'docker'"),
    ("port = 0\n", "'port' trait .* should not be less than 1"),
    ("port = 70000\n", "'port' trait .* should not be greater than 65535"),
    ("kernel_ports = [30000]\n", "kernel_ports must be"),
    ("kernel_ports = [30000, 30003]\n", "kernel_ports must be"),
    ("kernel_ports = [80, 2000]\n", "kernel_ports must be"),
    ('kernel_ports = ["a", "b"]\n', r"kernel_ports\[0\] must be an integer"),
    ('device_policy = "auto"\n', "device_policy must be 'closed' or 'open', not 'auto'"),
    ('unit_devices = ["/etc/passwd"]\n', r"unit_devices: '/etc/passwd' is not a path under /dev/"),
    ('unit_devices = ["/dev/fuse rwm"]\n', r"unit_devices: '/dev/fuse rwm' is not .*no spaces"),
])
def test_agent_config_errors_name_the_file_and_the_setting(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(AgentConfig, p)
    assert str(err.value).startswith(f"{p}: ")


@pytest.mark.parametrize("text,message", [
    ("max_subscription_ratio = 0\n", "max_subscription_ratio must be positive"),
    ("node_timeout_s = 0\n", "node_timeout_s must be positive"),
    ("replica_dead_grace_s = -1\n", "replica_dead_grace_s"),
    ("static_user_tokens = { abc = 1 }\n", "static_user_tokens.abc must be of type str"),
    ("agent_token = \"x\"\n", "unknown setting"),
])
def test_scheduler_config_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(SchedulerConfig, write(tmp_path, text, "scheduler.toml"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(AgentConfig, tmp_path / "nope.toml")


def test_tokens_are_refused_when_others_can_read_them_or_they_are_short(tmp_path):
    with pytest.raises(ConfigError, match="readable by others; chmod 600"):
        read_secret(token_file(tmp_path, "a.token", 0o644), "agent")
    with pytest.raises(ConfigError, match="shorter than 16"):
        read_secret(token_file(tmp_path, "b.token", value="short"), "agent")
    with pytest.raises(ConfigError, match="does not exist"):
        read_secret(tmp_path / "c.token", "agent")
    assert read_secret(token_file(tmp_path, "d.token"), "agent") == "t" * 32


def test_a_config_error_exits_2_naming_the_daemon(tmp_path, capsys):
    p = write(tmp_path, 'unit_backend = "docker"\n')
    assert agent_main.main(["--config", str(p)]) == 2
    assert capsys.readouterr().err.startswith(f"gpuhub-agent: {p}: unit_backend must be")
    # A token others can read stops the daemon before it listens.
    t = token_file(tmp_path, "agent.token", 0o644)
    p = write(tmp_path, tomli_w.dumps({"token_file": str(t), "agent_token_file": str(t)}), "scheduler.toml")
    assert scheduler_main.main(["--config", str(p), "--log-level", "DEBUG"]) == 2
    assert "gpuhub-scheduler: scheduler: token file" in capsys.readouterr().err


def test_command_line_options_are_checked_too(tmp_path, capsys):
    p = write(tmp_path, 'unit_backend = "process"\n')
    assert agent_main.main(["--config", str(p), "--AgentConfig.prot=1"]) == 2
    assert "unknown setting(s) AgentConfig.prot" in capsys.readouterr().err
    assert agent_main.main(["--config", str(p), "--confg", "x"]) == 2
    assert "unknown option --confg" in capsys.readouterr().err
    assert agent_main.main(["--config", str(p), "--AgentConfig.port=0"]) == 2
    assert "or the command line: The value of the 'port' trait" in capsys.readouterr().err


def test_command_line_settings_win_over_the_file(tmp_path):
    p = write(tmp_path, "port = 8700\nmin_uid = 0\n")
    app = agent_main.AgentDaemon()
    app.secret_files = lambda: {}  # stop before tokens and the service
    app.init_service = lambda: None
    app.initialize(["--config", str(p), "--AgentConfig.port=8800", "--log-level", "warning"])
    assert (app.settings.port, app.settings.min_uid, app.settings.advertise_url) == (8800, 0, "http://127.0.0.1:8800")
    assert logging.getLogger().level == logging.WARNING


def test_access_log_has_method_path_status_and_never_the_query_or_headers(caplog):
    request = SimpleNamespace(method="POST", path="/api/v1/units", uri="/api/v1/units?token=secret",
                              headers={"Authorization": "Bearer secret"}, body=b'{"key": "secret"}',
                              request_time=lambda: 0.0123)
    log = access_log(logging.getLogger("gpuhub.test.access"), quiet_paths=("/metrics",))
    with caplog.at_level(logging.DEBUG, logger="gpuhub.test.access"):
        log(SimpleNamespace(get_status=lambda: 201, request=request))
        request.path = "/metrics"
        log(SimpleNamespace(get_status=lambda: 200, request=request))
        request.method, request.path = "GET", "/api/v1/kernels/k1"  # a server's poll of its kernel
        log(SimpleNamespace(get_status=lambda: 200, request=request))
        log(SimpleNamespace(get_status=lambda: 404, request=request))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "201 POST /api/v1/units 12.3ms"), (logging.DEBUG, "200 POST /metrics 12.3ms"),
        (logging.DEBUG, "200 GET /api/v1/kernels/k1 12.3ms"), (logging.WARNING, "404 GET /api/v1/kernels/k1 12.3ms")]
