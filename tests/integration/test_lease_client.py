"""The replica's lease client keeps one connection to its agent and survives the agent restarting."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from urllib3.connection import HTTPConnection
from urllib3.exceptions import NewConnectionError

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import current_user
from gpuhub.kernel.lease_client import LeaseClient, LeaseError
from gpuhub.platform.http_client import ApiClientError, HttpClient

TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT"}


def lease_client(agent, name: str = "gpuhub-kernel-gc-r0") -> LeaseClient:
    """The client a kernel unit of ``agent`` would have (its own lease token)."""
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": 1, "cwd": os.getcwd(),
        "kernel": {"key": "k", "kernel_id": "gc"}})
    assert status == 201, unit
    token = ProcessRunner(str(agent.dir / "run"), 0).read_env(name)["GPUHUB_LEASE_TOKEN"]
    return LeaseClient(agent.url, token, agent.name)


def connections_to(port: int) -> set[tuple[int, int]]:
    """Every TCP connection (client port, server port) the host's kernel knows to 127.0.0.1:port,
    TIME_WAIT included: each connection the agent ever accepted in the last minute."""
    seen = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, remote = line.split()[1:3]
            lport, rport = int(local.split(":")[1], 16), int(remote.split(":")[1], 16)
            if lport == port:
                seen.add((rport, lport))
            elif rport == port:
                seen.add((lport, rport))
    return seen


def test_one_connection_for_many_grants(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = lease_client(agent)
    before = connections_to(agent.port)
    for _ in range(20):
        grant = client.try_grant(1)
        assert grant is not None
        client.release(grant)
    new = connections_to(agent.port) - before
    assert len(new) == 1, f"the agent accepted {len(new)} connections for 40 calls"
    assert client.http.connections_opened == 1


def test_agent_restart_costs_one_reconnect(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = lease_client(agent)
    client.release(client.try_grant(1))
    agent.stop()
    agent.start()  # same port; the kept-alive connection is dead now
    grant = client.try_grant(1)
    assert grant is not None
    client.release(grant)
    assert agent.call("GET", "/api/v1/node")[1]["committed"] == 0
    assert client.http.connections_opened == 2


def wait_histogram(agent) -> dict[str, float]:
    """gpuhub_agent_cell_gpu_wait_seconds from the agent's /metrics: sample name+labels -> value."""
    status, text = agent.call("GET", "/metrics")
    assert status == 200
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("gpuhub_agent_cell_gpu_wait_seconds")}


def test_a_cells_wait_for_its_gpus_is_counted_once_when_its_lease_goes_back(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = lease_client(agent)
    loser = client.try_grant(1)
    client.release(loser)  # a replica that lost the election: its grant did not run the cell
    assert wait_histogram(agent)['gpuhub_agent_cell_gpu_wait_seconds_count{node="gcnode"}'] == 0
    ran = client.try_grant(1)
    ran.waited_s = 3.2
    client.release(ran)
    h = wait_histogram(agent)
    assert h['gpuhub_agent_cell_gpu_wait_seconds_count{node="gcnode"}'] == 1
    assert h['gpuhub_agent_cell_gpu_wait_seconds_sum{node="gcnode"}'] == pytest.approx(3.2)
    assert h['gpuhub_agent_cell_gpu_wait_seconds_bucket{le="2.5",node="gcnode"}'] == 0
    assert h['gpuhub_agent_cell_gpu_wait_seconds_bucket{le="5.0",node="gcnode"}'] == 1
    assert agent.call("GET", "/api/v1/node")[1]["committed"] == 0


def test_a_bad_wait_is_refused_and_the_lease_kept(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = lease_client(agent)
    grant = client.try_grant(1)
    for bad in ("-1", "nan", "inf", "soon", "1e9"):
        status, body = client._call("DELETE", f"/api/v1/leases/{grant.lease_id}?waited_s={bad}")
        assert status == 400 and "waited_s must be seconds" in body["error"], (bad, body)
    assert agent.call("GET", "/api/v1/node")[1]["committed"] == 1  # nothing lost: still held
    client.release(grant)
    assert agent.call("GET", "/api/v1/node")[1]["committed"] == 0


def test_agent_killed_then_back(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = lease_client(agent)
    client.release(client.try_grant(1))
    agent.stop(kill=True)
    with pytest.raises(LeaseError, match="cannot reach the GPU agent of node gcnode"):
        client.try_grant(1)
    agent.start()
    assert client.try_grant(1) is not None


def test_bad_token_is_a_clear_error(make_agent):
    agent = make_agent("gcnode", gpus=1)
    client = LeaseClient(agent.url, "not-a-lease-token", agent.name)
    with pytest.raises(LeaseError, match="refused the lease: missing or invalid lease token"):
        client.try_grant(1)
    with pytest.raises(LeaseError, match="refused the lease: missing or invalid lease token"):
        client.try_grant(1)  # the 401 did not spoil the kept-alive connection
    assert client.http.connections_opened == 1


class DroppingServer:
    """Answers each connection's first request, then reads the next one and hangs up unanswered."""

    RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as reader:
                for answer in (True, False):
                    method = self._read_request(reader)
                    if method is None:
                        break
                    self.requests.append(method)
                    if answer:
                        conn.sendall(self.RESPONSE)

    @staticmethod
    def _read_request(reader) -> bytes | None:
        """A whole request (headers and body may come in separate packets); its method."""
        first = reader.readline()
        if not first:
            return None
        length = 0
        for line in iter(reader.readline, b"\r\n"):
            if not line:
                return None
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        reader.read(length)
        return first.split(b" ", 1)[0]


def test_a_request_lost_by_a_dropped_connection_is_retried_only_if_idempotent():
    server = DroppingServer()
    http = HttpClient()
    url = f"http://127.0.0.1:{server.port}"
    assert http.request("GET", url + "/").status == 200
    assert http.request("DELETE", url + "/x").status == 200  # lost once, sent again on a new connection
    assert server.requests == [b"GET", b"DELETE", b"DELETE"]
    assert http.request("PUT", url + "/x", body={}).status == 200  # idempotent too
    assert server.requests == [b"GET", b"DELETE", b"DELETE", b"PUT", b"PUT"]
    with pytest.raises(ApiClientError) as exc:
        http.request("POST", url + "/y", body={})  # the agent may have granted: never asked twice
    assert exc.value.status == 0
    assert server.requests == [b"GET", b"DELETE", b"DELETE", b"PUT", b"PUT", b"POST"]
    assert http.connections_opened == 3
    server.sock.close()


def test_a_connection_that_cannot_be_made_is_tried_again_for_any_method():
    """Nothing was sent, so even a grant may go again: the first connect fails (as a refused one
    would, while the agent restarts), the second succeeds."""
    server = DroppingServer()
    url = f"http://127.0.0.1:{server.port}"
    http = HttpClient()
    refused = []

    def refuse_once(self):  # the first connect fails as a refused one would
        if not refused:
            refused.append(1)
            raise NewConnectionError(self, "Failed to establish a new connection: [Errno 111] Connection refused")
        return real_new_conn(self)

    real_new_conn = HTTPConnection._new_conn
    HTTPConnection._new_conn = refuse_once
    try:
        assert http.request("POST", url + "/y", body={}).status == 200
    finally:
        HTTPConnection._new_conn = real_new_conn
    assert refused and server.requests == [b"POST"]
    server.sock.close()


def test_a_closed_port_is_a_status_0_error_after_one_more_try():
    port = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    with pytest.raises(ApiClientError) as exc:
        HttpClient().request("POST", url + "/y", body={})
    assert exc.value.status == 0 and "Connection refused" in exc.value.message


def test_a_timeout_is_not_retried():
    server = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    http = HttpClient()
    with pytest.raises(ApiClientError) as exc:
        http.request("GET", url + "/", timeout=0.3)
    assert exc.value.status == 0 and "timed out" in exc.value.message
    assert http.connections_opened == 1
    server.close()
