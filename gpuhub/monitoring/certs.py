"""When the TLS certificates gpuhub serves expire, as a node_exporter text file (docs/monitoring.md).

``python -m gpuhub.monitoring.certs --output /var/lib/prometheus/node-exporter/gpuhub-certs.prom
CERT…`` runs from a systemd timer on every gpuhub host (roles/gpuhub). Prometheus alerts before
a certificate expires (GpuhubCertificateExpiring) and when one cannot be read
(GpuhubCertificateUnreadable). A file that is missing or is not a PEM certificate is reported as
unreadable; it never stops the others from being reported.
"""

from __future__ import annotations

import argparse
import sys

from cryptography import x509
from prometheus_client import CollectorRegistry, Gauge, write_to_textfile


def not_after(path: str) -> float:
    """The certificate's notAfter (Unix seconds); OSError or ValueError when it cannot be read."""
    with open(path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    return cert.not_valid_after_utc.timestamp()


def registry_for(paths: list[str]) -> tuple[CollectorRegistry, list[str]]:
    """The metrics of ``paths``, and a line per certificate that could not be read."""
    reg = CollectorRegistry()
    expiry = Gauge("gpuhub_tls_cert_not_after_seconds", "When the TLS certificate expires (Unix time)",
                   ["path"], registry=reg)
    readable = Gauge("gpuhub_tls_cert_readable", "1 if the TLS certificate could be read and parsed, else 0",
                     ["path"], registry=reg)
    problems = []
    for path in paths:
        try:
            expires = not_after(path)  # first: labels() alone would export a 0 for a broken file
            expiry.labels(path).set(expires)
            readable.labels(path).set(1)
        except (OSError, ValueError) as exc:
            readable.labels(path).set(0)
            problems.append(f"{path}: {exc}")
    return reg, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuhub.monitoring.certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the .prom file to write (atomically) for node_exporter")
    parser.add_argument("certs", nargs="+", help="PEM certificate files")
    args = parser.parse_args(argv)
    reg, problems = registry_for(args.certs)
    write_to_textfile(args.output, reg)
    for line in problems:
        print(f"cannot read a certificate: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
