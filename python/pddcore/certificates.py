"""A deployment CA and engine certificates for TransferEngine's certificate mode
(``tls_cert``/``tls_key``/``tls_ca``), made with the ``cryptography`` package
(``pip install cryptography``). Meant for tests and small deployments: a production CA
should keep its key offline, and can issue the same certificates with any tool.

An engine certificate is an ECDSA P-256 key signed by the CA, for TLS client and server use,
whose subject common name is the engine's name; the engine's id on the wire is
:func:`pddcore.transfer.engine_id_for_name` of that name, so an engine can only speak as
the name its certificate carries.

Example::

    from pddcore.certificates import make_ca, make_engine_certificate
    ca = make_ca("certs")
    md = make_engine_certificate("certs", "md-0", ca)
    engine = TransferEngine(listen="0.0.0.0:7000", **md.engine_kwargs())

``pddcore certs DIR --engines p-0 md-0`` does the same from a shell.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import NamedTuple

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class CertificateAuthority(NamedTuple):
    cert: Path  # PEM certificate: every engine's tls_ca
    key: Path   # PEM private key (mode 0600): signs engine certificates


class EngineCertificate(NamedTuple):
    cert: Path
    key: Path
    ca: Path

    def engine_kwargs(self) -> dict[str, str]:
        """``tls_cert``, ``tls_key`` and ``tls_ca`` for TransferEngine(...)."""
        return {"tls_cert": str(self.cert), "tls_key": str(self.key), "tls_ca": str(self.ca)}


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise RuntimeError("making certificates needs the 'cryptography' package: pip install cryptography") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key) -> None:
    _, _, serialization, _, _, _ = _crypto()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _validity(valid_from: datetime.datetime | None, valid_days: float):
    if not valid_days > 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")
    start = valid_from or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return start, start + datetime.timedelta(days=valid_days)


def make_ca(directory: str | os.PathLike, name: str = "pddcore deployment CA", *, valid_days: float = 365,
            valid_from: datetime.datetime | None = None) -> CertificateAuthority:
    """Writes a self-signed CA (``ca.pem``, ``ca.key``) into ``directory`` (created if needed)."""
    x509, hashes, serialization, ec, _, NameOID = _crypto()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(valid_from, valid_days)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    ca = CertificateAuthority(out / "ca.pem", out / "ca.key")
    ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(ca.key, key)
    return ca


def make_engine_certificate(directory: str | os.PathLike, engine_name: str, ca: CertificateAuthority, *,
                            valid_days: float = 365,
                            valid_from: datetime.datetime | None = None) -> EngineCertificate:
    """Writes ``<engine_name>.pem`` and ``<engine_name>.key`` into ``directory``: a certificate
    for ``engine_name`` (letters, digits, ``.``, ``_``, ``-``; at most 64) signed by ``ca``,
    valid from ``valid_from`` (default: five minutes ago) for ``valid_days``."""
    x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID = _crypto()
    if not isinstance(engine_name, str) or not _NAME.fullmatch(engine_name):
        raise ValueError(f"engine name must be 1-64 letters, digits, '.', '_' or '-', got {engine_name!r}")
    ca_cert = x509.load_pem_x509_certificate(Path(ca.cert).read_bytes())
    ca_key = serialization.load_pem_private_key(Path(ca.key).read_bytes(), password=None)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(valid_from, valid_days)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, engine_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    made = EngineCertificate(out / f"{engine_name}.pem", out / f"{engine_name}.key", Path(ca.cert))
    made.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(made.key, key)
    return made
