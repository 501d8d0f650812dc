"""The server side of the daemons' HTTP APIs (tornado): bearer tokens, JSON in and out, clear 400s.

An unauthenticated request must cost a daemon no more than its headers: every handler streams its
body (``stream_request_body``), checks the caller in ``prepare`` (before a byte of the body is read)
and refuses a body over ``max_body_bytes`` by its Content-Length, or by closing the connection once
a chunked one passes it. The server side limits (header size, header and body timeouts) are in
:func:`server_limits`; the daemons' settings carry them (:class:`HttpLimits`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import time
from typing import Any, ClassVar, TypeVar

from tornado.web import HTTPError, RequestHandler, stream_request_body
from traitlets import Float, Int, Unicode
from traitlets.config import Configurable

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


HASHED_PREFIX = "sha256:"


def token_matches(presented: str | None, stored: str) -> bool:
    """Whether ``presented`` is the token a daemon's token file holds: the token itself, or
    ``sha256:<hex digest of it>``. A host that only checks a token keeps the hash: its root cannot
    read the token there and present it to the other hosts that accept it."""
    if presented is None:
        return False
    if stored.startswith(HASHED_PREFIX):
        digest = hashlib.sha256(presented.encode()).hexdigest()
        return hmac.compare_digest(digest.encode(), stored[len(HASHED_PREFIX):].lower().encode())
    return tokens_equal(presented, stored)


MAX_BODY_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 10


def opens_metrics(callers: tuple[str, ...], metrics_token: str | None, presented: str | None) -> bool:
    """Whether ``presented`` is the metrics token (``metrics_token_file``) on a handler whose
    ``callers`` take it: the agents' and the scheduler's /metrics."""
    return "metrics" in callers and bool(metrics_token) and token_matches(presented, metrics_token)


class MetricsAccess(Configurable):
    """A token for GET /metrics only; a base of the daemons' settings. Prometheus holds it instead of
    a token that can also start units or kernels."""

    metrics_token_file = Unicode("", config=True,
                                 help="File with a token good for GET /metrics only (Prometheus), or sha256:<its "
                                      "hex digest>; empty: /metrics takes the admin token only.")


class HttpLimits(Configurable):
    """What one request may cost a daemon; a base of the daemons' settings (keys of their TOML files)."""

    max_body_bytes = Int(MAX_BODY_BYTES, min=1024, max=64 << 20, config=True,
                         help="Largest request body the API reads; a larger one gets 413 before it is read.")
    header_timeout_s = Float(10.0, min=0.1, config=True,
                             help="A connection that has not sent a whole request head this long is closed "
                                  "(also an idle keep-alive connection).")
    body_timeout_s = Float(30.0, min=0.1, config=True,
                           help="A request whose body has not arrived whole this long is dropped.")


def server_limits(limits: HttpLimits) -> dict[str, Any]:
    """Keyword arguments of tornado's HTTPServer for ``limits``."""
    return {"max_body_size": limits.max_body_bytes, "max_header_size": MAX_HEADER_BYTES,
            "idle_connection_timeout": limits.header_timeout_s, "body_timeout": limits.body_timeout_s}


class LogLimiter:
    """At most ``burst`` lines per ``window_s`` for each key (a status, a reason); the lines held back
    are counted and said in one line when the next window opens. A flood of bad requests must not
    fill the journal (and the disk) of a daemon."""

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        self.burst, self.window_s = burst, window_s
        self._windows: dict[Any, list] = {}  # key -> [window start, lines logged, lines held back]

    def allow(self, key: Any, logger: logging.Logger, level: int) -> bool:
        now = time.monotonic()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None and w[2]:
                logger.log(level, "%d more such line(s) (%s) held back in %.0f s", w[2], key, now - w[0])
            if len(self._windows) > 1000:  # keys come from a small set; never let them grow without end
                self._windows.clear()
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            return True
        w[2] += 1
        return False


_error_log_limiter = LogLimiter()
# An unauthenticated body up to this size is read (and dropped) before the 401; a larger one is not read.
DISCARD_BYTES = 64 << 10


def _refused_first(method):
    """``method``, preceded by the refusal ``prepare`` kept while a small body was being discarded."""

    @functools.wraps(method)
    async def checked(self, *args: Any, **kwargs: Any) -> None:
        if self._refusal is not None:
            raise self._refusal
        result = method(self, *args, **kwargs)
        if result is not None:
            await result

    return checked


@stream_request_body
class JsonHandler(RequestHandler):
    """Base handler: callers checked before the body is read, bounded JSON bodies, JSON errors, and
    no token or body ever written to logs.

    A subclass says who may call it in ``callers`` and implements :meth:`authenticate`."""

    #: Who may call this handler's methods, as :meth:`authenticate` understands them.
    callers: ClassVar[tuple[str, ...]] = ()

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    async def authenticate(self) -> None:
        """Raise ApiError(401) unless the request's token belongs to one of ``callers``; may keep
        who the caller is on the handler. Runs before the body is read."""
        raise ApiError(401, "missing or invalid token")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for verb in ("get", "post", "put", "delete", "patch"):
            if verb in cls.__dict__:
                setattr(cls, verb, _refused_first(cls.__dict__[verb]))

    async def prepare(self) -> None:
        self._body = bytearray()
        self._refusal: ApiError | None = None
        length = self.request.headers.get("Content-Length")
        try:
            await self.authenticate()
        except ApiError as exc:
            chunked = "chunked" in self.request.headers.get("Transfer-Encoding", "").lower()
            if chunked or not (length is None or (length.isdigit() and int(length) <= DISCARD_BYTES)):
                raise  # answered now; tornado closes the connection instead of reading the body
            # Refused after the (small or empty) body is read and thrown away: tornado closes a
            # connection answered before its request was read whole, so the client could see a reset
            # instead of the answer and would lose its keep-alive connection.
            self._refusal = exc
            return
        limit = self.settings.get("gpuhub_max_body_bytes", MAX_BODY_BYTES)
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise ApiError(413, f"request body over {limit} bytes")
        # A chunked body has no length up front: tornado drops the connection once it passes the limit.
        self.request.connection.set_max_body_size(limit)

    def data_received(self, chunk: bytes) -> None:
        if self._refusal is None:
            self._body += chunk

    async def _not_allowed(self, *args: Any) -> None:
        if self._refusal is not None:  # an unauthenticated caller learns nothing, not even the methods
            raise self._refusal
        raise ApiError(405, f"{self.request.method} is not allowed on {self.request.path[:200]}")

    get = post = put = delete = patch = _not_allowed

    def json_body(self) -> dict[str, Any]:
        if not self._body:
            return {}
        try:
            body = json.loads(self._body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # "[[[[…": deeper than the parser goes
            raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
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
            if value.status_code != 401 and _error_log_limiter.allow(value.status_code, log, logging.INFO):
                log.info("%s %s -> %d: %s", self.request.method, self.request.path, value.status_code,
                         value.message)
        else:
            super().log_exception(typ, value, tb)


class NotFoundHandler(JsonHandler):
    """Any path no route matches: a JSON 404 (not tornado's HTML page), decided before the body is
    read, like a refused token (a small body is dropped first, a large one never read)."""

    async def authenticate(self) -> None:
        raise ApiError(404, f"no API path {self.request.path[:200]!r}")

    async def get(self, *args: Any) -> None:  # reached only through prepare's refusal (_refused_first)
        await self.authenticate()

    post = put = delete = patch = get


def api_settings() -> dict[str, Any]:
    """tornado Application settings both daemons' APIs share."""
    return {"default_handler_class": NotFoundHandler}
