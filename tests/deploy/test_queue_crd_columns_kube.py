"""``kubectl get queues.gpufrac.io`` as the real API server renders it from the chart's Queue CRD.

The columns are the CRD's ``additionalPrinterColumns``; the API server evaluates them and answers a
``Table`` when asked with ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` (what kubectl asks
for). A queue just created has a spec and no status (the scheduler writes status later, or never when no
scheduler runs): it must still show what it deserves and its limit, each column saying its unit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
import yaml
from helm_chart import CHART

from gpufrac.local.controlplane import ControlPlane

#: The CRD as `helm install` reads it (the chart's crds/, a link to deploy/crds/).
QUEUE_CRD = CHART / "crds" / "gpufrac.io_queues.yaml"
QUEUES = "/apis/gpufrac.io/v1alpha1/queues"
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}

#: The columns kubectl shows (priority 0) and those ``-o wide`` adds (priority 1), in order.
COLUMNS = ["Name", "Parent", "Deserved(MiB)", "Limit(MiB)", "Allocated(MiB)", "Fair-Share(MiB)"]
WIDE = ["Deserved(GPUs)", "Limit(GPUs)", "Allocated(GPUs)", "Fair-Share(GPUs)", "Used-Share"]


@pytest.fixture(scope="module")
def queue_crd(controlplane: ControlPlane) -> None:
    """The chart's Queue CRD, applied for real (server-side apply: idempotent) and Established."""
    name = yaml.safe_load(QUEUE_CRD.read_text())["metadata"]["name"]
    url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
    with controlplane.http() as http:
        answer = http.patch(
            url,
            content=QUEUE_CRD.read_bytes(),
            params={"fieldManager": "gpufrac-tests", "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        assert answer.status_code in (200, 201), answer.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conditions = (http.get(url).json().get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"CRD {name} not Established within 30 s")
        # A CRD's printer columns take a moment to be served after Established.
        (version,) = yaml.safe_load(QUEUE_CRD.read_text())["spec"]["versions"]
        applied = ["Name", *(c["name"] for c in version["additionalPrinterColumns"])]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = http.get(QUEUES, headers=TABLE)
            names = [c["name"] for c in answer.json().get("columnDefinitions") or []]
            if answer.status_code == 200 and names == applied:
                return
            time.sleep(0.2)
        raise AssertionError(f"the queue columns are not served within 30 s: {answer.text[:500]}")


@pytest.fixture
def queue(controlplane: ControlPlane, queue_crd: None) -> Iterator[str]:
    """A Queue with a spec and no status (no scheduler runs here); deleted afterwards."""
    name = f"vision-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "gpufrac.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": name},
        "spec": {
            "parentQueue": "research",
            "resources": {
                "gpuMemory": {"deserved": 163840, "limit": 409600},
                "gpus": {"deserved": 1, "limit": 4},
            },
        },
    }
    with controlplane.http() as http:
        answer = http.post(QUEUES, json=body)
        assert answer.status_code == 201, answer.text
        assert "status" not in answer.json()
    yield name
    with controlplane.http() as http:
        http.delete(f"{QUEUES}/{name}")


def _table(http: httpx2.Client, name: str) -> dict[str, Any]:
    answer = http.get(f"{QUEUES}/{name}", headers=TABLE)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_queue_without_status_shows_its_deserved_and_limit_with_their_unit(
    controlplane: ControlPlane, queue: str
) -> None:
    with controlplane.http() as http:
        table = _table(http, queue)
    definitions = table["columnDefinitions"]
    assert [c["name"] for c in definitions] == [*COLUMNS, *WIDE, "Age"]
    assert [c["name"] for c in definitions if c["priority"] == 0] == [*COLUMNS, "Age"]
    (row,) = table["rows"]
    cells = dict(zip([c["name"] for c in definitions], row["cells"], strict=True))
    assert cells["Name"] == queue and cells["Parent"] == "research"
    assert cells["Deserved(MiB)"] == 163840 and cells["Limit(MiB)"] == 409600
    assert cells["Deserved(GPUs)"] == 1 and cells["Limit(GPUs)"] == 4
    # No status yet: the scheduler's columns are empty, not zero.
    for column in ("Allocated(MiB)", "Fair-Share(MiB)", "Allocated(GPUs)", "Fair-Share(GPUs)"):
        assert cells[column] is None, (column, cells)


def test_the_status_columns_show_what_the_scheduler_wrote(controlplane: ControlPlane, queue: str) -> None:
    status = {
        "allocated": {"gpuMemory": 250000, "gpus": 1},
        "requested": {"gpuMemory": 300000, "gpus": 1},
        "deserved": {"gpuMemory": 163840, "gpus": 1},
        "fairShare": {"gpuMemory": 300000, "gpus": 2},
        "historicalUsage": {"gpuMemory": 0.417, "gpus": 0.25},
    }
    with controlplane.http() as http:
        answer = http.patch(
            f"{QUEUES}/{queue}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert answer.status_code == 200, answer.text
        table = _table(http, queue)
    names = [c["name"] for c in table["columnDefinitions"]]
    (row,) = table["rows"]
    cells = dict(zip(names, row["cells"], strict=True))
    assert [cells[c] for c in COLUMNS[2:] + WIDE] == [163840, 409600, 250000, 300000, 1, 4, 1, 2, 0.417]


def test_a_queue_without_resources_shows_empty_cells(controlplane: ControlPlane, queue_crd: None) -> None:
    """The CRD defaults deserved to 0 only inside an object it has: a spec without resources shows
    empty cells (kubectl prints <none>), not an error."""
    name = f"bare-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "gpufrac.io/v1alpha1", "kind": "Queue", "metadata": {"name": name}, "spec": {}}
    with controlplane.http() as http:
        assert http.post(QUEUES, json=body).status_code == 201
        try:
            table = _table(http, name)
        finally:
            http.delete(f"{QUEUES}/{name}")
    (row,) = table["rows"]
    assert row["cells"][1:6] == [None, None, None, None, None]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_get_queues_prints_the_deserved_before_any_status(
    controlplane: ControlPlane, queue: str
) -> None:
    """What a user sees: kubectl itself upper-cases the column names."""
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(controlplane.kubeconfig), "get", "queues.gpufrac.io", queue],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    cells = _columns(done.stdout)
    assert list(cells) == [
        "NAME",
        "PARENT",
        "DESERVED(MIB)",
        "LIMIT(MIB)",
        "ALLOCATED(MIB)",
        "FAIR-SHARE(MIB)",
        "AGE",
    ]
    assert list(cells.values())[:6] == [queue, "research", "163840", "409600", "", ""]  # no status: empty
    done = subprocess.run(
        [
            "kubectl",
            "--kubeconfig",
            str(controlplane.kubeconfig),
            "get",
            "queues.gpufrac.io",
            queue,
            "-o",
            "wide",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    cells = _columns(done.stdout)
    assert list(cells)[6:] == [
        "DESERVED(GPUS)",
        "LIMIT(GPUS)",
        "ALLOCATED(GPUS)",
        "FAIR-SHARE(GPUS)",
        "USED-SHARE",
        "AGE",
    ]
    assert cells["DESERVED(GPUS)"] == "1" and cells["LIMIT(GPUS)"] == "4"


def _columns(printed: str) -> dict[str, str]:
    """kubectl's one-row table by header: a cell starts where its header starts (an empty cell is blank)."""
    header, row = printed.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}
