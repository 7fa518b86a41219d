"""The kubelet plugin's gRPC surface, driven the way the kubelet drives it, with claims on a real API server.

The test plays the kubelet (registration, then prepare and unprepare over the plugin's socket) and
kube-scheduler (it writes the claim's allocation into its status, as the allocator does). The real
kubelet and scheduler path is what is left (docs/dra.md).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid as uuidlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from lightkube import AsyncClient
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from gpufrac._generated.kubelet.dra.v1 import api_pb2 as dra_pb2
from gpufrac._generated.kubelet.dra.v1 import api_pb2_grpc as dra_grpc
from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
from gpufrac._generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpufrac.contract import keys
from gpufrac.node.dra.plugin import DraPlugin
from gpufrac.node.dra.prepare import CDI_KIND, spec_path

GPU = "GPU-0f0e0d0c-0000-4000-8000-000000000001"
DEVICE = GPU.lower()


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
        devices=lambda: {DEVICE: GPU},
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
    client: AsyncClient, namespace: str, *, memory: str = "20Gi", mode: str = "time-slicing"
) -> dict[str, Any]:
    """A claim for ``memory`` of a GPU in ``mode``, allocated on our device as kube-scheduler does."""
    name = f"share-{uuidlib.uuid4().hex[:6]}"
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
                        "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: memory},
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
    p = DraPlugin(client=akube, devices=dict, kubelet_dir=deep, cdi_dir=root / "cdi", pipe_root="/run/x")
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
        devices=lambda: {DEVICE: GPU},
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
