"""MIG containers through NRI's real adaptation: exactly their slices as CDI devices, nothing of a fraction.

The node has one GPU serving fractions and one in mode ``mig`` with two slices (SIMULATED inventory, as
the NVML backend publishes a MIG GPU). A pod the binder placed on a slice names the slice's MIG device
UUID among its devices (docs/mig.md); the runtime answers with the container as the agent adjusted it.
"""

from __future__ import annotations

import pytest
from nri_harness import GPU_A, NODE_GPUS, Node

from gpufrac.contract import keys
from gpufrac.local.nriruntime import ContainerCreateFailed
from gpufrac.node.inject import CONTAINER_PIPE_DIR, ENFORCEMENT_ENV, NVIDIA_VISIBLE_DEVICES
from gpufrac.node.inventory.backend import GpuInfo, MigSliceInfo
from gpufrac.node.mapping import MIG_MODE
from gpufrac.node.memlimit.condition import REASON_HARDWARE_ISOLATED, pod_condition

GPU_M = "GPU-8f3c6a2e-0000-4000-8000-00000000000c"
SLICE_L = "MIG-4a1b0000-0000-4000-8000-000000000001"  # 3g.40gb at 0
SLICE_S = "MIG-4a1b0000-0000-4000-8000-000000000002"  # 1g.10gb at 6
GONE = "MIG-4a1b0000-0000-4000-8000-0000000000ff"  # not (or no longer) a slice of this node
MIG_GPU = GpuInfo(
    uuid=GPU_M,
    index=2,
    minor=2,
    model="NVIDIA H100 80GB HBM3",
    mib=81559,
    mig=True,
    mig_slices=(
        MigSliceInfo(profile="3g.40gb", start=0, uuid=SLICE_L, mib=40192),
        MigSliceInfo(profile="1g.10gb", start=6, uuid=SLICE_S, mib=9856),
    ),
)
GPUS = (NODE_GPUS[0], MIG_GPU)


def on_slices(*devices: str, container: str = "app") -> dict[str, str]:
    """A pod as the binder leaves one placed on MIG slices: the request, and the slices' UUIDs."""
    return {
        keys.mig_key(container, keys.MIG_PROFILE): "1g.10gb",
        keys.devices_key(container): ",".join(devices),
    }


@pytest.fixture
async def node(make_node) -> Node:  # type: ignore[no-untyped-def]
    node = await make_node(agent=False)
    await node.start_agent(gpus=GPUS)
    return node


async def test_a_mig_container_gets_exactly_its_slice_as_a_cdi_device_and_nothing_of_a_fraction(
    node: Node,
) -> None:
    pod = await node.pod(on_slices(SLICE_S))
    created = await node.create(pod, "app", env={NVIDIA_VISIBLE_DEVICES: "all", "PATH": "/usr/bin"})

    assert created.cdi_devices == [f"nvidia.com/gpu={SLICE_S}"]
    assert {k: v for k, v in created.env.items() if k in ENFORCEMENT_ENV} == {NVIDIA_VISIBLE_DEVICES: SLICE_S}
    assert created.mount_at(CONTAINER_PIPE_DIR) is None
    (record,) = node.store.allocations()
    assert (record.mode, record.devices, record.mig_profiles) == (MIG_MODE, (SLICE_S,), ("1g.10gb",))
    assert (record.exclusive, record.request_mib, record.limit_mib, record.pipe_dir) == (
        True,
        9856,
        9856,
        None,
    )


@pytest.mark.parametrize("key", [k for k in ENFORCEMENT_ENV if k != NVIDIA_VISIBLE_DEVICES])
async def test_a_mig_container_bringing_a_fraction_or_mps_variable_is_refused_naming_it(
    node: Node, key: str
) -> None:
    """NRI cannot remove a variable a container brings (only replace it), and a MIG plan sets none of
    these: the container would run with what the user wrote, so it is refused."""
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(await node.pod(on_slices(SLICE_S)), "app", env={key: "planted"})
    said = str(refused.value)
    assert f"sets {key}='planted' in its environment, which its GPU assignment does not set" in said
    assert node.store.allocations() == []


async def test_two_slices_are_both_given_and_recorded_with_their_profiles(node: Node) -> None:
    pod = await node.pod(on_slices(SLICE_L, SLICE_S) | {keys.mig_key("app", keys.MIG_COUNT): "2"})
    created = await node.create(pod, "app")
    assert created.cdi_devices == [f"nvidia.com/gpu={SLICE_L}", f"nvidia.com/gpu={SLICE_S}"]
    (record,) = node.store.allocations()
    assert record.mig_profiles == ("3g.40gb", "1g.10gb") and record.request_mib == 9856


async def test_a_mig_uuid_that_is_not_a_slice_of_this_node_fails_the_container_naming_it(node: Node) -> None:
    pod = await node.pod(on_slices(GONE))
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(pod, "app")
    message = str(refused.value)
    assert (
        f'{keys.devices_key("app")}="{GONE}" is invalid: "{GONE}" is not a MIG slice this node publishes'
        in message
    )
    assert "(2 slices on 1 GPU in mode mig" in message
    assert (await node.runtime.list())["containers"] == [] and node.store.allocations() == []


async def test_a_fraction_naming_a_mig_gpu_is_refused_and_one_on_the_other_gpu_is_not(node: Node) -> None:
    fraction = {
        "nvidia.com/container.app.gpu-memory.request": "4Gi",
        keys.devices_key("app"): GPU_M,
    }
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(await node.pod(fraction), "app")
    assert (
        f'GPU "{GPU_M}" ({GPU_M}) is in mode mig and serves only its MIG slices (3g.40gb@0, 1g.10gb@6)'
        in str(refused.value)
    )
    by_index = await node.pod(fraction | {keys.devices_key("app"): "nvidia.com/gpu=2"})
    with pytest.raises(ContainerCreateFailed, match="is in mode mig"):
        await node.create(by_index, "app")
    fine = await node.create(await node.pod(fraction | {keys.devices_key("app"): GPU_A}), "app")
    assert fine.env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"


async def test_a_gpu_among_a_mig_containers_devices_and_a_slice_given_to_a_fraction_are_refused(
    node: Node,
) -> None:
    mixed = await node.pod(on_slices(SLICE_S, GPU_A) | {keys.mig_key("app", keys.MIG_COUNT): "2"})
    with pytest.raises(ContainerCreateFailed, match=f'"{GPU_A}" is not a MIG slice this node publishes'):
        await node.create(mixed, "app")
    fraction = {"nvidia.com/container.app.gpu-memory.request": "4Gi", keys.devices_key("app"): SLICE_S}
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(await node.pod(fraction), "app")
    assert f'"{SLICE_S}" is a MIG slice and container app asks for no MIG slice' in str(refused.value)
    assert node.store.allocations() == []


async def test_at_start_a_mig_container_is_held_by_the_hardware_and_its_pod_condition_says_which_slice(
    make_node,  # type: ignore[no-untyped-def]
) -> None:
    node = await make_node(cgroups=True, agent=False)
    await node.start_agent(gpus=GPUS, limits=True)
    pod = await node.pod(on_slices(SLICE_S))
    created = await node.create(pod, "app")
    await node.runtime.start_container(created.id)

    assert node.agent.limits is not None
    booked = node.agent.limits.get(created.id)
    assert booked is not None and booked.in_force and booked.cgroup is None
    assert node.driver().held() == {}  # no per-cgroup memory limit was set for it, on any GPU
    condition = pod_condition(node.store.allocations(), {created.id: booked})
    assert condition is not None
    assert (condition.status, condition.reason) == ("True", REASON_HARDWARE_ISOLATED)
    assert condition.message == f"app: MIG slice 1g.10gb ({SLICE_S})"
    assert node.agent.events.emitted == []


async def test_after_an_agent_restart_synchronize_records_the_mig_container_again_and_reports_a_bare_one(
    node: Node,
) -> None:
    pod = await node.pod(on_slices(SLICE_S))
    kept = await node.create(pod, "app")
    await node.agent.stop()
    late = await node.create(await node.pod(on_slices(SLICE_L)), "app")  # created while the agent was away
    assert late.cdi_devices == []

    agent = await node.start_agent(gpus=GPUS)
    agent.store.flush()
    (record,) = agent.store.allocations()
    assert (record.container_id, record.mode, record.mig_profiles) == (kept.id, MIG_MODE, ("1g.10gb",))
    assert list(agent.injector.unenforced) == [late.id]
    assert f"NVIDIA_VISIBLE_DEVICES missing, want '{SLICE_L}'" in agent.injector.unenforced[late.id]
