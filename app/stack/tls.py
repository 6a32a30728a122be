"""The stack's own certificate authority and the brokers' certificates.

`dsec up` (and `dsec control prepare`) make a CA once, in root-only files, and a
certificate for each broker naming the addresses clients reach it by; clients check
the brokers against the CA (a trainer's credential file carries it). Keys are P-256;
certificates last ten years for the CA and two for a broker, and a broker's is made
again when it nears its end or its names change.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from app import secret_files

_CA_DAYS = 3650
_LEAF_DAYS = 730
#: A broker certificate this close to its end is made again.
_RENEW_BEFORE = dt.timedelta(days=30)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM (its file is root-only)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def ensure_ca(directory: Path) -> Path:
    """The CA's certificate (``ca.pem``), made with its key (``ca.key``, root only)
    if missing."""
    usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return ensure_self_signed(
        directory / "ca.key",
        directory / "ca.pem",
        "dsec stack CA",
        [x509.BasicConstraints(ca=True, path_length=0), usage],
    )


def ensure_self_signed(
    key_path: Path,
    cert_path: Path,
    common_name: str,
    extensions: Sequence[x509.ExtensionType] = (),
    days: int = _CA_DAYS,
) -> Path:
    """``cert_path``: a self-signed certificate (critical ``extensions``) made with
    its key (``key_path``, root only) if either is missing."""
    if cert_path.exists() and key_path.exists():
        return cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=True)
    cert = builder.sign(key, hashes.SHA256())
    secret_files.write(key_path, key_pem(key))
    secret_files.write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for host in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _current(path: Path, hosts: Sequence[str], ca_cert: x509.Certificate) -> bool:
    """``path`` holds a certificate for exactly ``hosts``, signed by ``ca_cert`` (a CA
    made again leaves every leaf of the old one unverifiable), not near its end."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    fresh = cert.not_valid_after_utc - _now() > _RENEW_BEFORE
    return fresh and set(sans) == set(_names(hosts))


def ensure_leaf(ca_dir: Path, directory: Path, name: str, hosts: Sequence[str]) -> Path:
    """``<name>.pem`` in ``directory``: a private key and a certificate for ``hosts``
    signed by the CA of ``ca_dir`` (made or made again as needed), root only, with the
    CA's certificate beside it (``ca.pem``: what its holder checks its peers with)."""
    path = directory / f"{name}.pem"
    ca_pem = ensure_ca(ca_dir).read_bytes()
    if not (directory / "ca.pem").exists() or (directory / "ca.pem").read_bytes() != ca_pem:
        secret_files.write(directory / "ca.pem", ca_pem)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    if _current(path, hosts, ca_cert):
        return path
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    secret_files.write(path, key_pem(key) + cert.public_bytes(serialization.Encoding.PEM))
    return path
