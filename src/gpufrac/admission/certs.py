"""TLS material for the webhook: a local CA and a serving certificate signed by it.

The API server only calls webhooks over HTTPS and verifies the serving certificate against the
``caBundle`` of the webhook configuration, by subject alternative name (never the common name). In a
cluster the certificate comes from a Secret (``--tls-cert``/``--tls-key``); for ``gpufrac up``, tests and
a first try, this module makes a throwaway CA and a certificate for 127.0.0.1, localhost and the
Service's DNS names. ECDSA P-256 keeps generation fast (milliseconds), which matters in tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Paths of a CA certificate, and of the serving certificate and key it signed."""

    ca_cert: Path
    cert: Path
    key: Path

    def ca_bundle(self) -> bytes:
        """The PEM a webhook configuration's ``caBundle`` holds (base64-encoded there)."""
        return self.ca_cert.read_bytes()


def service_hosts(service: str, namespace: str) -> list[str]:
    """The DNS names under which the API server reaches ``service`` in ``namespace``."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufrac"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def generate_tls(directory: Path, *, hosts: Sequence[str] = LOCAL_HOSTS, valid_days: int = 365) -> TlsFiles:
    """Write a new CA and a serving certificate for ``hosts`` into ``directory`` (keys mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=valid_days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("gpufrac-admission-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0] if hosts else "gpufrac-admission"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_alt_names(hosts), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = TlsFiles(ca_cert=directory / "ca.crt", cert=directory / "tls.crt", key=directory / "tls.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.touch(mode=0o600)
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return files


def covers(files: TlsFiles, hosts: Sequence[str], *, margin: dt.timedelta = dt.timedelta(days=7)) -> bool:
    """Whether existing files hold a certificate for every one of ``hosts``, valid for ``margin`` more."""
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        files.key.read_bytes()
        files.ca_cert.read_bytes()
    except (OSError, ValueError):
        return False
    if cert.not_valid_after_utc - margin < dt.datetime.now(dt.UTC):
        return False
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    present = {str(ip) for ip in alt.get_values_for_type(x509.IPAddress)} | set(
        alt.get_values_for_type(x509.DNSName)
    )
    return set(hosts) <= present


def ensure_tls(directory: Path, *, hosts: Sequence[str] = LOCAL_HOSTS) -> TlsFiles:
    """The TLS files in ``directory``, generated anew unless they already cover ``hosts``."""
    files = TlsFiles(ca_cert=directory / "ca.crt", cert=directory / "tls.crt", key=directory / "tls.key")
    return files if covers(files, hosts) else generate_tls(directory, hosts=hosts)
