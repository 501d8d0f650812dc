"""The server side of the daemons' HTTP APIs (tornado): bearer tokens, JSON in and out, clear 400s."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, TypeVar

from tornado.web import HTTPError, RequestHandler

from gpuhub.platform.schema import Body, BodyError, parse

log = logging.getLogger(__name__)

B = TypeVar("B", bound=Body)


class ApiError(HTTPError):
    """An error the client gets as ``{"error": message}`` with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, reason=None)
        self.message = message


def bearer_token(handler: RequestHandler) -> str | None:
    header = handler.request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        return value.strip()
    return None


def tokens_equal(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


class JsonHandler(RequestHandler):
    """Base handler: JSON bodies, JSON errors, and no token or body ever written to logs."""

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def json_body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def parse_body(self, model: type[B]) -> B:
        """The JSON body as ``model`` (see gpuhub.platform.schema), or a 400 that names what is wrong."""
        try:
            return parse(model, self.json_body())
        except BodyError as exc:
            raise ApiError(400, str(exc)) from None

    def write_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(obj))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "message", None) or self._reason
        if status_code == 401:
            self.set_header("WWW-Authenticate", 'Bearer realm="gpuhub"')
        self.finish(json.dumps({"error": message}))

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, ApiError):
            log.info("%s %s -> %d: %s", self.request.method, self.request.path, value.status_code, value.message)
        else:
            super().log_exception(typ, value, tb)
