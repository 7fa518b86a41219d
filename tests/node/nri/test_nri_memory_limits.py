"""The driver's per-cgroup memory limit through NRI's real adaptation: set and read back at StartContainer.

The runtime (testenv/nriruntime: NRI's runtime library, what containerd embeds) makes each container's
cgroup as runc would (SIMULATED directories), the agent's plugin sets the limit through the SIMULATED
driver keyed by that directory, and a start whose limit is not in force fails through the adaptation,
exactly as containerd fails a CRI StartContainer that an NRI plugin refused.
"""

from __future__ import annotations

import pytest
from nri_harness import GPU_A, GPU_B, Node

from gpufrac.local.nriruntime import NriRuntimeError
from gpufrac.node.memlimit.driver import MIB, NVML_ERROR_NOT_SUPPORTED
from gpufrac.node.memlimit.enforcer import REASON_NOT_ENFORCED, REASON_REAPPLIED

FRACTION = {
    "nvidia.com/container.app.gpu-memory.request": "4Gi",
    "nvidia.com/container.app.gpu-memory.limit": "6Gi",
    "nvidia.com/container.app.gpus.devices": f"{GPU_A},{GPU_B}",
    "gpu-fraction-num-devices": "2",
}


@pytest.fixture
async def node(make_node) -> Node:  # type: ignore[no-untyped-def]
    node = await make_node(cgroups=True, agent=False)
    await node.start_agent(limits=True)
    return node


def held(node: Node, container_id: str, pod_id: str) -> dict[str, tuple[int, int]]:
    assert node.runtime.cgroup_root is not None
    cgroup = str(node.runtime.cgroup_root / "kubepods" / f"pod{pod_id}" / container_id)
    return {
        gpu: (limits[cgroup].soft, limits[cgroup].hard)
        for gpu, limits in node.driver().held().items()
        if cgroup in limits
    }


async def test_a_fraction_starts_only_with_its_limit_read_back_on_every_gpu(node: Node) -> None:
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    assert held(node, created.id, pod) == {}  # created, not started: nothing set yet
    await node.runtime.start_container(created.id)
    assert held(node, created.id, pod) == {GPU_A: (4096 * MIB, 6144 * MIB), GPU_B: (4096 * MIB, 6144 * MIB)}
    assert node.agent.limits is not None
    booked = node.agent.limits.get(created.id)
    assert booked is not None and booked.in_force
    assert node.agent.events.emitted == []


async def test_a_refused_limit_fails_the_start_with_the_gpu_the_cgroup_the_values_and_the_error(
    node: Node,
) -> None:
    node.driver().refuse(gpu=GPU_B, code=NVML_ERROR_NOT_SUPPORTED)
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    with pytest.raises(NriRuntimeError) as failed:
        await node.runtime.start_container(created.id)
    message = str(failed.value)
    for words in (
        GPU_B,
        f"kubepods/pod{pod}/{created.id}",
        "soft 4096 MiB, hard 6144 MiB",
        "NVML_ERROR_NOT_SUPPORTED",
    ):
        assert words in message
    assert "does not start" in message
    (container,) = [c for c in (await node.runtime.list())["containers"] if c["id"] == created.id]
    assert container.get("state") != "CONTAINER_RUNNING"
    assert [e[2] for e in node.agent.events.emitted] == [REASON_NOT_ENFORCED]
    assert node.agent.injector.refused == 1


async def test_a_driver_that_accepts_and_ignores_the_set_is_caught_by_the_read_back(node: Node) -> None:
    node.driver().ignore_sets(gpu=GPU_A)
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    with pytest.raises(NriRuntimeError, match="the driver holds no limit"):
        await node.runtime.start_container(created.id)


async def test_a_container_without_its_cgroup_does_not_start(node: Node) -> None:
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app", cgroups_path="kubepods-besteffort-podx.slice:cri-containerd:zz")
    with pytest.raises(NriRuntimeError, match=r"no cgroup: cgroup .* does not exist"):
        await node.runtime.start_container(created.id)


async def test_whole_gpu_and_non_gpu_containers_are_left_alone(node: Node) -> None:
    whole = await node.pod({"gpufrac.io/container.t.gpus": "1", "nvidia.com/container.t.gpus.devices": GPU_A})
    plain = await node.pod({})
    for pod, name in ((whole, "t"), (plain, "web")):
        created = await node.create(pod, name)
        await node.runtime.start_container(created.id)
    assert node.driver().held() == {}


async def test_an_agent_restart_adopts_running_fractions_and_sets_a_cleared_limit_again(node: Node) -> None:
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    await node.runtime.start_container(created.id)
    await node.agent.stop()
    assert node.runtime.cgroup_root is not None
    cgroup = str(node.runtime.cgroup_root / "kubepods" / f"pod{pod}" / created.id)
    node.driver().tamper(gpu=GPU_B, cgroup=cgroup)  # cleared while no agent watched
    agent = await node.start_agent(limits=True)  # Synchronize lists the running container
    assert agent.limits is not None
    booked = agent.limits.get(created.id)
    assert booked is not None and booked.in_force and booked.reapplied == 1
    assert held(node, created.id, pod)[GPU_B] == (4096 * MIB, 6144 * MIB)
    assert [e[2] for e in agent.events.emitted] == [REASON_REAPPLIED]


async def test_removing_the_container_drops_its_cgroup_and_the_driver_forgets_it(node: Node) -> None:
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    await node.runtime.start_container(created.id)
    await node.runtime.stop_container(created.id)
    await node.runtime.remove_container(created.id)
    assert node.driver().held() == {}
    assert node.agent.limits is not None and node.agent.limits.get(created.id) is None


# -- the misconfigurations that left peers' fractions silently unlimited -----------------------------------
#
# With ``memory_limits: verify`` the agent sets nothing: it reads back what the NVIDIA toolkit's hook set
# (SIMULATED here: gpufrac.node.memlimit.simulated.SimulatedToolkitHook, run by the runtime as runc runs
# the OCI hook), so what the toolkit did or did not do is exactly what the pod is told.


async def test_without_the_toolkit_hook_a_verify_only_node_never_starts_a_fraction_that_looks_enforced(
    make_node,  # type: ignore[no-untyped-def]
) -> None:
    node = await make_node(cgroups=True, agent=False)  # no toolkit hook on this node
    agent = await node.start_agent(limits=True, verify_only=True)
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    with pytest.raises(NriRuntimeError, match="the driver holds no limit"):
        await node.runtime.start_container(created.id)
    assert agent.limits is not None
    booked = agent.limits.get(created.id)
    assert booked is not None and not booked.in_force
    assert node.driver().held() == {}  # verify-only: the agent set nothing itself


async def test_with_the_toolkit_hook_a_verify_only_node_reads_back_what_the_hook_set(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(cgroups=True, agent=False, toolkit_hook=True)
    agent = await node.start_agent(limits=True, verify_only=True)
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    await node.runtime.start_container(created.id)
    assert agent.limits is not None
    booked = agent.limits.get(created.id)
    assert booked is not None and booked.in_force, booked.describe()


async def test_plural_or_user_set_variables_in_a_manifest_never_change_what_is_in_force(make_node) -> None:  # type: ignore[no-untyped-def]
    """NVIDIA's operator once injected ``NVIDIA_GPU_MEMORY_LIMITS`` (plural), which the hook ignores. A
    manifest that sets plural names, or the singular ones wider than its plan, gets the plan: the agent
    replaces the singular ones, the hook reads only those, and the read-back checks the plan's values."""
    node = await make_node(cgroups=True, agent=False, toolkit_hook=True)
    agent = await node.start_agent(limits=True, verify_only=True)
    pod = await node.pod(FRACTION)
    wider = str(80 * 1024)
    created = await node.create(
        pod,
        "app",
        env={
            "NVIDIA_GPU_MEMORY_LIMITS": wider,
            "NVIDIA_GPU_MEMORY_REQUESTS": wider,
            "NVIDIA_GPU_MEMORY_LIMIT": wider,
        },
    )
    assert (
        created.env["NVIDIA_GPU_MEMORY_LIMIT"] == "6144" and created.env["NVIDIA_GPU_MEMORY_LIMITS"] == wider
    )
    await node.runtime.start_container(created.id)
    assert held(node, created.id, pod) == {GPU_A: (4096 * MIB, 6144 * MIB), GPU_B: (4096 * MIB, 6144 * MIB)}
    assert agent.limits is not None
    booked = agent.limits.get(created.id)
    assert booked is not None and booked.in_force


async def test_a_limit_the_hook_lost_is_reported_by_the_audit_and_never_set_in_verify_mode(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(cgroups=True, agent=False, toolkit_hook=True)
    agent = await node.start_agent(limits=True, verify_only=True)
    pod = await node.pod(FRACTION)
    created = await node.create(pod, "app")
    await node.runtime.start_container(created.id)
    assert node.runtime.cgroup_root is not None
    cgroup = str(node.runtime.cgroup_root / "kubepods" / f"pod{pod}" / created.id)
    node.driver().tamper(gpu=GPU_A, cgroup=cgroup)
    assert agent.limits is not None
    (lost,) = agent.limits.audit()
    assert lost.record.container_id == created.id
    assert [e[2] for e in agent.events.emitted] == [REASON_NOT_ENFORCED]
    assert agent.limits.audit() == []  # said once while it lasts
    booked = agent.limits.get(created.id)
    assert booked is not None and not booked.in_force
    assert GPU_A not in held(node, created.id, pod)  # verify-only: not set again
