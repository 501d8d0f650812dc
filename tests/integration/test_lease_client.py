"""The replica's lease client keeps one connection to its agent and survives the agent restarting."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import current_user
from gpuhub.kernel.lease_client import AgentConnection, LeaseClient, LeaseError

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
    assert client.connection.opened == 1


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
    assert client.connection.opened == 2


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
    assert client.connection.opened == 1


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
            with conn:
                for answer in (True, False):
                    request = conn.recv(65536)
                    if not request:
                        break
                    self.requests.append(request.split(b" ", 2)[0])
                    if answer:
                        conn.sendall(self.RESPONSE)


def test_a_request_lost_by_a_dropped_connection_is_retried_only_if_idempotent():
    server = DroppingServer()
    conn = AgentConnection(f"http://127.0.0.1:{server.port}")
    assert conn.request("GET", "/", None, {})[0] == 200
    assert conn.request("DELETE", "/x", None, {})[0] == 200  # lost once, sent again on a new connection
    assert server.requests == [b"GET", b"DELETE", b"DELETE"]
    with pytest.raises(ConnectionError):
        conn.request("POST", "/y", b"{}", {})  # the agent may have granted: never asked twice
    assert server.requests == [b"GET", b"DELETE", b"DELETE", b"POST"]
    server.sock.close()
