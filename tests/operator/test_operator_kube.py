"""The operator against a real API server: configs become DaemonSets, cluster state becomes conditions.

No controllers run on the test control plane, so the tests play the DaemonSet controller (they write the
DaemonSet's status numbers through its status subresource) and the node agents (they write the Nodes'
``gpu-fractioning.nvidia.com/Ready`` condition and driver label), then read what a user reads: the
DaemonSet and the config's status.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest
from gfc_harness import eventually, running
from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.core_v1 import Namespace, Node
from lightkube.types import PatchType

from gpufrac.contract.keys import DRIVER_MAJOR_LABEL, NODE_READY_CONDITION
from gpufrac.local.controlplane import ControlPlane
from gpufrac.operator.resource import GpuFractioningConfig

pytestmark = pytest.mark.usefixtures("crd")

MakeConfig = Callable[[str, dict[str, Any]], Awaitable[Any]]
MakeNode = Callable[[str, dict[str, str]], Awaitable[Node]]


def agent(tag: str, **more: Any) -> dict[str, Any]:
    return {"image": "registry.example/gpufrac:1.0", "nodeSelector": {"test.gpufrac.io/pool": tag}, **more}


async def get_ds(client: AsyncClient, namespace: str, config: str) -> DaemonSet | None:
    try:
        return await client.get(DaemonSet, f"gpufrac-node-agent-{config}", namespace=namespace)
    except ApiError as error:
        if error.status.code == 404:
            return None
        raise


def args_of(ds: DaemonSet) -> list[str]:
    return list(ds.spec.template.spec.containers[0].args or [])


async def conditions(client: AsyncClient, name: str) -> dict[str, dict[str, Any]]:
    obj = await client.get(GpuFractioningConfig, name)
    return {c["type"]: c for c in (obj.status or {}).get("conditions") or []}


async def play_daemonset_controller(client: AsyncClient, ds: DaemonSet, *, desired: int, ready: int) -> None:
    status = {
        "observedGeneration": ds.metadata.generation,
        "desiredNumberScheduled": desired,
        "currentNumberScheduled": desired,
        "updatedNumberScheduled": desired,
        "numberReady": ready,
        "numberAvailable": ready,
        "numberMisscheduled": 0,
    }
    await client.patch(
        DaemonSet.Status,
        ds.metadata.name,
        {"status": status},
        namespace=ds.metadata.namespace,
        patch_type=PatchType.MERGE,
    )


async def play_node_agent(client: AsyncClient, node: str, *, status: str, reason: str) -> None:
    condition = {
        "type": NODE_READY_CONDITION,
        "status": status,
        "reason": reason,
        "message": "set by the test",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    await client.patch(Node.Status, node, {"status": {"conditions": [condition]}})


async def test_a_config_becomes_its_owned_daemonset_and_spec_changes_roll_out(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig
) -> None:
    name = f"roll-{tag}"
    config = await make_config(name, {"namespace": namespace, "nodeAgent": agent(tag, logLevel="info")})
    async with running(akube):
        ds = await eventually(lambda: get_ds(akube, namespace, name), what="the DaemonSet")
        (owner,) = ds.metadata.ownerReferences
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "GpuFractioningConfig",
            name,
            config.metadata.uid,
            True,
        )
        container = ds.spec.template.spec.containers[0]
        assert container.image == "registry.example/gpufrac:1.0"
        assert "--log-level=info" in args_of(ds) and "--no-mps" in args_of(ds)
        assert ds.spec.template.spec.nodeSelector == {"test.gpufrac.io/pool": tag}

        await akube.patch(
            GpuFractioningConfig,
            name,
            {"spec": {"nodeAgent": {"image": "registry.example/gpufrac:1.1", "mps": {"enabled": True}}}},
            patch_type=PatchType.MERGE,
        )

        async def updated() -> DaemonSet | None:
            got = await get_ds(akube, namespace, name)
            return got if got and got.spec.template.spec.containers[0].image.endswith(":1.1") else None

        ds2 = await eventually(updated, what="the new image on the DaemonSet")
        assert "--mps" in args_of(ds2)
        assert ds2.metadata.generation > ds.metadata.generation

        # A hand edit of a rendered field is undone.
        await akube.patch(
            DaemonSet,
            ds2.metadata.name,
            {"spec": {"template": {"spec": {"containers": [{"name": "node-agent", "image": "hand/edit"}]}}}},
            namespace=namespace,
        )

        async def restored() -> bool:
            got = await get_ds(akube, namespace, name)
            image = got.spec.template.spec.containers[0].image if got else ""
            return bool(got and image.endswith(":1.1") and got.metadata.generation > ds2.metadata.generation)

        await eventually(restored, what="the hand edit undone")

        # Deleted by hand: the operator puts it back.
        await akube.delete(DaemonSet, ds2.metadata.name, namespace=namespace)

        async def recreated() -> DaemonSet | None:
            got = await get_ds(akube, namespace, name)
            return got if got and got.metadata.uid != ds2.metadata.uid else None

        await eventually(recreated, what="the DaemonSet recreated")


async def test_status_follows_the_daemonset_and_what_the_nodes_report(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig, make_node: MakeNode
) -> None:
    name = f"status-{tag}"
    pool = {"test.gpufrac.io/pool": tag}
    await make_node(f"new-{tag}", {**pool, DRIVER_MAJOR_LABEL: "615"})
    await make_node(f"old-{tag}", {**pool, DRIVER_MAJOR_LABEL: "550"})
    await make_node(f"elsewhere-{tag}", {DRIVER_MAJOR_LABEL: "400"})  # not selected: never counted
    await make_config(name, {"namespace": namespace, "minDriverMajor": 615, "nodeAgent": agent(tag)})

    async with running(akube):
        ds = await eventually(lambda: get_ds(akube, namespace, name), what="the DaemonSet")

        async def has(kind: str, status: str, reason: str) -> dict[str, Any] | None:
            got = (await conditions(akube, name)).get(kind)
            return got if got and (got["status"], got["reason"]) == (status, reason) else None

        # No agent ready yet: rolling out, not ready; the old driver is already reported.
        await eventually(lambda: has("Ready", "False", "AgentsNotReady"), what="Ready=False AgentsNotReady")
        await eventually(lambda: has("Degraded", "True", "NodesBelowMinDriver"), what="Degraded")
        obj = await akube.get(GpuFractioningConfig, name)
        assert obj.status["nodesBelowMinDriver"] == 1
        assert obj.status["observedGeneration"] == obj.metadata.generation

        await play_daemonset_controller(akube, ds, desired=2, ready=2)
        await eventually(lambda: has("Progressing", "False", "RolloutComplete"), what="rollout complete")
        ready = await eventually(lambda: has("Ready", "False", "NodesNotReady"), what="nodes not reporting")
        assert "2 nodes not reporting yet" in ready["message"]

        await play_node_agent(akube, f"new-{tag}", status="True", reason="GpuFractioningReady")
        await play_node_agent(akube, f"old-{tag}", status="True", reason="GpuFractioningReady")
        await eventually(lambda: has("Ready", "True", "AllNodesReady"), what="Ready=True")
        obj = await akube.get(GpuFractioningConfig, name)
        assert (obj.status["desiredNodes"], obj.status["readyNodes"]) == (2, 2)
        degraded = (await conditions(akube, name))["Degraded"]
        assert f"old-{tag}" in degraded["message"] and f"new-{tag}" not in degraded["message"]
        # Settled: nothing changes, so nothing is written (no status churn, no DaemonSet re-apply).
        await asyncio.sleep(1.0)
        again = await akube.get(GpuFractioningConfig, name)
        assert again.metadata.resourceVersion == obj.metadata.resourceVersion
        assert (await get_ds(akube, namespace, name)).metadata.generation == ds.metadata.generation

        await play_node_agent(akube, f"old-{tag}", status="False", reason="NoEnforceableComputeMode")
        ready = await eventually(lambda: has("Ready", "False", "NodesNotReady"), what="a node not ready")
        assert f"old-{tag}" in ready["message"]
        degraded = (await conditions(akube, name))["Degraded"]
        assert "1 NoEnforceableComputeMode" in degraded["message"]

        # An agent falls over: the DaemonSet's numbers say so.
        await play_daemonset_controller(akube, ds, desired=2, ready=1)
        ready = await eventually(lambda: has("Ready", "False", "AgentsNotReady"), what="agents not ready")
        assert "1/2 agents ready" in ready["message"]


async def test_deleting_the_config_deletes_its_daemonset(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig
) -> None:
    name = f"gone-{tag}"
    await make_config(name, {"namespace": namespace, "nodeAgent": agent(tag)})
    async with running(akube):
        await eventually(lambda: get_ds(akube, namespace, name), what="the DaemonSet")
        await akube.delete(GpuFractioningConfig, name)

        async def deleted() -> bool:
            return await get_ds(akube, namespace, name) is None

        await eventually(deleted, what="the DaemonSet deleted with its config")


async def test_moving_the_config_to_another_namespace_moves_the_daemonset(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig
) -> None:
    name = f"move-{tag}"
    other = f"{namespace[:50]}-b"
    await akube.create(Namespace(metadata=ObjectMeta(name=other)))
    try:
        await make_config(name, {"namespace": namespace, "nodeAgent": agent(tag)})
        async with running(akube):
            await eventually(lambda: get_ds(akube, namespace, name), what="the first DaemonSet")
            await akube.patch(
                GpuFractioningConfig, name, {"spec": {"namespace": other}}, patch_type=PatchType.MERGE
            )
            await eventually(lambda: get_ds(akube, other, name), what="the DaemonSet in the new namespace")

            async def old_gone() -> bool:
                return await get_ds(akube, namespace, name) is None

            await eventually(old_gone, what="the old DaemonSet deleted")
    finally:
        await akube.delete(Namespace, other)


async def test_a_missing_namespace_is_reported_and_retried_until_it_exists(
    akube: AsyncClient, tag: str, make_config: MakeConfig
) -> None:
    name = f"nons-{tag}"
    await make_config(name, {"namespace": f"absent-{tag}", "nodeAgent": agent(tag)})
    async with running(akube):

        async def degraded() -> dict[str, Any] | None:
            got = (await conditions(akube, name)).get("Degraded")
            return got if got and got["reason"] == "DaemonSetApplyFailed" else None

        got = await eventually(degraded, what="Degraded=True DaemonSetApplyFailed")
        assert got["status"] == "True"
        assert f"absent-{tag}" in got["message"]

        # Once someone creates the namespace, the retry puts the DaemonSet there.
        await akube.create(Namespace(metadata=ObjectMeta(name=f"absent-{tag}")))
        try:
            await eventually(lambda: get_ds(akube, f"absent-{tag}", name), what="the DaemonSet after the fix")

            async def recovered() -> bool:
                got = (await conditions(akube, name)).get("Degraded")
                return bool(got and got["status"] == "False")

            await eventually(recovered, what="Degraded=False")
        finally:
            await akube.delete(Namespace, f"absent-{tag}")


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"nodeAgent": {"image": "i", "metricsPort": -1}}, "metricsPort"),
        ({"nodeAgent": {"image": "i", "healthPort": 70000}}, "healthPort"),
        ({"nodeAgent": {}}, "image"),
        ({}, "nodeAgent"),
        ({"nodeAgent": {"image": "i", "imagePullPolicy": "Sometimes"}}, "imagePullPolicy"),
        ({"nodeAgent": {"image": "i"}, "minDriverMajor": -5}, "minDriverMajor"),
        ({"nodeAgent": {"image": "i"}, "namespace": "Not_A_Namespace"}, "namespace"),
    ],
)
async def test_an_invalid_spec_is_refused_by_the_schema(
    akube: AsyncClient, crd: None, tag: str, spec: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(ApiError) as refused:
        await akube.create(GpuFractioningConfig(metadata=ObjectMeta(name=f"bad-{tag}"), spec=spec))
    assert refused.value.status.code == 422
    assert complaint in (refused.value.status.message or "")


async def test_a_name_too_long_for_the_daemonset_is_refused(akube: AsyncClient, crd: None) -> None:
    with pytest.raises(ApiError) as refused:
        await akube.create(
            GpuFractioningConfig(metadata=ObjectMeta(name="x" * 45), spec={"nodeAgent": {"image": "i"}})
        )
    assert "44 characters" in (refused.value.status.message or "")


async def test_the_schema_fills_in_the_agents_defaults(
    akube: AsyncClient, tag: str, make_config: MakeConfig
) -> None:
    created = await make_config(f"defaults-{tag}", {"nodeAgent": {"image": "i"}})
    assert created.spec["namespace"] == "gpufrac-system"
    assert created.spec["nodeAgent"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert created.spec["nodeAgent"]["metricsPort"] == 9400
    assert created.spec["nodeAgent"]["nriSocket"] == "/var/run/nri/nri.sock"


async def test_only_the_lease_holder_writes_and_a_standby_takes_over(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig
) -> None:
    name = f"lease-{tag}"
    await make_config(name, {"namespace": namespace, "nodeAgent": agent(tag)})
    async with running(akube, leader_elect=True, lease_namespace=namespace, identity="a") as first:
        await eventually(lambda: _true(first.operator.reconciling), what="the first replica leading")
        await eventually(lambda: get_ds(akube, namespace, name), what="the DaemonSet")
        async with running(akube, leader_elect=True, lease_namespace=namespace, identity="b") as second:
            await eventually(lambda: _true(second.operator.synced), what="the standby synced")
            await asyncio.sleep(0.5)
            assert not second.operator.reconciling
            async with httpx2.AsyncClient() as http:  # the probes answer on this loop: no blocking call
                ready = await http.get(f"http://127.0.0.1:{second.operator.probe_port}/readyz")
            assert ready.status_code == 200 and "standby" in ready.text
            await first.stop()
            await eventually(
                lambda: _true(second.operator.reconciling), what="the standby taking over", timeout=10
            )
            await akube.patch(
                GpuFractioningConfig,
                name,
                {"spec": {"nodeAgent": {"logLevel": "debug"}}},
                patch_type=PatchType.MERGE,
            )

            async def debug() -> bool:
                got = await get_ds(akube, namespace, name)
                return bool(got and "--log-level=debug" in args_of(got))

            await eventually(debug, what="the new leader applying the change")


async def _true(value: bool) -> bool:
    return value


def test_the_operator_process_serves_probes_and_exits_0_on_sigterm(
    controlplane: ControlPlane, crd: None
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KUBECONFIG": str(controlplane.kubeconfig)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufrac", "operator", "--no-leader-elect", f"--http-port={port}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        answer = None
        while time.monotonic() < deadline:
            try:
                answer = httpx2.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0)
                if answer.status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            time.sleep(0.1)
        assert answer is not None and answer.status_code == 200, answer
        metrics = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=1.0).text
        assert "gpufrac_operator_is_leader 1.0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        _, err = proc.communicate(timeout=5)
        assert b'"msg": "signal received, stopping operator"' in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
