"""The webhook's Prometheus metrics, served on its own HTTPS port at ``/metrics``.

The webhook fails closed for GPU pods, so the day its certificate expires every GPU pod create is refused
cluster-wide while the Pod stays Ready. The expiry of the certificate new connections get is therefore a
gauge (the chart's PrometheusRule alerts on it days ahead), read at scrape time from the certificate the
server holds, so after a rotation it follows without anyone setting it. The connection counters show the
connection cap at work (docs/security.md, "The webhook itself").
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpufrac.process.build_info import register_build_info

CERTIFICATE_EXPIRY = "gpufrac_admission_certificate_expiry_timestamp_seconds"

#: Why a connection ended before it was answered (the ``reason`` label of the dropped counter).
DROP_REASONS = ("over_capacity", "tls_handshake", "timeout", "reset", "error")


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        register_build_info(self.registry, component="admission")
        self.certificate_expiry = Gauge(
            CERTIFICATE_EXPIRY,
            "Unix time at which the certificate served to new connections expires (its notAfter).",
            registry=self.registry,
        )
        self.certificate_reloads = Counter(
            "gpufrac_admission_certificate_reloads_total",
            "Times a changed certificate and key were loaded and served to new connections.",
            registry=self.registry,
        )
        self.certificate_reload_failures = Counter(
            "gpufrac_admission_certificate_reload_failures_total",
            "Changed certificate files that did not load (the previous certificate kept serving).",
            registry=self.registry,
        )
        self.connections_open = Gauge(
            "gpufrac_admission_connections_open",
            "Connections being served now (each holds one thread; at most --max-connections).",
            registry=self.registry,
        )
        self.connections_dropped = Counter(
            "gpufrac_admission_connections_dropped_total",
            "Connections that ended without an answer, by reason: over_capacity (closed at once, the cap "
            "was reached), tls_handshake, timeout, reset, error.",
            ["reason"],
            registry=self.registry,
        )
        for reason in DROP_REASONS:
            self.connections_dropped.labels(reason)

    def follow(self, *, expiry: Callable[[], float], open_connections: Callable[[], int]) -> None:
        """Read the served certificate's expiry and the open connections at scrape time."""
        self.certificate_expiry.set_function(expiry)
        self.connections_open.set_function(open_connections)
