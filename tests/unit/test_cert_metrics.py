"""The certificate expiry text file (gpuhub/monitoring/certs.py): a real PEM certificate's notAfter,
and an unreadable or broken file reported as such without hiding the others."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from gpuhub.monitoring import certs

EXPIRES = dt.datetime(2027, 3, 1, 12, 0, tzinfo=dt.UTC)


def self_signed(path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hub1")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(EXPIRES - dt.timedelta(days=90)).not_valid_after(EXPIRES)
            .sign(key, hashes.SHA256()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_the_text_file_has_each_certificates_expiry_and_marks_the_unreadable_ones(tmp_path, capsys):
    good, broken, missing = tmp_path / "tls.crt", tmp_path / "broken.crt", tmp_path / "missing.crt"
    self_signed(good)
    broken.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    out = tmp_path / "textfile" / "gpuhub-certs.prom"
    out.parent.mkdir()
    assert certs.main(["--output", str(out), str(good), str(broken), str(missing)]) == 0
    samples = {(m.name, m.labels["path"]): m.value
               for fam in text_string_to_metric_families(out.read_text()) for m in fam.samples}
    assert samples == {
        ("gpuhub_tls_cert_not_after_seconds", str(good)): EXPIRES.timestamp(),
        ("gpuhub_tls_cert_readable", str(good)): 1, ("gpuhub_tls_cert_readable", str(broken)): 0,
        ("gpuhub_tls_cert_readable", str(missing)): 0,
    }
    err = capsys.readouterr().err
    assert f"cannot read a certificate: {missing}" in err and f"cannot read a certificate: {broken}" in err
    assert list(out.parent.iterdir()) == [out]  # written atomically: no temporary file left
