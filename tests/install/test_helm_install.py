"""The real install: `helm install` of deploy/helm/gpufrac, with the image built from our Dockerfile, on a
cluster with a real node, then `helm upgrade` and `helm uninstall` -- what docs/deploy.md promises.

The cluster is ``LocalCluster(..., with_gpufrac=False)``: the API server, kube-controller-manager,
kube-scheduler and one real node (containerd with NRI, runc, a kubelet), none of gpufrac's processes.
The image is ``testenv/image/build.sh``'s (buildah, no registry; a no-op when up to date), imported
into the node's containerd; the chart runs it with ``imagePullPolicy: Never``. The GPUs are SIMULATED:
the GpuFractioningConfig's ``nodeAgent.simulatedGpus`` makes the installed node agent report the node's
simulated GPUs (this machine has none), and the node's containerd has a simulated CDI spec for them.

Values that only this one-node test cluster needs, not chart fixes: one replica of each component (two
CPUs), tolerations of the managed taint for the control-plane components (the only node is the GPU
node, which the agent taints), and the node's NRI and CRI sockets, which live in the cluster's work
directory.

Needs root and cgroups; where the machine has them the test must run (CI here has both), so it skips
only when ``missing_requirements`` names what is missing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube.models.core_v1 import Container, EnvVar, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.core_v1 import Namespace, Node, Pod

import gpufrac
from gpufrac.contract import keys
from gpufrac.local import ociimage
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.realnode import SLEEP_COMMAND, missing_requirements, process_environ
from gpufrac.local.simnodes import NodeShape
from gpufrac.node.inject import ENFORCEMENT_ENV, NVIDIA_GPU_MEMORY_LIMIT, plan_container
from gpufrac.operator.render import daemonset_name
from gpufrac.operator.resource import CRD_NAME

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpufrac"
HELM = ROOT / "testenv" / "bin" / "helm"
IMAGE_BUILD = ROOT / "testenv" / "image" / "build.sh"
IMAGE_ARCHIVE = ROOT / "testenv" / "bin" / "images" / "gpufrac.oci.tar"
IMAGE_REPOSITORY = "gpufrac.local/gpufrac"
RELEASE = "gpufrac"
NAMESPACE = "gpufrac-system"
NODE = "install-gpu-000"
FRACTION = {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5"}
USER_LIMIT = "999999"


def _values(cluster: LocalCluster) -> dict[str, Any]:
    """The chart's values for this cluster (the module docstring says why each departs from the defaults)."""
    node = cluster.real_node
    assert node is not None
    shape = cluster.shape.node
    tolerate = [keys.managed_toleration()]
    return {
        "image": {"repository": IMAGE_REPOSITORY, "tag": gpufrac.__version__, "pullPolicy": "Never"},
        "scheduler": {"replicas": 1, "tolerations": tolerate},
        "admission": {"replicas": 1, "tolerations": tolerate},
        "operator": {
            "replicas": 1,
            "tolerations": tolerate,
            "config": {
                "spec": {
                    "nodeAgent": {
                        "simulatedGpus": f"{shape.gpus}x{shape.model}:{shape.mib}",
                        "nriSocket": str(node.nri_socket),
                        "criSocket": str(node.containerd_socket),
                    }
                }
            },
        },
    }


def _helm(cluster: LocalCluster, *args: str | Path, timeout_s: float = 240) -> str:
    home = cluster.work_dir / "helm"
    done = subprocess.run(
        [str(HELM), *map(str, args), "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={
            "HOME": str(home),
            "PATH": "/usr/bin:/bin",
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        },
    )
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


async def _until(what: str, check: Callable[[], Awaitable[Any]], *, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: build it with `make testenv`", pytrace=False)
    built = subprocess.run(["bash", str(IMAGE_BUILD)], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, f"{IMAGE_BUILD} failed:\n{built.stdout}\n{built.stderr}"
    shape = ClusterShape(
        nodes=1, prefix="install-gpu-", node=NodeShape(gpus=4, model="H100-80GB"), runtime="containerd"
    )
    assert shape.node_names == [NODE]
    async with LocalCluster(shape=shape, with_gpufrac=False) as local:
        assert local.real_node is not None
        await local.real_node.import_image(IMAGE_ARCHIVE)
        yield local


def _fractional_pod(name: str) -> Pod:
    app = Container(
        name="app",
        image=ociimage.WORKLOAD.ref,
        imagePullPolicy="Never",
        command=list(SLEEP_COMMAND),
        env=[EnvVar(name=NVIDIA_GPU_MEMORY_LIMIT, value=USER_LIMIT)],
    )
    spec = PodSpec(
        containers=[app],
        schedulerName=keys.DEFAULT_SCHEDULER_NAME,
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=1,
    )
    return Pod(metadata=ObjectMeta(name=name, annotations=dict(FRACTION)), spec=spec)


def _running(pod: Pod) -> bool:
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    return bool(statuses) and all(s.state is not None and s.state.running is not None for s in statuses)


def _ready(pod: Pod) -> bool:
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


async def _fraction_runs_with_its_plan(cluster: LocalCluster, name: str) -> Pod:
    """Create a fractional pod; it runs on the node, placed by our scheduler, with the plan in its process."""
    assert cluster.client is not None and cluster.real_node is not None
    client, node = cluster.client, cluster.real_node
    await client.create(_fractional_pod(name), namespace="default")

    async def running() -> Pod | None:
        pod = await client.get(Pod, name, namespace="default")
        return pod if _running(pod) else None

    pod = await _until(f"fractional pod {name} runs", running)
    assert pod.spec is not None and pod.spec.nodeName == NODE and pod.metadata is not None
    annotations = pod.metadata.annotations or {}
    # Placed by the installed scheduler: only it (the webhook allows no one else) writes the devices.
    assert annotations.get(keys.devices_key("app")), annotations
    assert pod.status is not None and pod.status.containerStatuses
    environ = process_environ(node.container_pid(pod.status.containerStatuses[0].containerID or ""))
    plan, _ = plan_container(annotations=annotations, container="app", pipe_source="")
    assert plan is not None
    assert {k: environ.get(k) for k in ENFORCEMENT_ENV} == {k: plan.env_map.get(k) for k in ENFORCEMENT_ENV}
    assert environ[NVIDIA_GPU_MEMORY_LIMIT] != USER_LIMIT
    return pod


async def _namespace_pods(cluster: LocalCluster) -> list[Pod]:
    assert cluster.client is not None
    return [p async for p in cluster.client.list(Pod, namespace=NAMESPACE)]


async def _rolled_out(cluster: LocalCluster) -> bool:
    """The release's Deployments and the agent's DaemonSet: every replica updated and ready, no old one."""
    assert cluster.client is not None
    for deployment in [d async for d in cluster.client.list(Deployment, namespace=NAMESPACE)]:
        status, spec = deployment.status, deployment.spec
        if (
            status is None
            or spec is None
            or (deployment.metadata.generation or 0) > (status.observedGeneration or 0)
        ):
            return False
        want = spec.replicas or 0
        if (status.updatedReplicas, status.readyReplicas, status.replicas) != (want, want, want):
            return False
    for ds in [d async for d in cluster.client.list(DaemonSet, namespace=NAMESPACE)]:
        status = ds.status
        if status is None or (ds.metadata.generation or 0) > (status.observedGeneration or 0):
            return False
        if not (status.desiredNumberScheduled == status.updatedNumberScheduled == status.numberReady == 1):
            return False
    return True


async def _agent_published(cluster: LocalCluster) -> bool:
    assert cluster.client is not None
    node = await cluster.client.get(Node, NODE)
    conditions = {c.type: c.status for c in (node.status.conditions or [])} if node.status else {}
    published = json.loads((node.metadata.annotations or {}).get(keys.NODE_GPUS_ANNOTATION) or "null")
    return bool(published) and conditions.get(keys.NODE_READY_CONDITION) == "True"


async def test_helm_install_upgrade_and_uninstall_on_a_real_node(cluster: LocalCluster) -> None:
    assert cluster.client is not None and cluster.real_node is not None
    client = cluster.client
    values = cluster.work_dir / "values.yaml"
    values.write_text(yaml.safe_dump(_values(cluster)))

    # -- install: the scheduler, the webhook and the operator Ready; the operator's DaemonSet runs the
    # agent on the node, connected to containerd's NRI socket, and the node's GPUs published.
    _helm(cluster, "install", RELEASE, CHART, "-n", NAMESPACE, "--create-namespace", "-f", values, "--wait")
    ds_name = daemonset_name("default")
    await _until("the operator renders the node agent's DaemonSet", lambda: _has_daemonset(cluster, ds_name))
    await _until("everything rolled out", lambda: _rolled_out(cluster), timeout_s=180)
    await _until("the installed agent publishes the node's GPUs", lambda: _agent_published(cluster))
    pods = await _namespace_pods(cluster)
    assert pods and all(_ready(p) for p in pods), [p.metadata.name for p in pods if not _ready(p)]
    assert all(p.spec is not None and p.spec.nodeName == NODE for p in pods)

    # -- a fractional pod through the installed system: webhook, our scheduler, the agent in containerd.
    first = await _fraction_runs_with_its_plan(cluster, "installed-fraction")

    # -- upgrade: a changed value rolls the components' pods and (through the operator) the agent's.
    before = {p.metadata.name for p in pods if p.metadata is not None}
    _helm(
        cluster,
        "upgrade", RELEASE, CHART, "-n", NAMESPACE, "-f", values, "--wait",
        "--set", "scheduler.logLevel=debug",
        "--set", "operator.config.spec.nodeAgent.logLevel=debug",
    )  # fmt: skip
    await _until("the upgrade rolled out", lambda: _rolled_out(cluster), timeout_s=180)

    async def all_replaced() -> bool:
        now = await _namespace_pods(cluster)
        names = {p.metadata.name for p in now if p.metadata is not None}
        rolled = {n for n in before if n.startswith(("gpufrac-scheduler", ds_name))}
        return not (names & rolled) and all(_ready(p) for p in now)

    await _until("the scheduler's and the agent's pods replaced", all_replaced, timeout_s=180)
    await _until("the upgraded agent publishes the node's GPUs", lambda: _agent_published(cluster))
    # Nothing broken: the running pod was not touched, and a new one goes through the upgraded system.
    kept = await client.get(Pod, "installed-fraction", namespace="default")
    assert _running(kept) and kept.status is not None and kept.status.containerStatuses
    assert first.status is not None and first.status.containerStatuses
    assert kept.status.containerStatuses[0].containerID == first.status.containerStatuses[0].containerID
    await _fraction_runs_with_its_plan(cluster, "upgraded-fraction")

    # -- uninstall: every pod of the release and the agent's DaemonSet go; what stays is what
    # docs/deploy.md lists ("Uninstalling").
    _helm(cluster, "uninstall", RELEASE, "-n", NAMESPACE, "--wait")

    async def release_gone() -> bool:
        return not await _namespace_pods(cluster) and not [
            d async for d in client.list(DaemonSet, namespace=NAMESPACE)
        ]

    await _until("the release's pods and the agent's DaemonSet gone", release_gone)
    webhooks = [w.metadata.name async for w in client.list(MutatingWebhookConfiguration)]
    webhooks += [w.metadata.name async for w in client.list(ValidatingWebhookConfiguration)]
    assert [w for w in webhooks if "gpufrac" in (w or "")] == []
    # Documented as left behind: the CRD (Helm never deletes crds/), the namespace (--create-namespace).
    assert (await client.get(CustomResourceDefinition, CRD_NAME)).metadata is not None
    assert (await client.get(Namespace, NAMESPACE)).metadata is not None
    node = await client.get(Node, NODE)
    left = _gpufrac_marks(node)
    assert left == EXPECTED_NODE_LEFTOVERS, left
    # The user's pods keep running (their limits were set at creation), untouched.
    for name in ("installed-fraction", "upgraded-fraction"):
        assert _running(await client.get(Pod, name, namespace="default")), name


#: What the node keeps after `helm uninstall` (docs/deploy.md, "Uninstalling"), as the real install
#: showed it: the agent's labels, inventory annotation, taint and condition (its status is whatever the
#: agent last managed to write: Helm deletes its RBAC while it stops).
EXPECTED_NODE_LEFTOVERS: dict[str, Any] = {
    "labels": sorted(
        [
            "gpufrac.io/compute-mode.sm-sharing",
            "gpufrac.io/compute-mode.time-slicing",
            "gpufrac.io/cuda-driver",
            "gpufrac.io/gpu-count",
            "gpufrac.io/gpu-model",
            keys.GPU_STACK_GATE_LABEL,
            keys.MANAGED_LABEL,
            "gpufrac.io/mps",
        ]
    ),
    "annotations": [keys.NODE_GPUS_ANNOTATION],
    "taints": [keys.MANAGED_TAINT_KEY],
    "conditions": [keys.NODE_READY_CONDITION],
}


def _gpufrac_marks(node: Node) -> dict[str, Any]:
    """gpufrac's labels, annotations, taints and conditions on ``node``."""
    meta = node.metadata
    assert meta is not None
    mine = ("gpufrac.io", keys.MANAGED_LABEL.split("/")[0])
    return {
        "labels": sorted(k for k in (meta.labels or {}) if k.startswith(mine)),
        "annotations": sorted(k for k in (meta.annotations or {}) if k.startswith(mine)),
        "taints": sorted(
            t.key for t in ((node.spec.taints or []) if node.spec else []) if t.key.startswith(mine)
        ),
        "conditions": sorted(
            c.type
            for c in ((node.status.conditions or []) if node.status else [])
            if c.type == keys.NODE_READY_CONDITION
        ),
    }


async def _has_daemonset(cluster: LocalCluster, name: str) -> bool:
    assert cluster.client is not None
    return bool(
        [d async for d in cluster.client.list(DaemonSet, namespace=NAMESPACE) if d.metadata.name == name]
    )
