"""The cluster side of gpufrac's DRA driver in the embedded cluster: the chart's DeviceClasses.

Claims name a DeviceClass per compute mode (docs/dra.md); a cluster gets them from the chart
(``templates/dra-deviceclasses.yaml``), so the embedded cluster renders that very template with the
testenv's helm (``helm template --show-only``) instead of keeping a copy: one source for ``gpufrac up
--dra`` and the DRA real-node test.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from lightkube import AsyncClient
from lightkube.resources.resource_v1 import DeviceClass

from gpufrac.kube.errors import Conflict, api_errors
from gpufrac.local.controlplane import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "helm" / "gpufrac"
DEVICE_CLASSES_TEMPLATE = "templates/dra-deviceclasses.yaml"
HELM = REPO_ROOT / "testenv" / "bin" / "helm"


class DeviceClassesError(RuntimeError):
    """The chart's DeviceClasses could not be rendered (the message has helm's)."""


def device_classes(*, work_dir: Path, helm: Path = HELM) -> list[dict[str, Any]]:
    """The chart's DeviceClasses, rendered with ``dra.enabled=true`` (helm's caches under ``work_dir``)."""
    if not helm.exists():
        raise DeviceClassesError(f"{helm} is missing: build it with `make testenv`")
    home = work_dir / "helm"
    rendered = subprocess.run(
        [
            str(helm),
            "template",
            "gpufrac",
            str(CHART),
            "--set",
            "dra.enabled=true",
            "--show-only",
            DEVICE_CLASSES_TEMPLATE,
        ],
        capture_output=True,
        text=True,
        env={
            "HOME": str(work_dir),
            "HELM_CACHE_HOME": str(home),
            "HELM_CONFIG_HOME": str(home),
            "HELM_DATA_HOME": str(home),
        },
    )
    if rendered.returncode != 0:
        raise DeviceClassesError(f"helm template {DEVICE_CLASSES_TEMPLATE} failed: {rendered.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


async def install_device_classes(client: AsyncClient, *, work_dir: Path) -> list[str]:
    """Create the chart's DeviceClasses (one that exists already is left as it is); their names."""
    names = []
    for doc in device_classes(work_dir=work_dir):
        try:
            with api_errors():
                await client.create(DeviceClass.from_dict(doc))
        except Conflict:
            pass
        names.append(str(doc["metadata"]["name"]))
    return names
