"""``kubectl gpufrac explain POD`` against the real API server: the pod's queue, how it got there and
that queue's share, read from the Queue object (spec before any status; the status once written) and the
pod's Namespace, with the plugin run as a process (what ``kubectl gpufrac`` runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube import Client, codecs
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Namespace, Pod

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.scheduler.queues import CRD_NAME

QUEUE_CRD = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "gpufrac.io_queues.yaml"
QUEUES = "/apis/gpufrac.io/v1alpha1/queues"
#: What the kubectl-gpufrac console script runs.
PLUGIN = (sys.executable, "-m", "gpufrac.kubectl")


@pytest.fixture(scope="module")
def queue_crd(kube: Client) -> None:
    (crd,) = codecs.load_all_yaml(QUEUE_CRD.read_text())
    kube.apply(crd, field_manager="gpufrac-tests", force=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = kube.get(CustomResourceDefinition, CRD_NAME)
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            return
        time.sleep(0.1)
    pytest.fail(f"CRD {CRD_NAME} did not become Established")


@pytest.fixture
def vision(controlplane: ControlPlane, queue_crd: None) -> Iterator[str]:
    """A Queue with a spec and, so far, no status (no scheduler runs here)."""
    name = f"vision-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "gpufrac.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": name},
        "spec": {"resources": {"gpuMemory": {"deserved": 163840, "limit": 409600}}},
    }
    with controlplane.http() as http:
        answer = http.post(QUEUES, json=body)
        assert answer.status_code == 201, answer.text
    yield name
    with controlplane.http() as http:
        http.delete(f"{QUEUES}/{name}")


def _pod(kube: Client, namespace: str, labels: dict[str, str]) -> str:
    kube.create(
        Pod.from_dict(
            {
                "metadata": {"name": "train", "namespace": namespace, "labels": labels},
                "spec": {
                    "schedulerName": "gpufrac-nobody",  # stays Pending: no scheduler of that name runs
                    "containers": [{"name": "app", "image": "busybox"}],
                },
            }
        )
    )
    return "train"


def _explain(controlplane: ControlPlane, namespace: str, *args: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [*PLUGIN, "--kubeconfig", str(controlplane.kubeconfig), "explain", "train", "-n", namespace, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr


def test_explain_shows_the_labelled_queue_and_its_share_before_and_after_the_status(
    controlplane: ControlPlane, kube: Client, namespace: str, vision: str
) -> None:
    _pod(kube, namespace, {keys.QUEUE_LABEL: vision})
    code, out, err = _explain(controlplane, namespace)
    assert code == 0, err
    lines = out.splitlines()
    assert f"Queue:      {vision} (label gpufrac.io/queue)" in lines
    assert (
        "Share:      GPU memory deserved 163840 MiB, limit 409600 MiB; fair share and allocated not "
        "written yet (the scheduler writes the Queue's status)"
    ) in lines

    status = {"allocated": {"gpuMemory": 40960, "gpus": 0}, "fairShare": {"gpuMemory": 163840, "gpus": 0}}
    with controlplane.http() as http:
        answer = http.patch(
            f"{QUEUES}/{vision}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert answer.status_code == 200, answer.text
    code, out, err = _explain(controlplane, namespace)
    assert code == 0, err
    assert (
        "Share:      GPU memory deserved 163840 MiB, limit 409600 MiB, fair share 163840 MiB, "
        "allocated 40960 MiB"
    ) in out.splitlines()
    code, out, err = _explain(controlplane, namespace, "-o", "json")
    assert code == 0, err
    share = json.loads(out)["queue"]
    assert (share["queue"], share["how"], share["found"]) == (vision, "label", True)
    assert (share["deserved_mib"], share["fair_share_mib"], share["allocated_mib"]) == (163840, 163840, 40960)


def test_explain_follows_the_namespaces_default_queue_then_the_default_queue(
    controlplane: ControlPlane, kube: Client, namespace: str, vision: str
) -> None:
    _pod(kube, namespace, {})
    code, out, err = _explain(controlplane, namespace, "--default-queue", "nowhere")
    assert code == 0, err
    assert "Queue:      nowhere (the scheduler's default_queue)" in out.splitlines()
    assert "Share:      GPU memory no Queue object named nowhere" in out

    kube.patch(Namespace, namespace, {"metadata": {"labels": {keys.NAMESPACE_DEFAULT_QUEUE_LABEL: vision}}})
    code, out, err = _explain(controlplane, namespace, "--default-queue", "nowhere")
    assert code == 0, err
    assert (
        f"Queue:      {vision} (namespace {namespace}'s label gpufrac.io/default-queue)" in out.splitlines()
    )
    assert "GPU memory deserved 163840 MiB, limit 409600 MiB; fair share and allocated not written yet" in out
