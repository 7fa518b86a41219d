"""The version has one home (``gpufrac.__version__``); everything a user sees repeats it, and agrees.

A release that bumps the package but not the chart would install images labelled with the old version;
these tests make that a red build instead of a confused operator.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

import gpufrac
from gpufrac.node.metrics import EnforcementCounters, UsageExporter, registry_for
from gpufrac.operator.reconciler import _Metrics as OperatorMetrics
from gpufrac.process.build_info import BUILD_INFO
from gpufrac.scheduler.metrics import SchedulerMetrics

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_distribution_reads_the_package_version() -> None:
    assert installed_version("gpufrac") == gpufrac.__version__


def test_gpufrac_version_prints_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpufrac", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gpufrac {gpufrac.__version__}"


def test_the_charts_app_version_agrees() -> None:
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "gpufrac" / "Chart.yaml").read_text())
    assert chart["appVersion"] == gpufrac.__version__


def test_the_image_label_agrees() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    labels = re.findall(r'org\.opencontainers\.image\.version="([^"]+)"', dockerfile)
    assert labels == [gpufrac.__version__]


def _node_agent_registry():
    return registry_for(UsageExporter(node="n1", counters=EnforcementCounters()))


@pytest.mark.parametrize(
    ("component", "registry"),
    [
        ("scheduler", lambda: SchedulerMetrics().registry),
        ("operator", lambda: OperatorMetrics().registry),
        ("node-agent", _node_agent_registry),
    ],
)
def test_every_component_exports_build_info(component: str, registry) -> None:
    scrape = generate_latest(registry()).decode()
    lines = [line for line in scrape.splitlines() if line.startswith(BUILD_INFO + "{")]
    assert len(lines) == 1, scrape
    assert f'version="{gpufrac.__version__}"' in lines[0]
    assert f'component="{component}"' in lines[0]
    assert lines[0].endswith(" 1.0")
