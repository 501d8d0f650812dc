"""The daemons' HTTP client: JSON in and out, one error type, the server's error message, async too."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from gpuhub.platform.http_client import ApiClientError, HttpClient, call_json


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the daemons' tornado servers
    seen: ClassVar[list[tuple[str, str, bytes, str]]] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Handler.seen.append((self.command, self.path, body, self.headers.get("Authorization", "")))
        status, payload, ctype = {
            "/ok": (200, b'{"a": 1}', "application/json"),
            "/empty": (204, b"", "application/json"),
            "/refused": (409, b'{"error": "all GPUs busy"}', "application/json"),
            "/plain": (502, b"<html>bad gateway</html>", "text/html"),
        }[self.path]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Handler.seen = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_json_in_and_out_with_the_token(server):
    http = HttpClient()
    assert http.call_json("POST", server + "/ok", "tok", {"gpus": 1}) == (200, {"a": 1})
    assert http.call_json("POST", server + "/ok", "tok") == (200, {"a": 1})  # no body: "{}"
    assert http.call_json("GET", server + "/ok", "tok") == (200, {"a": 1})  # no body at all
    assert http.call_json("DELETE", server + "/empty", "tok") == (204, None)
    assert [(m, b) for m, _, b, _ in Handler.seen] == [
        ("POST", b'{"gpus": 1}'), ("POST", b"{}"), ("GET", b""), ("DELETE", b"")]
    assert {auth for *_, auth in Handler.seen} == {"Bearer tok"}
    assert http.connections_opened == 1


def test_errors_carry_the_status_and_the_servers_message(server):
    http = HttpClient()
    with pytest.raises(ApiClientError) as exc:
        http.call_json("POST", server + "/refused", "tok", {})
    assert (exc.value.status, exc.value.message) == (409, "all GPUs busy")
    assert str(exc.value) == f"{server}/refused: 409 all GPUs busy"
    with pytest.raises(ApiClientError) as exc:
        http.call_json("GET", server + "/plain", "tok")
    assert (exc.value.status, exc.value.message) == (502, "Bad Gateway")
    assert http.request("POST", server + "/refused", body={}).status == 409  # request() does not raise


def test_async_call_json(server):
    async def main():
        ok = await call_json("PUT", server + "/ok", "tok", {"x": 1})
        with pytest.raises(ApiClientError) as exc:
            await call_json("GET", server + "/refused", "tok")
        return ok, exc.value.status

    assert asyncio.run(main()) == ((200, {"a": 1}), 409)
    assert json.loads(Handler.seen[0][2]) == {"x": 1}


def test_not_a_url():
    with pytest.raises(ApiClientError) as exc:
        HttpClient().request("GET", "127.0.0.1:8080/x")
    assert exc.value.status == 0


class CountingHandler(Handler):
    """Counts the connections open to its server (a closed keep-alive connection ends ``handle``)."""

    open_connections: ClassVar[dict[int, int]] = {}
    lock = threading.Lock()

    def setup(self) -> None:
        super().setup()
        with self.lock:
            port = self.server.server_address[1]
            CountingHandler.open_connections[port] = CountingHandler.open_connections.get(port, 0) + 1

    def finish(self) -> None:
        super().finish()
        with self.lock:
            CountingHandler.open_connections[self.server.server_address[1]] -= 1


def test_connections_are_kept_for_the_hosts_used_last_only():
    """A host beyond ``max_hosts`` (a server that left the cluster) loses its kept connection, which
    would otherwise stay open, half-closed, for the life of the process."""
    from tests.helpers import wait_for

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), CountingHandler) for _ in range(3)]
    for httpd in servers:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    ports = [httpd.server_address[1] for httpd in servers]
    urls = [f"http://127.0.0.1:{port}/ok" for port in ports]

    def kept(expected: list[int]) -> None:
        """Wait until exactly the servers ``expected`` (indexes) have a connection from the client."""
        wait_for(lambda: [i for i, p in enumerate(ports) if CountingHandler.open_connections.get(p)] == expected,
                 10, f"connections to servers {expected} only")

    http = HttpClient(max_hosts=2)
    try:
        for url in urls[:2]:
            http.call_json("GET", url, "tok")
        kept([0, 1])
        http.call_json("GET", urls[0], "tok")  # the first is used last now: the second goes next
        http.call_json("GET", urls[2], "tok")
        kept([0, 2])
        assert http.connections_opened == 3
        http.call_json("GET", urls[0], "tok")  # still kept: no new connection
        assert http.connections_opened == 3
        http.discard(urls[0])
        kept([2])
    finally:
        http.close()
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
