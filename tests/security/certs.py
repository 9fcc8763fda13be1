"""Certificates made in the test, never committed: a CA, a server certificate for localhost and
127.0.0.1 (and any other names asked for), and client certificates, all PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Certs:
    ca: str
    server: Pair
    client: Pair
    other_ca: str        # a CA that signed nothing here: trusting it must fail
    stranger: Pair       # a client certificate the CA did not sign


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> Pair:
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return Pair(str(folder / f"{stem}.pem"), str(folder / f"{stem}.key"))


def _ca(common: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(common: str, ca_cert, ca_key, usage, names: tuple[str, ...] = ()):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if names:
        alt = []
        for n in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alt.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_certs(folder: Path, names: tuple[str, ...] = ()) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca("kvserve test CA")
    _write(folder, "ca", ca_cert, ca_key)
    server = _write(folder, "server", *_leaf("kvserve server", ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH,
                                             ("localhost", "127.0.0.1", *names)))
    client = _write(folder, "client", *_leaf("kvserve client", ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH))
    other_cert, other_key = _ca("some other CA")
    _write(folder, "other-ca", other_cert, other_key)
    stranger = _write(folder, "stranger", *_leaf("stranger", other_cert, other_key, ExtendedKeyUsageOID.CLIENT_AUTH))
    return Certs(str(folder / "ca.pem"), server, client, str(folder / "other-ca.pem"), stranger)
