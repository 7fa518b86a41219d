"""TLS material for the webhook: a local CA and a serving certificate signed by it.

The API server only calls webhooks over HTTPS and verifies the serving certificate against the
``caBundle`` of the webhook configuration, by subject alternative name (never the common name). In a
cluster the certificate comes from a Secret (``--tls-cert``/``--tls-key``); for ``gpufrac up``, tests and
a first try, this module makes a throwaway CA and a certificate for 127.0.0.1, localhost and the
Service's DNS names. ECDSA P-256 keeps generation fast (milliseconds), which matters in tests.

A certificate from a Secret is rotated in place (cert-manager renews it, an admin replaces an
``existingSecret``), and the kubelet swaps a Secret volume's files through a symlink, never restarting the
Pod. ``ServingCertificate`` therefore re-reads both files every few seconds and builds a new TLS context
when their content changes; a pair that does not load (half written, a key of another certificate, not
PEM) keeps the old one serving and is reported once. Reading two small files is cheaper than any
file-watch machinery and sees a symlink swap, an in-place write and a new inode alike.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

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


class CertificateError(ValueError):
    """A certificate and key that cannot serve: unreadable, not PEM, or not a pair."""


@dataclass(frozen=True, slots=True)
class LoadedCertificate:
    """A TLS server context for one certificate and key, with what was read to build it."""

    context: ssl.SSLContext
    not_after: dt.datetime
    digest: bytes  # of the certificate and key files' content, to notice a change


def _read_pair(cert: Path, key: Path) -> tuple[bytes, bytes]:
    try:
        return cert.read_bytes(), key.read_bytes()
    except OSError as error:
        raise CertificateError(f"cannot read {error.filename}: {error.strerror}") from None


def _digest(pem: tuple[bytes, bytes]) -> bytes:
    return hashlib.sha256(pem[0] + b"\0" + pem[1]).digest()


def load_certificate(cert: Path, key: Path) -> LoadedCertificate:
    """A server context for ``cert`` (PEM, chain allowed) and ``key``; ``CertificateError`` says why not.

    OpenSSL reads the files itself, so their content is read before and after: a pair replaced while it
    was loading raises rather than pair a context with the wrong expiry."""
    before = _read_pair(cert, key)
    try:
        not_after = x509.load_pem_x509_certificate(before[0]).not_valid_after_utc
    except ValueError as error:
        raise CertificateError(f"{cert} holds no PEM certificate ({error})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (ssl.SSLError, OSError) as error:
        reason = getattr(error, "reason", None) or getattr(error, "strerror", None) or str(error)
        raise CertificateError(
            f"{cert} and {key} do not load as a certificate and its key ({reason})"
        ) from None
    if _read_pair(cert, key) != before:
        raise CertificateError(f"{cert} or {key} changed while loading")
    return LoadedCertificate(context=context, not_after=not_after, digest=_digest(before))


class ServingCertificate:
    """The certificate new connections get, reloaded by ``check()`` when its files change.

    ``check`` is cheap (two small reads and a hash) and is called every few seconds by the server; a
    connection already open keeps the certificate it was handshaken with."""

    def __init__(self, *, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        self._current = load_certificate(cert, key)  # no old one to keep: a bad pair at start is fatal
        self._rejected: bytes | None = None  # digest of the last pair that failed, reported once
        self._lock = threading.Lock()
        self.reloads = 0
        self.failures = 0

    @property
    def current(self) -> LoadedCertificate:
        return self._current

    def check(self) -> bool:
        """Load the files again if their content changed; whether the served certificate changed."""
        with self._lock:
            try:
                pem = _read_pair(self.cert, self.key)
            except CertificateError:
                try:  # a symlink swap removes the old files just after the switch: read once more
                    pem = _read_pair(self.cert, self.key)
                except CertificateError as error:
                    return self._reject(str(error).encode(), str(error))
            digest = _digest(pem)
            if digest in (self._current.digest, self._rejected):
                return False
            try:
                loaded = load_certificate(self.cert, self.key)
            except CertificateError as error:
                if _digest(_read_pair_or_empty(self.cert, self.key)) != digest:
                    return False  # mid-rotation: the next check sees the finished pair
                return self._reject(digest, str(error))
            self._current, self._rejected = loaded, None
            self.reloads += 1
        log.info(
            "serving a new certificate",
            extra={"cert": str(self.cert), "not_after": loaded.not_after.isoformat()},
        )
        return True

    def _reject(self, digest: bytes, reason: str) -> bool:
        if digest != self._rejected:
            self._rejected = digest
            self.failures += 1
            log.warning(
                "certificate not reloaded, still serving the one valid until %s: %s",
                self._current.not_after.isoformat(),
                reason,
            )
        return False


def _read_pair_or_empty(cert: Path, key: Path) -> tuple[bytes, bytes]:
    try:
        return _read_pair(cert, key)
    except CertificateError:
        return b"", b""
