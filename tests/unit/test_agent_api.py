"""The agent API refuses what it must, with clear messages; it recovers after a restart."""

from __future__ import annotations

import pytest

from gpuhub.config import ConfigError, load_agent_config
from tests.integration.test_gpu_cells import run, start_kernel


def test_token_required(make_agent):
    a = make_agent(gpus=1)
    for path in ("/api/v1/node", "/api/v1/units", "/metrics"):
        assert a.call("GET", path, token=None)[0] == 401
        assert a.call("GET", path, token="not-the-token")[0] == 401
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 1}, token="bogus")
    assert status == 401 and "lease token" in body["error"]


def test_admin_token_is_not_a_lease_token(make_agent):
    a = make_agent(gpus=1)
    assert a.call("POST", "/api/v1/leases", {"gpus": 1})[0] == 401


@pytest.mark.parametrize("raw,message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"kind": "kernel"}', "missing field 'name'"),
    (b'{"kind": "daemon", "name": "x", "user": "u"}', "'kernel' or 'server'"),
    (b'{"kind": "server", "name": "gpuhub-server-x", "user": "root", "argv": ["/bin/true"], "gpus": "two"}',
     "'gpus' must be"),
    (b'{"kind": "server", "name": "evil; rm -rf /", "user": "u", "argv": ["/bin/true"]}', "unit name"),
    (b'{"kind": "kernel", "name": "gpuhub-kernel-x", "user": "u", "gpus": 9, "kernel": {"key": "k"}}', "has 1"),
])
def test_malformed_unit_requests(make_agent, raw, message):
    a = make_agent(gpus=1)
    status, body = a.call("POST", "/api/v1/units", raw=raw)
    assert status == 400 and message in body["error"], body


def test_systemd_backend_refuses_root(tmp_path):
    import asyncio

    from gpuhub.agent.units import SystemdRunner, UnitError, UnitSpec

    runner = SystemdRunner(str(tmp_path), min_uid=1000)
    with pytest.raises(UnitError, match="refusing to run as 'root'"):
        asyncio.run(runner.start(UnitSpec("gpuhub-kernel-x", "kernel", "root", ["/bin/true"], {}, "")))
    with pytest.raises(UnitError, match="does not exist"):
        asyncio.run(runner.start(UnitSpec("gpuhub-kernel-x", "kernel", "no-such-user-xyz", ["/bin/true"], {}, "")))


def test_lease_limited_to_placed_gpus(make_agent):
    a = make_agent(gpus=2)
    kc, _ = start_kernel(a, gpus=1)
    kc.stop_channels()
    token = _lease_token(a, "gpuhub-kernel-t1")
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 2}, token=token)
    assert status == 400 and "placed with 1" in body["error"]
    status, body = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
    assert status == 200
    assert a.call("DELETE", f"/api/v1/leases/{body['lease_id']}", token=token)[1]["released"] is True
    assert a.call("DELETE", f"/api/v1/leases/{body['lease_id']}", token=token)[1]["released"] is False


def _lease_token(agent, unit):
    # The process backend keeps the unit's env in memory only; read it from the kernel's /proc environ.
    _, u = agent.call("GET", f"/api/v1/units/{unit}")
    env = open(f"/proc/{u['main_pid']}/environ", "rb").read().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"GPUHUB_LEASE_TOKEN="))


def test_dead_holder_lease_expires(make_agent):
    import os
    import signal
    import time

    a = make_agent(gpus=1)
    kc, unit = start_kernel(a, gpus=1)
    kc.stop_channels()
    token = _lease_token(a, "gpuhub-kernel-t1")
    assert a.call("POST", "/api/v1/leases", {"gpus": 1, "holder_pid": unit["main_pid"]}, token=token)[0] == 200
    assert a.call("GET", "/api/v1/node")[1]["committed"] == 1
    os.kill(unit["main_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and a.call("GET", "/api/v1/node")[1]["committed"]:
        time.sleep(0.2)
    assert a.call("GET", "/api/v1/node")[1]["committed"] == 0
    assert "gpuhub_agent_leases_expired_total" in a.call("GET", "/metrics")[1]


def test_agent_restart_keeps_units_and_leases(make_agent):
    a = make_agent(gpus=2)
    kc, _ = start_kernel(a, gpus=1)
    run(kc, "x = 41")
    token = _lease_token(a, "gpuhub-kernel-t1")
    status, lease = a.call("POST", "/api/v1/leases", {"gpus": 1}, token=token)
    assert status == 200
    a.stop(kill=True)
    a.start()
    _, node = a.call("GET", "/api/v1/node")
    assert node["units"] == 1 and node["committed"] == 1 and node["pending"] == 1
    _, out = run(kc, "print(x + 1)")
    assert out["stdout"].strip() == "42"
    kc.stop_channels()


def test_config_errors_are_clear(tmp_path):
    p = tmp_path / "agent.toml"
    p.write_text('port = "eighty"\n')
    with pytest.raises(ConfigError, match="port must be of type int"):
        load_agent_config(str(p))
    p.write_text('prot = 1\n')
    with pytest.raises(ConfigError, match="unknown setting"):
        load_agent_config(str(p))
    p.write_text('port = \n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_agent_config(str(p))
    p.write_text('unit_backend = "docker"\n')
    with pytest.raises(ConfigError, match="unit_backend"):
        load_agent_config(str(p))


def test_world_readable_token_refused(tmp_path):
    from gpuhub.config import read_secret

    t = tmp_path / "t.token"
    t.write_text("x" * 32)
    t.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_secret(t, "agent")

