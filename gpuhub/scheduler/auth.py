"""Who is calling the scheduler: an admin/agent (the scheduler token) or a user (their JupyterHub token).

A user's Jupyter server holds the user's JupyterHub API token; the scheduler asks the hub whose it is,
so a user can only create and stop their own kernels. Answers are cached briefly.
"""

from __future__ import annotations

import time

from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.http_server import tokens_equal


class HubUserResolver:
    def __init__(self, hub_api_url: str, static: dict[str, str] | None = None, ttl_s: float = 60.0) -> None:
        self.hub_api_url = hub_api_url.rstrip("/")
        self.static = dict(static or {})
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, str | None]] = {}

    async def user_for(self, token: str | None) -> str | None:
        if not token:
            return None
        for static_token, user in self.static.items():
            if tokens_equal(token, static_token):
                return user
        if not self.hub_api_url:  # development setups without a hub: static tokens only
            return None
        hit = self._cache.get(token)
        now = time.monotonic()
        if hit and now - hit[0] < self.ttl_s:
            return hit[1]
        try:
            _, body = await call_json("GET", self.hub_api_url + "/user", token, timeout=10)
            user = body.get("name") if isinstance(body, dict) and body.get("kind", "user") == "user" else None
        except ApiClientError as exc:
            if exc.status in (401, 403, 404):
                user = None
            else:
                raise
        self._cache[token] = (now, user)
        if len(self._cache) > 10000:
            self._cache.clear()
        return user
