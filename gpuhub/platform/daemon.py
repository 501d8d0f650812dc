"""The bootstrap ``gpuhub-agent`` and ``gpuhub-scheduler`` share, as a traitlets ``Application``.

It parses the command line (``--config FILE``, ``--log-level``, ``--help-all``, and overrides such as
``--AgentConfig.port=8700``), sets up logging, reads the TOML config and the token files, serves the
daemon's tornado app, and stops gracefully on SIGTERM/SIGINT. A daemon subclasses :class:`Daemon`
and fills in the hooks (``secret_files``, ``init_service``, ``prepare``, ``make_web_app``,
``background``, ``on_stop``). A config error exits 2 with ``<daemon>: <message>`` on stderr.
"""

from __future__ import annotations

import asyncio
import logging
import logging.config
import signal
import sys
from argparse import ArgumentError
from collections.abc import Coroutine
from typing import Any, ClassVar

from tornado.httpserver import HTTPServer
from tornado.web import Application as WebApplication
from tornado.web import RequestHandler
from traitlets import Enum, TraitError, Unicode, default, observe
from traitlets.config import Application, Configurable
from traitlets.config.loader import KVArgParseConfigLoader

from gpuhub.platform.config import ConfigError, load_config_file, make_settings, read_secret
from gpuhub.platform.http_server import LogLimiter, server_limits
from gpuhub.platform.tls import api_scheme, server_context

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (a handler made under a test's captured stderr keeps working)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def access_log(logger: logging.Logger, quiet_paths: tuple[str, ...] = ()):
    """A tornado ``log_function``: one line per request, method, path (no query), status and time.

    Never headers or bodies (tokens, kernel keys). Reads that succeeded (each running kernel's
    server polls its state every few seconds, and the scheduler its units) and ``quiet_paths``
    answered 200 (heartbeats) go to DEBUG so they do not drown the log: INFO says what changed.
    Refused requests are rate-limited per status (a flood of bad tokens is a few lines, not one each).
    """
    limiter = LogLimiter()

    def log_request(handler: RequestHandler) -> None:
        status = handler.get_status()
        level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
        read = status < 400 and handler.request.method in ("GET", "HEAD")
        if read or (status == 200 and handler.request.path in quiet_paths):
            level = logging.DEBUG
        if status >= 400 and not limiter.allow(f"answered {status}", logger, level):
            return
        logger.log(level, "%d %s %s %.1fms", status, handler.request.method, handler.request.path,
                   1000 * handler.request.request_time())

    return log_request


class LogLevelEnum(Enum):
    def validate(self, obj, value):
        # Any case, as logging itself takes (--log-level debug worked before).
        return super().validate(obj, value.upper() if isinstance(value, str) else value)


class _StrictLoader(KVArgParseConfigLoader):
    def _handle_unrecognized_alias(self, arg: str) -> None:
        # A mistyped option must not be ignored (traitlets only warns), as a mistyped key is not.
        raise ConfigError(f"unknown option --{arg} (see --help)")


class Daemon(Application):
    """One gpuhub daemon. Subclasses set the class attributes below and override the hooks."""

    #: The Configurable whose traits are the keys of the daemon's TOML file.
    settings_class: ClassVar[type[Configurable]]
    #: Requests to these paths answered 200 are logged at DEBUG only.
    quiet_paths: ClassVar[tuple[str, ...]] = ()
    stop_message: ClassVar[str] = "stopping"
    #: Set by initialize(): the settings_class instance, and the tokens read (see secret_files).
    settings: Any
    secrets: dict[str, str]
    #: Set by initialize(): the API's TLS context, None for plain HTTP (gpuhub.platform.tls).
    tls_context: Any = None

    # A subclass redeclares it with its file as the default (shown by --help).
    config_file = Unicode(config=True, help="The daemon's TOML config file.")
    log_level = LogLevelEnum((*Application.log_level.values, "WARNING"), default_value="INFO",
                     help="Log level, by name (any case) or value.").tag(config=True)
    log_format = Unicode(LOG_FORMAT, help="The logging format template.").tag(config=True)
    # Application's --show-config flags would swap start(); the daemons do not use start().
    # Not a ClassVar: traitlets' Application declares flags, aliases and classes as (overridable) attributes.
    flags = {  # noqa: RUF012
        "debug": ({"Application": {"log_level": logging.DEBUG}}, "Log at DEBUG level."),
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Named after the subclass, so --help shows its defaults.
        cls.aliases = {"config": f"{cls.__name__}.config_file", "log-level": f"{cls.__name__}.log_level"}
        if "settings_class" in cls.__dict__:  # its traits are what --help-all and the command line know
            cls.classes = [cls.settings_class]

    @observe("config")
    def _config_changed(self, change) -> None:
        # Not Application's, which logs the whole config at DEBUG: static_user_tokens holds tokens.
        Configurable._config_changed(self, change)

    @default("log")
    def _default_log(self) -> logging.Logger:
        return logging.getLogger(f"gpuhub.{self.name.removeprefix('gpuhub-')}")

    def _configure_logging(self) -> None:
        # The daemons' modules log to "gpuhub.*" loggers through the root logger (not to the
        # Application's own logger, as traitlets would set up), so one handler on the root serves all.
        root = logging.getLogger()
        handler = next((h for h in root.handlers if getattr(h, "_gpuhub_daemon", False)), None)
        if handler is None:
            handler = _StderrHandler()
            handler._gpuhub_daemon = True  # type: ignore[attr-defined]
            root.addHandler(handler)
        handler.setFormatter(logging.Formatter(self.log_format, self.log_datefmt))
        root.setLevel(self.log_level)
        if self.logging_config:  # more handlers, as --Application.logging_config promises
            logging.config.dictConfig({"version": 1, "disable_existing_loggers": False, **self.logging_config})
        self._logging_configured = True

    def emit_help(self, classes: bool = False):
        # --help-all: the daemon's settings only, not every logging knob of traitlets' Application.
        yield from self.emit_description()
        yield from self.emit_options_help()
        if classes:
            section = self.settings_class.__name__
            yield "Settings"
            yield "========"
            yield (f"The keys of the TOML config file ({self.config_file}). On the command line, "
                   f"--{section}.KEY=VALUE overrides one.")
            yield ""
            yield self.settings_class.class_get_help()
        yield from self.emit_help_epilogue(classes)

    # --- hooks ------------------------------------------------------------------------
    def secret_files(self) -> dict[str, str]:
        """Token files to read, ``{what: path}``; they land in ``self.secrets`` under the same keys
        (and ``metrics_token_file``, when the settings name one, under "metrics")."""
        return {}

    def init_service(self) -> None:
        """Build the daemon's service from ``self.settings`` and ``self.secrets``; may raise ConfigError."""

    async def prepare(self) -> None:
        """Runs in the event loop before the server listens (recover state)."""

    def make_web_app(self) -> WebApplication:
        raise NotImplementedError

    def background(self) -> list[Coroutine[Any, Any, Any]]:
        """Coroutines to run as tasks while serving; cancelled on stop."""
        return []

    def listening_message(self) -> str:
        scheme = api_scheme(self.settings.tls_cert_file)
        return f"{self.name} listening on {scheme}://{self.settings.listen_address}:{self.settings.port}"

    def on_stop(self) -> None:
        """After the server stopped and the background tasks ended (save state)."""

    # --- bootstrap ----------------------------------------------------------------------
    def parse_command_line(self, argv: list[str] | None = None) -> None:
        # Application's own wrapper logs and exits 1 on a bad option; here it is a config error (exit 2).
        try:
            Application.parse_command_line.__wrapped__(self, argv)  # type: ignore[attr-defined]
        except (TraitError, ArgumentError) as exc:
            raise ConfigError(f"command line: {exc}") from None
        if self.extra_args:
            raise ConfigError(f"unexpected argument(s): {' '.join(self.extra_args)}")

    def _create_loader(self, argv, aliases, flags, classes):
        return _StrictLoader(argv, aliases, flags, classes=classes, log=self.log, subcommands=self.subcommands)

    def initialize(self, argv: list[str] | None = None) -> None:
        """Parse the command line, read the config file and the secrets, build the service."""
        self.parse_command_line(argv)
        section = self.settings_class.__name__
        cli = self.cli_config.get(section, {})
        unknown = set(cli) - set(self.settings_class.class_traits(config=True))
        if unknown:
            names = ", ".join(f"{section}.{n}" for n in sorted(unknown))
            raise ConfigError(f"command line: unknown setting(s) {names}")
        config = load_config_file(self.settings_class, self.config_file)
        config.merge(self.cli_config)  # the command line wins over the file
        self.update_config(config)
        source = f"{self.config_file} or the command line" if cli else self.config_file
        self.settings = make_settings(self.settings_class, self.config, source, parent=self)
        files = self.secret_files()
        if getattr(self.settings, "metrics_token_file", ""):
            files["metrics"] = self.settings.metrics_token_file
        self.secrets = {what: read_secret(path, what) for what, path in files.items()}
        self.tls_context = server_context(self.settings)
        self.init_service()

    async def serve(self) -> None:
        await self.prepare()
        web_app = self.make_web_app()
        web_app.settings["log_function"] = access_log(logging.getLogger(f"{self.log.name}.access"),
                                                      self.quiet_paths)
        web_app.settings["gpuhub_max_body_bytes"] = self.settings.max_body_bytes
        server = HTTPServer(web_app, xheaders=False, ssl_options=self.tls_context, **server_limits(self.settings))
        server.listen(self.settings.port, address=self.settings.listen_address)
        self.log.info("%s", self.listening_message())
        tasks = [asyncio.create_task(c) for c in self.background()]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        self.log.info("%s %s", self.name, self.stop_message)
        server.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.on_stop()

    @classmethod
    def main(cls, argv: list[str] | None = None) -> int:
        """The console script: 0 after a graceful stop, 2 on a config error."""
        app = cls()
        try:
            app.initialize(argv)
        except ConfigError as exc:
            print(f"{app.name}: {exc}", file=sys.stderr)
            return 2
        except SystemExit as exc:  # --help, --version, or argparse's own usage error
            return exc.code if isinstance(exc.code, int) else 2
        asyncio.run(app.serve())
        return 0
