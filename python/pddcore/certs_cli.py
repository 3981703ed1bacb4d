"""`pddcore certs`: a deployment CA and engine certificates for TransferEngine's certificate
mode (see :mod:`pddcore.certificates`). Reuses ``DIR/ca.pem`` and ``DIR/ca.key`` when they
exist, else makes them; then one certificate and key per engine name, and prints each
engine's files and engine id.

Example::

    pddcore certs certs/ --engines p-0 rld-0 md-0
    pddcore engine ... --tls-cert certs/md-0.pem --tls-key certs/md-0.key --tls-ca certs/ca.pem
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .certificates import CertificateAuthority, make_ca, make_engine_certificate
from .transfer import engine_id_for_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="where ca.pem/ca.key are (or are made) and certificates go")
    parser.add_argument("--engines", nargs="+", required=True, metavar="NAME",
                        help="engine names: each certificate's subject common name, from which its engine id comes")
    parser.add_argument("--days", type=float, default=365, help="validity of new certificates (default 365)")


def run(args: argparse.Namespace) -> int:
    ca = CertificateAuthority(args.directory / "ca.pem", args.directory / "ca.key")
    if ca.cert.exists() != ca.key.exists():
        raise SystemExit(f"{args.directory} holds only one of ca.pem and ca.key")
    if not ca.cert.exists():
        ca = make_ca(args.directory, valid_days=args.days)
        print(f"CA: {ca.cert} (key {ca.key}: keep it off the engines)")
    for name in args.engines:
        made = make_engine_certificate(args.directory, name, ca, valid_days=args.days)
        print(f"{name}: --tls-cert {made.cert} --tls-key {made.key} --tls-ca {made.ca}  "
              f"(engine id {engine_id_for_name(name)})")
    return 0
