"""TLS for the daemons' HTTP APIs: the server side's settings and context.

A daemon serves HTTPS when its config names a certificate and a key (``tls_cert_file``,
``tls_key_file``); the roles give every host one, signed by the cluster's CA (docs/security.md,
"TLS"). Clients need nothing of their own: :class:`gpuhub.platform.http_client.HttpClient` verifies
the server's certificate and name against the host's trust store, where the roles install the
cluster CA (or where a site's own CA already is).
"""

from __future__ import annotations

import ssl

from traitlets import Unicode
from traitlets.config import Configurable

from gpuhub.platform.config import ConfigError


class TlsSettings(Configurable):
    """The certificate a daemon serves its API with; both empty: plain HTTP (development only)."""

    tls_cert_file = Unicode("", config=True,
                            help="PEM certificate (chain) the API is served with; empty: plain HTTP.")
    tls_key_file = Unicode("", config=True,
                           help="PEM private key of tls_cert_file (readable by the daemon only).")


def api_scheme(tls_cert_file: str) -> str:
    """The scheme of a daemon's API URLs: https once it has a certificate."""
    return "https" if tls_cert_file else "http"


def server_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """The context for tornado's ``ssl_options``, or None for plain HTTP. ConfigError (the daemon
    exits 2 naming the setting) when only one file is given or they cannot be loaded as a pair."""
    return cert_pair_context(settings.tls_cert_file, settings.tls_key_file)


def cert_pair_context(cert: str, key: str, names: tuple[str, str] = ("tls_cert_file", "tls_key_file")
                      ) -> ssl.SSLContext | None:
    """A server context of certificate ``cert`` and its ``key`` (settings ``names``), None when both
    are empty; ConfigError naming the setting when one is missing or they are not a pair."""
    if not cert and not key:
        return None
    if not cert or not key:
        missing = names[0] if not cert else names[1]
        raise ConfigError(f"{missing}: needed too when the other of {names[0]}/{names[1]} is set")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS: no such file {exc.filename}") from None
    except PermissionError as exc:
        raise ConfigError(f"TLS: cannot read {exc.filename} (permission denied)") from None
    except ssl.SSLError as exc:
        raise ConfigError(f"TLS: {cert} and {key} are not a PEM certificate and its key ({exc.reason})") from None
    return context


def local_api_url(settings: TlsSettings) -> str:
    """Where a process on the daemon's own host reaches its API (``settings`` has ``listen_address``
    and ``port`` too): loopback for a wildcard or loopback address, which the host's certificate
    names as well as its cluster address; https when the daemon serves TLS."""
    host = settings.listen_address
    if host in ("0.0.0.0", "::", "127.0.0.1", "localhost"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{api_scheme(settings.tls_cert_file)}://{host}:{settings.port}"
