"""``gpufrac_build_info``: which gpufrac a component runs, on every component's /metrics.

The Prometheus convention for a build-info metric (a gauge fixed at 1 whose labels carry the version) lets
a dashboard or alert join any series with the version that produced it, and shows a half-finished rollout
as two versions at once. The version comes from its one home, ``gpufrac.__version__``.
"""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge

from gpufrac import __version__

BUILD_INFO = "gpufrac_build_info"
BUILD_INFO_LABELS = ("version", "component", "python")


def register_build_info(registry: CollectorRegistry, *, component: str) -> None:
    """Add ``gpufrac_build_info{version, component, python} 1`` to ``registry``."""
    gauge = Gauge(
        BUILD_INFO,
        "Always 1; the labels say which gpufrac version and Python this component runs.",
        BUILD_INFO_LABELS,
        registry=registry,
    )
    gauge.labels(__version__, component, platform.python_version()).set(1)
