"""An sm-sharing DRA claim gets its MPS namespace as an annotation container does, and keeps it across NRI
reconciles and agent restarts; unprepare removes it.

MPS is the STAND-IN control daemon (``mps_standin.py``: this machine has no GPU, driver or MPS), run by the
real supervisor through the agent's ``MpsService``; the claims live on the real API server, allocated as
kube-scheduler allocates them; the kubelet's prepare and unprepare are the plugin's own methods (the gRPC
surface is tests/node/test_dra_plugin.py). A stand-in client started with the spec's MPS directory shows
what a process of the claim's container would reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import uuid as uuidlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType
from mps_harness import MpsEnv, RecordingSink, until

from gpufrac.contract import keys
from gpufrac.node.dra.ledger import NodeGpu
from gpufrac.node.dra.plugin import DraPlugin
from gpufrac.node.dra.prepare import cdi_device_name, spec_path
from gpufrac.node.mps.containers import SHARED_PIPE_MOUNT_OPTIONS
from gpufrac.node.mps.names import namespace_name
from gpufrac.node.mps.service import MpsService
from gpufrac.node.mps.supervisor import SupervisorState

GPU = "GPU-0f0e0d0c-0000-4000-8000-0000000000aa"
DEVICE = GPU.lower()


@pytest.fixture
def cdi() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cdi-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Agent:
    """The agent's DRA and MPS halves wired as ``NodeAgent`` wires them: the plugin sets a share up
    through the service's hooks, the service's live set reads the plugin's prepared claims."""

    def __init__(
        self, *, client: AsyncClient, env: MpsEnv, cdi: Path, driver: str = "615.20.01", **settings_: Any
    ) -> None:
        settings = env.settings(**settings_)
        self.service = MpsService(
            settings=settings,
            events=RecordingSink(),
            read_driver=lambda: driver,
            claims=lambda: self.plugin.prepared_plans(),
        )
        self.plugin = DraPlugin(
            client=client,
            node_name="dra-mps-node",
            devices=lambda: {DEVICE: NodeGpu(uuid=GPU, index=0, usable_mib=81920)},
            kubelet_dir=env.root / "kubelet",
            cdi_dir=cdi,
            pipe_root=str(env.root / "leaves"),
            mps=self.service.hooks,
            shared_pipe_dir=str(settings.pipe_dir),  # classic MPS's, mounted read-only
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.service.run())
        await until(
            lambda: (
                self.service.supervisor is not None and self.service.supervisor.state is SupervisorState.READY
            )
        )

    async def stop(self, *, handover: bool = False) -> None:
        """Stop as the agent does; with ``handover`` the daemon is left serving for the next agent."""
        self.service.handover_on_exit = handover
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def namespaces(self) -> list[str]:
        assert self.service.supervisor is not None
        return await self.service.supervisor.control.list_namespaces(server="shared")

    async def nri_synchronize(self) -> None:
        """The runtime reconnects and lists no annotation containers; its reconcile has run on return."""
        await self.service.hooks.on_synchronize([])
        assert self.service.supervisor is not None
        await self.service.supervisor.reconcile()


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    made: list[Agent] = []
    try:
        yield made
    finally:
        for agent in made:
            await agent.stop()


async def sm_claim(
    client: AsyncClient, namespace: str, *, memory: str, compute: str, mode: str = "sm-sharing"
) -> dict[str, Any]:
    """A claim (sm-sharing unless ``mode`` says otherwise) allocated on our device with ``memory`` and
    ``compute`` percent consumed."""
    name = f"share-{uuidlib.uuid4().hex[:6]}"
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": f"{mode}.{keys.DRA_DRIVER_NAME}",
            "capacity": {"requests": {keys.DRA_MEMORY_CAPACITY: memory, keys.DRA_COMPUTE_CAPACITY: compute}},
        },
    }
    created = await client.create(
        ResourceClaim.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"devices": {"requests": [request]}},
            }
        )
    )
    config = {
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
    result = {
        "request": "gpu",
        "driver": keys.DRA_DRIVER_NAME,
        "pool": "dra-mps-node",
        "device": DEVICE,
        "shareID": str(uuidlib.uuid4()),
        "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: memory, keys.DRA_COMPUTE_CAPACITY: compute},
    }
    status = {"allocation": {"devices": {"results": [result], "config": [config]}}}
    await client.patch(
        ResourceClaim.Status, name, {"status": status}, namespace=namespace, patch_type=PatchType.MERGE
    )
    assert created.metadata is not None
    return {"namespace": namespace, "name": name, "uid": created.metadata.uid}


def spec_mount(cdi: Path, uid: str) -> dict[str, Any]:
    (device,) = json.loads(spec_path(cdi, uid).read_text())["devices"]
    (mount,) = device["containerEdits"]["mounts"]
    return dict(mount)


def mps_mount(cdi: Path, uid: str) -> str:
    return str(spec_mount(cdi, uid)["hostPath"])


async def test_an_sm_sharing_claim_gets_its_namespace_which_survives_nri_and_goes_at_unprepare(
    akube: AsyncClient, namespace: str, mps_env: MpsEnv, cdi: Path, agents: list[Agent]
) -> None:
    agent = Agent(client=akube, env=mps_env, cdi=cdi)
    agents.append(agent)
    await agent.start()
    claim = await sm_claim(akube, namespace, memory="20Gi", compute="25")
    await agent.plugin.prepare(**claim)

    ns = namespace_name(cdi_device_name(claim["uid"], DEVICE))
    assert agent.service.supervisor is not None
    directory = agent.service.supervisor.namespace_dir(ns)
    # The spec mounts the namespace's own directory, as the NRI path re-points an annotation container's.
    assert mps_mount(cdi, claim["uid"]) == str(directory)
    control = agent.service.supervisor.control
    assert await control.namespace_field(server="shared", name=ns, field="active_thread_percentage") == "25"
    assert await control.namespace_field(server="shared", name=ns, field="pinned_memory_limit") == "20480M"
    client, greeting = await mps_env.client(directory)  # a process of the claim's container
    assert greeting == f"connected shared {ns} 25"
    client.kill()
    await client.wait()

    # The runtime reconnects (no annotation container runs): the claim's namespace is live, not an orphan.
    await agent.nri_synchronize()
    assert ns in await agent.namespaces()

    await agent.plugin.unprepare(uid=claim["uid"])
    assert ns not in await agent.namespaces() and not directory.exists()
    await agent.nri_synchronize()  # and nothing brings it back
    assert ns not in await agent.namespaces()


async def test_an_agent_restart_recreates_a_prepared_claims_namespace_from_its_spec(
    akube: AsyncClient, namespace: str, mps_env: MpsEnv, cdi: Path, agents: list[Agent]
) -> None:
    first = Agent(client=akube, env=mps_env, cdi=cdi)
    agents.append(first)
    await first.start()
    claim = await sm_claim(akube, namespace, memory="8Gi", compute="40")
    await first.plugin.prepare(**claim)
    ns = namespace_name(cdi_device_name(claim["uid"], DEVICE))
    assert first.service.supervisor is not None
    directory = first.service.supervisor.namespace_dir(ns)
    inode = directory.stat().st_ino
    await first.stop()  # the daemon stops with it (no handover): it keeps no namespace

    second = Agent(client=akube, env=mps_env, cdi=cdi)  # knows the claim from its CDI spec only
    agents.append(second)
    await second.start()
    # Made again at the new daemon's first READY, before the runtime has said anything, in the very
    # directory the claim's running container has mounted.
    assert ns in await second.namespaces()
    assert directory.stat().st_ino == inode
    client, greeting = await mps_env.client(directory)
    assert greeting == f"connected shared {ns} 40"
    client.kill()
    await client.wait()
    await second.nri_synchronize()
    assert ns in await second.namespaces()

    await second.plugin.unprepare(uid=claim["uid"])
    assert ns not in await second.namespaces()


async def test_on_classic_mps_an_sm_sharing_claim_mounts_the_pipe_directory_read_only(
    akube: AsyncClient, namespace: str, mps_env: MpsEnv, cdi: Path, agents: list[Agent]
) -> None:
    """Before r615 there are no namespaces: the share's container reaches the node's one pipe directory,
    read-only as an annotation container's, and its limits are the client variables of the spec."""
    agent = Agent(client=akube, env=mps_env, cdi=cdi, driver="550.54.15")
    agents.append(agent)
    await agent.start()
    claim = await sm_claim(akube, namespace, memory="4Gi", compute="50")
    await agent.plugin.prepare(**claim)
    mount = spec_mount(cdi, claim["uid"])
    assert mount["hostPath"] == str(mps_env.root / "pipe")
    assert mount["options"] == list(SHARED_PIPE_MOUNT_OPTIONS) and "ro" in mount["options"]
    await agent.plugin.unprepare(uid=claim["uid"])
    assert not spec_path(cdi, claim["uid"]).exists() and (mps_env.root / "pipe").is_dir()


async def test_a_time_slicing_claim_reaches_the_default_socket_when_time_slicing_clients_is_on(
    akube: AsyncClient, namespace: str, mps_env: MpsEnv, cdi: Path, agents: list[Agent]
) -> None:
    """``mps_time_slicing_clients``: the share's container gets a directory holding only a link to the
    default server's socket, as an annotation container does; it survives an NRI reconcile and goes at
    unprepare."""
    agent = Agent(client=akube, env=mps_env, cdi=cdi, time_slicing_clients=True)
    agents.append(agent)
    await agent.start()
    claim = await sm_claim(akube, namespace, memory="4Gi", compute="0", mode="time-slicing")
    await agent.plugin.prepare(**claim)
    assert agent.service.supervisor is not None and agent.service.supervisor.default_links is not None
    directory = agent.service.supervisor.default_links.directory(cdi_device_name(claim["uid"], DEVICE))
    assert mps_mount(cdi, claim["uid"]) == str(directory)
    assert [p.name for p in directory.iterdir()] == ["control"]
    await agent.nri_synchronize()  # no annotation container: the claim's directory is live all the same
    assert (directory / "control").exists()
    await agent.plugin.unprepare(uid=claim["uid"])
    assert not directory.exists()


async def test_a_claims_namespace_and_its_client_survive_an_agent_handover(
    akube: AsyncClient, namespace: str, mps_env: MpsEnv, cdi: Path, agents: list[Agent]
) -> None:
    """The default agent restart (``mps_handover``): the daemon keeps serving, the new agent adopts it
    with the claim's namespace as it is, and the claim's process connected before is still served;
    the runtime's reconnection (no annotation container) does not delete the namespace."""
    handover = {"handover": True, "own_cgroup": None}  # a host process here: no container cgroup to leave
    first = Agent(client=akube, env=mps_env, cdi=cdi, **handover)
    agents.append(first)
    await first.start()
    claim = await sm_claim(akube, namespace, memory="8Gi", compute="30")
    await first.plugin.prepare(**claim)
    ns = namespace_name(cdi_device_name(claim["uid"], DEVICE))
    assert first.service.supervisor is not None
    directory = first.service.supervisor.namespace_dir(ns)
    client, greeting = await mps_env.client(directory)
    assert greeting == f"connected shared {ns} 30"
    await first.stop(handover=True)

    second = Agent(client=akube, env=mps_env, cdi=cdi, **handover)
    agents.append(second)
    await second.start()
    assert second.service.supervisor is not None
    await second.nri_synchronize()
    assert ns in await second.namespaces()
    clients = await second.service.supervisor.control.list_clients()
    assert [(c.pid, c.namespace) for c in clients] == [(client.pid, ns)]  # never cut off
    client.kill()
    await client.wait()
