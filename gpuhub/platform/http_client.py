"""The client side of the daemons' HTTP APIs: one authenticated JSON request."""

from __future__ import annotations

import json
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest


class ApiClientError(RuntimeError):
    def __init__(self, status: int, message: str, url: str) -> None:
        super().__init__(f"{url}: {status} {message}")
        self.status = status
        self.message = message


async def call_json(
    method: str, url: str, token: str, body: Any = None, timeout: float = 20.0
) -> tuple[int, Any]:
    """One authenticated JSON request; returns (status, body). Raises ApiClientError on failure."""
    req = HTTPRequest(
        url,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        body=None if body is None and method in ("GET", "DELETE") else json.dumps(body or {}),
        request_timeout=timeout,
        connect_timeout=min(timeout, 5.0),
        allow_nonstandard_methods=True,
    )
    try:
        resp = await AsyncHTTPClient().fetch(req)
    except HTTPClientError as exc:
        message = exc.message
        if exc.response is not None and exc.response.body:
            try:
                message = json.loads(exc.response.body).get("error", message)
            except ValueError:
                pass
        raise ApiClientError(exc.code, message, url) from None
    except OSError as exc:
        raise ApiClientError(0, f"cannot reach: {exc}", url) from None
    return resp.code, json.loads(resp.body) if resp.body else None
