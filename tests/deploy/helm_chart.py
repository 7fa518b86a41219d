"""Rendering deploy/helm/gpufrac with the Helm binary that `make testenv` builds (testenv/helm/)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpufrac"
CRD = ROOT / "deploy" / "crds" / "gpufrac.io_gpufractioningconfigs.yaml"
QUEUE_CRD = ROOT / "deploy" / "crds" / "gpufrac.io_queues.yaml"
HELM = ROOT / "testenv" / "bin" / "helm"


def helm_binary() -> Path:
    """testenv/bin/helm, or a failed test that says how to build it."""
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: build it with `make testenv` (testenv/helm/build.sh)", pytrace=False)
    return HELM


def helm(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(helm_binary()), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "HOME": "/nonexistent",
            "PATH": "/usr/bin:/bin",
            "HELM_CACHE_HOME": "/tmp/gpufrac-helm-cache",
            "HELM_CONFIG_HOME": "/tmp/gpufrac-helm-config",
            "HELM_DATA_HOME": "/tmp/gpufrac-helm-data",
        },
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stderr}")
    return done


def render(
    values: dict[str, Any] | None = None,
    *,
    tmp_path: Path,
    release: str = "gpufrac",
    namespace: str = "gpufrac-system",
    extra: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`helm template` of the chart with ``values``: the rendered objects (empty documents dropped)."""
    values_file = tmp_path / f"values-{release}.yaml"
    values_file.write_text(yaml.safe_dump(values or {}))
    done = helm("template", release, CHART, "--namespace", namespace, "--values", values_file, *extra)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def kinds(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
