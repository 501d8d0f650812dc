"""Who is calling the scheduler: an admin/agent (the scheduler token) or a user (their JupyterHub token).

A user's Jupyter server holds the user's JupyterHub API token; the scheduler asks the hub whose it is
(``GET /hub/api/user``), so a user can only create and stop their own kernels. Starting kernels runs
code as the user, so it takes more than knowing who the token belongs to: the token must carry the
hub scope ``kernel_scope`` (``custom:gpuhub:kernels``), which the hub gives the tokens of the user's
own servers only (roles/gpuhub_hub: ``custom_scopes``, ``server_token_scopes``). An OAuth token a
user got by visiting someone else's server names that user but lacks the scope. Answers are cached
briefly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.http_server import tokens_equal

KERNEL_SCOPE = "custom:gpuhub:kernels"


@dataclass(frozen=True)
class HubUser:
    name: str
    may_run_kernels: bool  # the token carries the kernel scope (for this user)


def holds_scope(scopes: object, scope: str, user: str) -> bool:
    """Whether the hub's expanded ``scopes`` of a token give ``scope`` for ``user``: the scope itself,
    or filtered to that user (``scope!user=alice``, how the hub expands ``scope!user``)."""
    return isinstance(scopes, list) and (scope in scopes or f"{scope}!user={user}" in scopes)


class HubUserResolver:
    def __init__(self, hub_api_url: str, static: dict[str, str] | None = None, ttl_s: float = 60.0,
                 kernel_scope: str = KERNEL_SCOPE) -> None:
        self.hub_api_url = hub_api_url.rstrip("/")
        self.static = dict(static or {})
        self.ttl_s = ttl_s
        self.kernel_scope = kernel_scope  # "": any token of the user may run kernels
        self._cache: dict[str, tuple[float, HubUser | None]] = {}

    async def user_for(self, token: str | None) -> HubUser | None:
        if not token:
            return None
        for static_token, user in self.static.items():
            if tokens_equal(token, static_token):
                return HubUser(user, True)  # development setups: fixed tokens, no hub
        if not self.hub_api_url:  # development setups without a hub: static tokens only
            return None
        hit = self._cache.get(token)
        now = time.monotonic()
        if hit and now - hit[0] < self.ttl_s:
            return hit[1]
        try:
            _, body = await call_json("GET", self.hub_api_url + "/user", token, timeout=10)
            user = None
            if isinstance(body, dict) and body.get("kind", "user") == "user" and isinstance(body.get("name"), str):
                name = body["name"]
                user = HubUser(name, not self.kernel_scope or holds_scope(body.get("scopes"), self.kernel_scope, name))
        except ApiClientError as exc:
            if exc.status in (401, 403, 404):
                user = None
            else:
                raise
        if len(self._cache) >= 10000:
            self._cache.clear()
        self._cache[token] = (now, user)
        return user
