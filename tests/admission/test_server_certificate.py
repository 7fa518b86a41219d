"""The webhook's certificate rotates without a restart, and its expiry is a metric.

A Secret volume is laid out by the kubelet as ``..<timestamp>/`` directories, a ``..data`` symlink to the
current one, and ``tls.crt``/``tls.key`` symlinks through ``..data``; a rotation writes a new directory
and swaps ``..data`` in one rename. These tests build that layout, rotate it, and read the certificate a
new TLS client is given.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.metrics import CERTIFICATE_EXPIRY
from gpufrac.admission.server import AdmissionServer


def publish(volume: Path, files: TlsFiles, version: str) -> None:
    """Swap ``volume`` to ``files``' certificate and key the way the kubelet updates a Secret volume."""
    data = volume / f"..{version}"
    data.mkdir(parents=True)
    shutil.copy(files.cert, data / "tls.crt")
    shutil.copy(files.key, data / "tls.key")
    staged = volume / "..data_tmp"
    staged.symlink_to(data.name)
    os.replace(staged, volume / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def served_certificate(port: int) -> bytes:
    """The DER certificate a new TLS connection to ``port`` is given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def certificate(files: TlsFiles) -> x509.Certificate:
    return x509.load_pem_x509_certificate(files.cert.read_bytes())


def der(files: TlsFiles) -> bytes:
    return certificate(files).public_bytes(serialization.Encoding.DER)


def scraped(server: AdmissionServer) -> dict[str, float]:
    """The unlabelled samples of the server's /metrics, scraped over its own HTTPS port."""
    text = httpx.get(server.url("/metrics"), verify=False).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 15
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


@pytest.fixture
def volume(tmp_path: Path) -> tuple[Path, TlsFiles]:
    first = generate_tls(tmp_path / "first", valid_days=30)
    publish(tmp_path / "volume", first, "v1")
    return tmp_path / "volume", first


@pytest.fixture
def server(volume: tuple[Path, TlsFiles]) -> Iterator[AdmissionServer]:
    path, _ = volume
    with AdmissionServer(
        cert=path / "tls.crt", key=path / "tls.key", host="127.0.0.1", port=0, cert_poll_interval_s=0.05
    ) as running:
        yield running


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
    tmp_path: Path, volume: tuple[Path, TlsFiles], server: AdmissionServer
) -> None:
    path, first = volume
    assert served_certificate(server.port) == der(first)

    second = generate_tls(tmp_path / "second", valid_days=90)
    publish(path, second, "v2")

    wait_for(lambda: served_certificate(server.port) == der(second), "the rotated certificate was served")
    trusted = ssl.create_default_context(cafile=str(second.ca_cert))
    assert httpx.get(server.url("/healthz"), verify=trusted).text == "ok"
    assert scraped(server)[CERTIFICATE_EXPIRY] == certificate(second).not_valid_after_utc.timestamp()
    assert scraped(server)["gpufrac_admission_certificate_reloads_total"] == 1


def test_the_expiry_metric_is_the_served_certificates_not_after(
    volume: tuple[Path, TlsFiles], server: AdmissionServer
) -> None:
    _, first = volume
    not_after = certificate(first).not_valid_after_utc.timestamp()
    assert scraped(server)[CERTIFICATE_EXPIRY] == not_after
    served = x509.load_der_x509_certificate(served_certificate(server.port))
    assert served.not_valid_after_utc.timestamp() == not_after


def _truncated(good: TlsFiles, into: Path) -> TlsFiles:
    into.mkdir()
    (into / "tls.crt").write_bytes(good.cert.read_bytes()[:200])  # a copy cut off halfway
    shutil.copy(good.key, into / "tls.key")
    return TlsFiles(ca_cert=good.ca_cert, cert=into / "tls.crt", key=into / "tls.key")


def _foreign_key(good: TlsFiles, into: Path) -> TlsFiles:
    other = generate_tls(into.with_name(into.name + "-other"))
    into.mkdir()
    shutil.copy(good.cert, into / "tls.crt")
    shutil.copy(other.key, into / "tls.key")  # the key of another certificate
    return TlsFiles(ca_cert=good.ca_cert, cert=into / "tls.crt", key=into / "tls.key")


@pytest.mark.parametrize("broken", [_truncated, _foreign_key], ids=["half-written", "foreign-key"])
def test_a_pair_that_does_not_load_keeps_the_old_certificate_and_says_so_once(
    tmp_path: Path,
    volume: tuple[Path, TlsFiles],
    caplog: pytest.LogCaptureFixture,
    broken: Callable[[TlsFiles, Path], TlsFiles],
) -> None:
    path, first = volume
    caplog.set_level(logging.INFO, logger="gpufrac.admission")
    # The poller is slowed down: this test drives the checks itself.
    with AdmissionServer(
        cert=path / "tls.crt", key=path / "tls.key", host="127.0.0.1", port=0, cert_poll_interval_s=3600
    ) as server:
        second = generate_tls(tmp_path / "second")
        publish(path, broken(second, tmp_path / "broken"), "v2")

        assert [server.check_certificate() for _ in range(3)] == [False, False, False]
        assert served_certificate(server.port) == der(first)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert warnings[0].getMessage().startswith("certificate not reloaded, still serving the one valid")
        assert str(path / "tls.crt") in warnings[0].getMessage()
        assert warnings[0].exc_info is None
        assert scraped(server)["gpufrac_admission_certificate_reload_failures_total"] == 1
        assert scraped(server)[CERTIFICATE_EXPIRY] == certificate(first).not_valid_after_utc.timestamp()

        publish(path, second, "v3")  # the rotation completes
        assert server.check_certificate() is True
        assert served_certificate(server.port) == der(second)


def test_files_that_vanish_keep_the_old_certificate_until_they_are_back(
    tmp_path: Path, volume: tuple[Path, TlsFiles], caplog: pytest.LogCaptureFixture
) -> None:
    path, first = volume
    caplog.set_level(logging.INFO, logger="gpufrac.admission")
    with AdmissionServer(
        cert=path / "tls.crt", key=path / "tls.key", host="127.0.0.1", port=0, cert_poll_interval_s=3600
    ) as server:
        (path / "..data").unlink()  # the Secret's files are gone (the links dangle)
        assert [server.check_certificate() for _ in range(3)] == [False, False, False]
        assert served_certificate(server.port) == der(first)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and f"cannot read {path / 'tls.crt'}" in warnings[0]

        second = generate_tls(tmp_path / "second")
        publish(path, second, "v2")
        assert server.check_certificate() is True
        assert served_certificate(server.port) == der(second)
