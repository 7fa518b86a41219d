"""The kubelet plugin's gRPC surface, driven the way the kubelet drives it, with claims on a real API server.

The test plays the kubelet (registration, then prepare and unprepare over the plugin's socket) and
kube-scheduler (it writes the claim's allocation into its status, as the allocator does). The real
kubelet and scheduler path is what is left (docs/dra.md).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid as uuidlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from lightkube import ApiError, AsyncClient
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from gpufrac._generated.kubelet.dra.v1 import api_pb2 as dra_pb2
from gpufrac._generated.kubelet.dra.v1 import api_pb2_grpc as dra_grpc
from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpufrac.contract import keys
from gpufrac.node.dra.ledger import NodeGpu
from gpufrac.node.dra.plugin import DraPlugin
from gpufrac.node.dra.prepare import CDI_KIND, spec_path

GPU = "GPU-0f0e0d0c-0000-4000-8000-000000000001"
DEVICE = GPU.lower()
THE_GPU = NodeGpu(uuid=GPU, index=0, usable_mib=81920)  # exactly 80Gi usable
NODE = "dra-node-1"


@pytest.fixture
def root() -> Iterator[Path]:
    # Short: a unix socket path has at most 107 characters.
    path = Path(tempfile.mkdtemp(prefix="dra-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def plugin(akube: AsyncClient, root: Path) -> AsyncIterator[DraPlugin]:
    p = DraPlugin(
        client=akube,
        node_name=NODE,
        devices=lambda: {DEVICE: THE_GPU},
        kubelet_dir=root / "kubelet",
        cdi_dir=root / "cdi",
        pipe_root=str(root / "mps"),
    )
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def allocated_claim(
    client: AsyncClient,
    namespace: str,
    *,
    memory: str = "20Gi",
    mode: str = "time-slicing",
    compute: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A claim for ``memory`` of a GPU in ``mode`` (and ``compute`` percent), allocated on our device as
    kube-scheduler does."""
    name = name or f"share-{uuidlib.uuid4().hex[:6]}"
    consumed = {keys.DRA_MEMORY_CAPACITY: memory}
    if compute is not None:
        consumed[keys.DRA_COMPUTE_CAPACITY] = compute
    created = await client.create(
        ResourceClaim.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": f"{mode}.{keys.DRA_DRIVER_NAME}",
                                    "capacity": {"requests": {keys.DRA_MEMORY_CAPACITY: memory}},
                                },
                            }
                        ]
                    }
                },
            }
        )
    )
    status = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": keys.DRA_DRIVER_NAME,
                        "pool": "node-1",
                        "device": DEVICE,
                        "shareID": str(uuidlib.uuid4()),
                        "consumedCapacity": consumed,
                    }
                ],
                "config": [
                    {
                        "source": "FromClass",
                        "opaque": {
                            "driver": keys.DRA_DRIVER_NAME,
                            "parameters": {
                                "apiVersion": keys.DRA_CONFIG_API_VERSION,
                                "kind": keys.DRA_CONFIG_KIND,
                                "computeMode": mode,
                            },
                        },
                    }
                ],
            }
        }
    }
    await client.patch(
        ResourceClaim.Status, name, {"status": status}, namespace=namespace, patch_type=PatchType.MERGE
    )
    assert created.metadata is not None
    return {"namespace": namespace, "name": name, "uid": created.metadata.uid}


def claim_ref(c: dict[str, Any]) -> Any:
    return dra_pb2.Claim(namespace=c["namespace"], name=c["name"], uid=c["uid"])


async def test_the_kubelet_learns_the_driver_from_the_registration_socket(plugin: DraPlugin) -> None:
    async with grpc.aio.insecure_channel(f"unix://{plugin.registration_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg_pb2.InfoRequest())
        assert (info.type, info.name, info.endpoint) == (
            "DRAPlugin",
            keys.DRA_DRIVER_NAME,
            str(plugin.endpoint),
        )
        assert list(info.supported_versions) == ["v1.DRAPlugin"]
        assert plugin.registration_socket.parent.name == "plugins_registry"
        await stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True))
    assert plugin.registered is True


async def test_prepare_writes_the_share_as_cdi_and_unprepare_removes_it(
    plugin: DraPlugin, akube: AsyncClient, namespace: str, root: Path
) -> None:
    claim = await allocated_claim(akube, namespace)
    async with grpc.aio.insecure_channel(f"unix://{plugin.endpoint}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        request = dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(claim)])
        first = await stub.NodePrepareResources(request)
        answer = first.claims[claim["uid"]]
        assert answer.error == ""
        (device,) = answer.devices
        assert (list(device.request_names), device.pool_name, device.device_name) == (
            ["gpu"],
            "node-1",
            DEVICE,
        )
        name = f"{claim['uid']}-{DEVICE}"
        assert list(device.cdi_device_ids) == [f"{CDI_KIND}={name}", f"{keys.CDI_GPU_KIND}={GPU}"]
        spec = json.loads(spec_path(root / "cdi", claim["uid"]).read_text())
        env = spec["devices"][0]["containerEdits"]["env"]
        assert "NVIDIA_GPU_MEMORY_LIMIT=20480" in env and f"NVIDIA_VISIBLE_DEVICES={GPU}" in env

        again = await stub.NodePrepareResources(request)  # the kubelet retries: same answer, same file
        assert again == first
        assert [p.name for p in (root / "cdi").iterdir()] == [spec_path(root / "cdi", claim["uid"]).name]

        leaf = root / "mps" / name  # the claim's MPS directory, ready before the runtime mounts it
        assert leaf.is_dir()
        assert {"hostPath": str(leaf), "containerPath": "/run/nvidia/mps"}.items() <= spec["devices"][0][
            "containerEdits"
        ]["mounts"][0].items()

        unprepare = dra_pb2.NodeUnprepareResourcesRequest(claims=[claim_ref(claim)])
        done = await stub.NodeUnprepareResources(unprepare)
        assert done.claims[claim["uid"]].error == ""
        assert not spec_path(root / "cdi", claim["uid"]).exists()
        assert not leaf.exists()
        twice = await stub.NodeUnprepareResources(unprepare)
        assert twice.claims[claim["uid"]].error == ""


async def test_a_claim_that_is_gone_fails_its_own_answer_only(
    plugin: DraPlugin, akube: AsyncClient, namespace: str
) -> None:
    good = await allocated_claim(akube, namespace)
    gone = {"namespace": namespace, "name": "deleted-claim", "uid": str(uuidlib.uuid4())}
    replaced = {**good, "uid": str(uuidlib.uuid4())}
    async with grpc.aio.insecure_channel(f"unix://{plugin.endpoint}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        reply = await stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(
                claims=[claim_ref(good), claim_ref(gone), claim_ref(replaced)]
            )
        )
    assert reply.claims[good["uid"]].error == "" and len(reply.claims[good["uid"]].devices) == 1
    assert f"ResourceClaim {namespace}/deleted-claim does not exist" in reply.claims[gone["uid"]].error
    assert "it was deleted and created again" in reply.claims[replaced["uid"]].error


async def test_a_socket_path_too_long_for_unix_is_refused_before_anything_listens(
    akube: AsyncClient, root: Path
) -> None:
    deep = root / ("k" * 100)
    p = DraPlugin(
        client=akube, node_name=NODE, devices=dict, kubelet_dir=deep, cdi_dir=root / "cdi", pipe_root="/run/x"
    )
    with pytest.raises(ValueError, match=r"a unix socket path has at most 107"):
        await p.start()
    assert not (deep / "plugins").exists()


async def test_a_claim_that_would_mix_compute_modes_on_a_gpu_is_not_prepared(
    plugin: DraPlugin, akube: AsyncClient, namespace: str, root: Path
) -> None:
    time_slicing = await allocated_claim(akube, namespace)
    sm_sharing = await allocated_claim(akube, namespace, mode="sm-sharing")
    async with grpc.aio.insecure_channel(f"unix://{plugin.endpoint}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        first = await stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(time_slicing)])
        )
        assert first.claims[time_slicing["uid"]].error == ""
        mixed = await stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(sm_sharing)])
        )
        error = mixed.claims[sm_sharing["uid"]].error
        assert f"asks for sm-sharing on GPU {GPU}, which is held in time-slicing" in error
        assert not spec_path(root / "cdi", sm_sharing["uid"]).exists()  # nothing of it reaches the runtime

        await stub.NodeUnprepareResources(
            dra_pb2.NodeUnprepareResourcesRequest(claims=[claim_ref(time_slicing)])
        )
        later = await stub.NodePrepareResources(
            dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(sm_sharing)])
        )
        assert later.claims[sm_sharing["uid"]].error == ""  # the GPU was released: the kubelet's retry passes


async def test_a_spec_that_cannot_be_written_fails_the_claims_answer_not_the_call(
    akube: AsyncClient, namespace: str, root: Path
) -> None:
    blocked = root / "cdi-is-a-file"
    blocked.write_text("")  # the spec directory cannot be made
    p = DraPlugin(
        client=akube,
        node_name=NODE,
        devices=lambda: {DEVICE: THE_GPU},
        kubelet_dir=root / "k",
        cdi_dir=blocked,
        pipe_root=str(root),
    )
    await p.start()
    try:
        claim = await allocated_claim(akube, namespace)
        async with grpc.aio.insecure_channel(f"unix://{p.endpoint}") as channel:
            reply = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(claim)])
            )
        assert "cdi-is-a-file" in reply.claims[claim["uid"]].error
        assert not reply.claims[claim["uid"]].devices
    finally:
        await p.stop()


async def annotation_pod(
    client: AsyncClient, namespace: str, *, memory: str, mode: str = "time-slicing", device: str = GPU
) -> str:
    """A pod gpufrac-scheduler bound to the plugin's node: its binding annotations and ``nodeName``, as
    the atomic binder writes them in one update (no kubelet runs here: it is bound, not started)."""
    name = f"annotated-{uuidlib.uuid4().hex[:6]}"
    prefix = "nvidia.com/container.app."
    await client.create(
        Pod(
            metadata=ObjectMeta(
                name=name,
                namespace=namespace,
                annotations={
                    prefix + "gpus.devices": device,
                    prefix + "gpu-memory.request": memory,
                    prefix + "gpu-memory.limit": memory,
                    prefix + "gpu-compute.mode": mode,
                },
            ),
            spec=PodSpec(nodeName=NODE, containers=[Container(name="app", image="busybox")]),
        )
    )
    return name


async def test_a_share_that_does_not_fit_beside_claims_and_annotation_pods_is_refused_naming_them(
    plugin: DraPlugin, akube: AsyncClient, namespace: str, root: Path
) -> None:
    """The stock scheduler sees only claims: 20Gi of claims and a 40Gi annotation pod leave 20Gi of the
    80Gi GPU, so a 30Gi claim it allocated there is refused by the node, and fits once the pod is gone."""
    first = await allocated_claim(akube, namespace, memory="20Gi", name="first")
    pod = await annotation_pod(akube, namespace, memory="40Gi")
    big = await allocated_claim(akube, namespace, memory="30Gi", name="big")
    try:
        async with grpc.aio.insecure_channel(f"unix://{plugin.endpoint}") as channel:
            stub = dra_grpc.DRAPluginStub(channel)

            async def prepare(claim: dict[str, Any]) -> str:
                reply = await stub.NodePrepareResources(
                    dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(claim)])
                )
                return str(reply.claims[claim["uid"]].error)

            assert await prepare(first) == ""
            error = await prepare(big)
            assert (
                f"claim {namespace}/big (request gpu) asks for 30720 MiB on GPU {GPU}, which has 81920 "
                f"usable MiB of which 61440 are held (20480 MiB by claim {namespace}/first; 40960 MiB by "
                f"pod {namespace}/{pod}): 61440 + 30720 = 92160 MiB is over 81920" in error
            )
            assert not spec_path(root / "cdi", big["uid"]).exists()  # nothing of it reaches the runtime
            assert await prepare(first) == ""  # a retry of a prepared claim does not count against itself

            await akube.delete(Pod, pod, namespace=namespace, grace_period=0)
            assert await prepare(big) == ""  # the kubelet's retry passes once the memory is released
    finally:
        with contextlib.suppress(ApiError):  # bound to the tests' node: it must not outlive this test
            await akube.delete(Pod, pod, namespace=namespace, grace_period=0)


async def test_a_claim_in_the_other_mode_than_an_annotation_pod_on_the_gpu_is_refused_naming_the_pod(
    plugin: DraPlugin, akube: AsyncClient, namespace: str
) -> None:
    pod = await annotation_pod(akube, namespace, memory="10Gi", mode="sm-sharing", device="0")  # by index
    claim = await allocated_claim(akube, namespace)
    try:
        async with grpc.aio.insecure_channel(f"unix://{plugin.endpoint}") as channel:
            reply = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[claim_ref(claim)])
            )
    finally:  # bound to the tests' node: it must not outlive this test (no namespace controller runs)
        await akube.delete(Pod, pod, namespace=namespace, grace_period=0)
    assert (
        f"asks for time-slicing on GPU {GPU}, which is held in sm-sharing by pod {namespace}/{pod}"
        in reply.claims[claim["uid"]].error
    )
