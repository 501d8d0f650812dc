"""The daemons' APIs over TLS (docs/security.md, "TLS"): every call of the cluster (agent →
scheduler heartbeats, scheduler → agent placements, replica → agent GPU leases) verifies the
server's certificate against the host's trust store, and a client that does not trust the cluster's
CA, or a server whose certificate another CA signed, gets no exchange at all.

The host's trust store is stood in for by ``SSL_CERT_FILE`` (OpenSSL reads it where it would read
/etc/ssl/certs), which every daemon and replica started here inherits."""

from __future__ import annotations

import os
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhub.dev.cluster import DevCluster, DevKernel, current_user
from gpuhub.platform.http_client import ApiClientError, HttpClient
from tests.integration.test_agent_api import unit_environ
from tests.tls_certs import TestCA


@pytest.fixture
def cas(tmp_path):
    """The cluster's CA and a stranger's, each with a certificate for 127.0.0.1."""
    (tmp_path / "tls").mkdir()
    cluster, stranger = TestCA(tmp_path / "tls", "cluster"), TestCA(tmp_path / "tls", "stranger")
    return cluster, cluster.server("host"), stranger, stranger.server("impostor")


def tls_settings(cert) -> dict:
    return {"tls_cert_file": str(cert.cert), "tls_key_file": str(cert.key)}


def test_a_cluster_on_tls_places_a_kernel_and_runs_a_gpu_cell_with_every_call_verified(tmp_path, cas, monkeypatch):
    ca, host, _, _ = cas
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert))  # the hosts' trust store holds the cluster CA
    dev = DevCluster(tmp_path, nodes=1, gpus_per_node=1, scheduler_settings=tls_settings(host),
                     agent_settings=tls_settings(host)).start()
    try:
        assert dev.scheduler.url.startswith("https://")
        _, nodes = dev.scheduler_call("GET", "/api/v1/nodes", token=dev.scheduler.token)
        (node,) = nodes["nodes"]
        assert node["live"] and node["url"].startswith("https://127.0.0.1:")  # heartbeats over TLS
        kernel = DevKernel(dev, gpus=1, replicas=1)  # the scheduler starts its unit over TLS
        outputs: list[dict] = []
        try:
            # A GPU cell takes a lease from the agent over TLS, from inside the replica.
            reply = kernel.kc.execute_interactive("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])",
                                                  timeout=60, output_hook=outputs.append)
            assert reply["content"]["status"] == "ok", reply["content"]
        finally:
            kernel.close()
        text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
        assert text.startswith("GPU-") and text.count("\n") == 1, text  # its one granted GPU
    finally:
        dev.stop()


def test_a_client_that_does_not_trust_the_cluster_ca_gets_no_answer(tmp_path, cas, make_agent, monkeypatch):
    ca, host, stranger, _ = cas
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert))  # for make_agent's wait until it answers
    agent = make_agent("node1", gpus=0, extra=tls_settings(host))
    trusting, untrusting = HttpClient(ca_file=str(ca.cert)), HttpClient(ca_file=str(stranger.cert))
    try:
        resp = trusting.request("GET", agent.url + "/api/v1/node", token=agent.token)
        assert resp.status == 200 and resp.json()["url"] == agent.url
        with pytest.raises(ApiClientError) as refused:
            untrusting.request("GET", agent.url + "/api/v1/node", token=agent.token)
        assert refused.value.status == 0 and "certificate verify failed" in refused.value.message
        # Plain HTTP to the TLS port gets no API answer either.
        plain = HttpClient()
        try:
            answer = plain.request("GET", agent.url.replace("https://", "http://") + "/api/v1/node",
                                   token=agent.token)
            assert answer.status == 400, answer  # tornado's answer to a plain request on a TLS port
        except ApiClientError:
            pass
        finally:
            plain.close()
    finally:
        trusting.close()
        untrusting.close()


def test_a_server_with_a_certificate_of_another_ca_is_refused(tmp_path, cas, make_agent, monkeypatch):
    ca, _, stranger, impostor = cas
    monkeypatch.setenv("SSL_CERT_FILE", str(stranger.cert))  # for make_agent's wait until it answers
    agent = make_agent("node1", gpus=0, extra=tls_settings(impostor))
    client = HttpClient(ca_file=str(ca.cert))
    try:
        with pytest.raises(ApiClientError, match="certificate verify failed"):
            client.request("GET", agent.url + "/api/v1/node", token=agent.token)
    finally:
        client.close()


def test_a_certificate_for_another_name_is_refused(tmp_path, cas, make_agent, monkeypatch):
    ca, _, _, _ = cas
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert))
    only_the_ip = ca.server("only-ip", names=("127.0.0.1",))
    agent = make_agent("node1", gpus=0, extra=tls_settings(only_the_ip))
    client = HttpClient(ca_file=str(ca.cert))
    try:
        assert client.request("GET", agent.url + "/api/v1/node", token=agent.token).status == 200
        with pytest.raises(ApiClientError, match="certificate verify failed: Hostname mismatch"):
            client.request("GET", agent.url.replace("127.0.0.1", "localhost") + "/api/v1/node", token=agent.token)
    finally:
        client.close()


@pytest.mark.parametrize("settings,message", [
    ({"tls_cert_file": "CERT"}, "tls_key_file: needed too"),
    ({"tls_cert_file": "CERT", "tls_key_file": "OTHER_KEY"}, "are not a PEM certificate and its key"),
    ({"tls_cert_file": "MISSING", "tls_key_file": "KEY"}, "TLS: no such file"),
])
def test_a_daemon_with_a_broken_tls_setting_exits_2_naming_it(tmp_path, cas, settings, message):
    _, host, _, impostor = cas
    paths = {"CERT": str(host.cert), "KEY": str(host.key), "OTHER_KEY": str(impostor.key),
             "MISSING": str(tmp_path / "nope.crt")}
    config = tmp_path / "scheduler.toml"
    token = tmp_path / "t"
    token.write_text("x" * 32)
    token.chmod(0o600)
    lines = [f'token_file = "{token}"', f'agent_token_file = "{token}"', f'state_dir = "{tmp_path}/s"']
    lines += [f'{k} = "{paths[v]}"' for k, v in settings.items()]
    config.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "gpuhub.scheduler.main", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_a_users_server_gets_its_hosts_servers_certificate_to_serve_with(tmp_path, cas, make_agent):
    """docs/security.md: the agent gives a user's server a copy of its host's servers' certificate and
    key that its user alone can read, points jupyterhub-singleuser at them, and says so (the spawner
    then routes the proxy over https); a CA for client certificates in the request is dropped. That
    the server then serves https is tested on the cluster (tests/cluster/test_e2e.py)."""
    _, servers, _, _ = cas
    a = make_agent(gpus=0, extra={"server_tls_cert_file": str(servers.cert), "server_tls_key_file": str(servers.key)})
    probe = "import time; time.sleep(600)"
    status, unit = a.call("POST", "/api/v1/units", {
        "name": "gpuhub-server-tls1", "kind": "server", "user": current_user(), "argv": [sys.executable, "-c", probe],
        "env": {"JUPYTERHUB_SSL_CLIENT_CA": "/tmp/elsewhere.pem", "JUPYTERHUB_SSL_KEYFILE": "/tmp/other.key"}})
    assert status == 201 and unit["tls"] is True, unit
    env = unit_environ(unit["main_pid"])
    assert "JUPYTERHUB_SSL_CLIENT_CA" not in env
    for var, original in (("JUPYTERHUB_SSL_CERTFILE", servers.cert), ("JUPYTERHUB_SSL_KEYFILE", servers.key)):
        copy = env[var]
        assert copy.endswith(("server-tls.crt", "server-tls.key")) and "/gpuhub-server-tls1/" in copy, env
        assert Path(copy).read_text() == Path(original).read_text()
        assert stat.S_IMODE(os.stat(copy).st_mode) == 0o400 and os.stat(copy).st_uid == os.getuid()
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(env["JUPYTERHUB_SSL_CERTFILE"],
                                                                        env["JUPYTERHUB_SSL_KEYFILE"])
    _, plain = make_agent("plain", gpus=0).call("POST", "/api/v1/units", {
        "name": "gpuhub-server-plain1", "kind": "server", "user": current_user(),
        "argv": [sys.executable, "-c", "import time; time.sleep(600)"]})
    assert plain["tls"] is False, plain
