"""A leaf certificate of the stack follows its CA: made again when the CA was."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from app.stack import tls


def test_a_leaf_of_a_ca_made_again_is_made_again(tmp_path: Path) -> None:
    ca_dir, leaf_dir = tmp_path / "ca", tmp_path / "kafka"
    ca_dir.mkdir()
    leaf_dir.mkdir()
    first = tls.ensure_leaf(ca_dir, leaf_dir, "broker", ["127.0.0.1"]).read_bytes()
    # Given the CA made again (its files lost), the broker's leaf left in place
    for name in ("ca.pem", "ca.key"):
        (ca_dir / name).unlink()
    # When the leaf is ensured
    path = tls.ensure_leaf(ca_dir, leaf_dir, "broker", ["127.0.0.1"])
    # Then it is a new one, signed by the new CA (the old one no longer verifies)
    assert path.read_bytes() != first
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    x509.load_pem_x509_certificate(path.read_bytes()).verify_directly_issued_by(ca)
