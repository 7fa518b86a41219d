"""The real node with a MIG GPU: a pod bound to a MIG slice runs in runc with exactly that slice as its CDI
device, and nothing of a fraction.

One embedded cluster with ``runtime="containerd"`` (``gpufrac.local.realnode``). The node agent's GPUs
are SIMULATED (GPU 7 in MIG mode), and so is the CDI spec containerd resolves devices from: a device per
MIG UUID the simulated inventory can give (``simulated_cdi_spec``), setting one variable that shows from
inside the container which device containerd injected. The slices are made the way the scheduler asks
for them, through ``gpufrac.io/gpu-layout`` on the Node. Needs root and cgroups; skips only when
``missing_requirements`` names what is missing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from lightkube.models.core_v1 import Container, EnvVar, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.admission.review import DEFAULT_SCHEDULER_USER
from gpufrac.contract import keys
from gpufrac.kube.binding import bind_pod
from gpufrac.kube.patch import merge_patch
from gpufrac.local import ociimage
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.realnode import (
    SIMULATED_CDI_ENV_PREFIX,
    SIMULATED_CDI_MIG_ENV_PREFIX,
    SLEEP_COMMAND,
    missing_requirements,
    process_environ,
)
from gpufrac.local.simnodes import NodeShape, gpu_uuid
from gpufrac.node.inject import ENFORCEMENT_ENV, NVIDIA_VISIBLE_DEVICES

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

NODE = "real-mig-000"
LAYOUT = ["3g.40gb@0", "1g.10gb@6"]


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    shape = ClusterShape(
        nodes=1, prefix="real-mig-", node=NodeShape(gpus=8, model="H100-80GB"), runtime="containerd"
    )
    async with LocalCluster(shape=shape) as local:
        assert local.real_node is not None
        # GPU 7 in MIG mode (no slices yet): the agent again, with that inventory (the last flag counts).
        await local.real_node.stop_agent()
        await local.real_node.start_agent(extra_args=["--sim-gpus=7xH100-80GB,1xH100-80GB:mig"])
        yield local


async def _slices(cluster: LocalCluster, gpu: str, *, timeout_s: float = 60) -> dict[str, str]:
    """The slices the agent publishes for ``gpu`` once the layout is applied: ``<profile>@<start>`` ->
    MIG UUID."""
    assert cluster.client is not None
    deadline = time.monotonic() + timeout_s
    while True:
        node = await cluster.client.get(Node, NODE)
        annotations = (node.metadata.annotations if node.metadata else None) or {}
        status = json.loads(annotations.get(keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION) or "{}")
        if status.get("generation") == 1 and status["gpus"].get(gpu, {}).get("state") == "Applied":
            published = {g["uuid"]: g for g in json.loads(annotations[keys.NODE_GPUS_ANNOTATION])}
            return {f"{s['profile']}@{s['start']}": s["uuid"] for s in published[gpu].get("mig", [])}
        if time.monotonic() > deadline:
            raise AssertionError(f"layout not applied within {timeout_s:.0f}s: {status}")
        await asyncio.sleep(0.2)


async def _running_pid(cluster: LocalCluster, name: str, *, timeout_s: float = 90) -> int:
    assert cluster.client is not None and cluster.real_node is not None
    deadline = time.monotonic() + timeout_s
    while True:
        pod = await cluster.client.get(Pod, name, namespace="default")
        statuses = (pod.status.containerStatuses or []) if pod.status else []
        if statuses and statuses[0].state is not None and statuses[0].state.running is not None:
            assert statuses[0].containerID
            return cluster.real_node.container_pid(statuses[0].containerID)
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} did not run within {timeout_s:.0f}s: {pod.status}")
        await asyncio.sleep(0.2)


def _pod(name: str, *, env: dict[str, str]) -> Pod:
    """A sleeper asking for a 1g.10gb slice, with ``env`` in its manifest; nobody schedules it (the test
    binds it as the scheduler would)."""
    app = Container(
        name="app",
        image=ociimage.WORKLOAD.ref,
        imagePullPolicy="Never",
        command=list(SLEEP_COMMAND),
        env=[EnvVar(name=k, value=v) for k, v in env.items()],
    )
    return Pod(
        metadata=ObjectMeta(name=name, annotations={keys.mig_key("app", keys.MIG_PROFILE): "1g.10gb"}),
        spec=PodSpec(
            containers=[app],
            hostNetwork=True,
            automountServiceAccountToken=False,
            terminationGracePeriodSeconds=1,
            schedulerName="kai-scheduler",
        ),
    )


async def _bind(cluster: LocalCluster, scheduler, pod: Pod, device: str) -> None:  # type: ignore[no-untyped-def]
    assert cluster.client is not None and pod.metadata is not None
    created = await cluster.client.create(pod, namespace="default")
    assert created.metadata is not None
    await bind_pod(
        scheduler,
        name=pod.metadata.name,
        namespace="default",
        node=NODE,
        uid=created.metadata.uid,
        annotations={keys.devices_key("app"): device},
    )


async def _waiting_message(cluster: LocalCluster, name: str, *, saying: str, timeout_s: float = 90) -> str:
    """The create error of pod ``name`` once it says ``saying``. An earlier one may differ: the agent's
    view of its slices (NRI's device check) follows the inventory it re-reads every publish interval,
    which can be after the layout says Applied; the kubelet retries the create."""
    assert cluster.client is not None
    deadline = time.monotonic() + timeout_s
    while True:
        pod = await cluster.client.get(Pod, name, namespace="default")
        statuses = (pod.status.containerStatuses or []) if pod.status else []
        waiting = statuses[0].state.waiting if statuses and statuses[0].state is not None else None
        if (
            waiting is not None
            and waiting.reason == "CreateContainerError"
            and saying in (waiting.message or "")
        ):
            return waiting.message or ""
        if time.monotonic() > deadline:
            raise AssertionError(
                f"pod {name} was not refused ({saying}) within {timeout_s:.0f}s: {pod.status}"
            )
        await asyncio.sleep(0.2)


async def test_a_pod_bound_to_a_mig_slice_gets_exactly_that_slice_as_its_cdi_device_and_nothing_else(
    cluster: LocalCluster,
) -> None:
    assert cluster.client is not None
    gpu = gpu_uuid(NODE, 7)
    scheduler = cluster.controlplane.async_client(impersonate=DEFAULT_SCHEDULER_USER)
    try:
        layout = {"generation": 1, "gpus": {gpu: {"mode": "mig", "slices": LAYOUT}}}
        await merge_patch(
            scheduler,
            Node,
            name=NODE,
            patch={"metadata": {"annotations": {keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(layout)}}},
        )
        slices = await _slices(cluster, gpu)
        small, large = slices["1g.10gb@6"], slices["3g.40gb@0"]
        # A user who writes the device variable gets it replaced by the slice.
        await _bind(cluster, scheduler, _pod("isolated", env={NVIDIA_VISIBLE_DEVICES: "all"}), small)
        # One who writes a fraction's variable is refused: NRI could not remove it from the container.
        await _bind(cluster, scheduler, _pod("planted", env={"NVIDIA_GPU_MEMORY_LIMIT": "81559"}), large)
    finally:
        await scheduler.close()

    environ = process_environ(await _running_pid(cluster, "isolated"))
    prefixes = (SIMULATED_CDI_ENV_PREFIX, SIMULATED_CDI_MIG_ENV_PREFIX)
    injected = {k: v for k, v in environ.items() if k.startswith(prefixes)}
    assert injected == {f"{SIMULATED_CDI_MIG_ENV_PREFIX}7_6_1g_10gb": small}  # that slice: no GPU, no other
    assert {k: v for k, v in environ.items() if k in ENFORCEMENT_ENV} == {NVIDIA_VISIBLE_DEVICES: small}

    refused = await _waiting_message(cluster, "planted", saying="sets NVIDIA_GPU_MEMORY_LIMIT='81559'")
    assert "which its GPU assignment does not set and the runtime cannot remove" in refused
    for name in ("isolated", "planted"):
        await cluster.client.delete(Pod, name, namespace="default", grace_period=0)
