"""Runtime and agent restarts: the plugin reconnects by itself and Synchronize rebuilds the mapping."""

from __future__ import annotations

import asyncio

from nri_harness import Node

GPU_A = "GPU-8f3c6a2e-0000-4000-8000-00000000000a"
GPU_B = "GPU-8f3c6a2e-0000-4000-8000-00000000000b"
GPUS = (GPU_A, GPU_B)


def fractional(container: str, device: str, request: str = "2Gi") -> dict[str, str]:
    return {
        f"nvidia.com/container.{container}.gpu-memory.request": request,
        f"nvidia.com/container.{container}.gpus.devices": device,
    }


async def eventually(check, *, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_runtime_restart_reconnects_and_injection_continues(node: Node) -> None:
    pod = await node.pod(fractional("a", GPU_A))
    before = await node.create(pod, "a")
    pid = node.runtime.pid

    await node.runtime.restart()  # every plugin connection drops, as when containerd restarts
    assert node.runtime.pid == pid  # the same process, re-executed: a fresh NRI adaptation
    assert await node.runtime.wait_plugins(1, timeout_s=10) == 1
    await eventually(lambda: node.agent.plugin.sessions == 2)

    # Synchronize told the plugin about the container created before the restart: its record stays.
    assert [r.container_id for r in node.store.allocations()] == [before.id]
    pod2 = await node.pod(fractional("b", GPU_B, "3Gi"))
    after = await node.create(pod2, "b")
    assert after.env["NVIDIA_VISIBLE_DEVICES"] == GPU_B and after.env["NVIDIA_GPU_MEMORY_LIMIT"] == "3072"
    assert sorted(r.container_id for r in node.store.allocations()) == sorted([before.id, after.id])


async def test_agent_restart_rebuilds_the_mapping_from_synchronize(node: Node) -> None:
    kept_pod = await node.pod(fractional("kept", GPU_A, "4Gi"), name="kept")
    kept = await node.create(kept_pod, "kept")
    gone_pod = await node.pod(fractional("gone", GPU_B), name="gone")
    gone = await node.create(gone_pod, "gone")
    assert {r.container_id for r in node.store.allocations()} == {kept.id, gone.id}

    await node.agent.stop()  # the agent is down: the runtime goes on without it
    await node.runtime.restart()
    await node.runtime.stop_container(gone.id)
    await node.runtime.remove_container(gone.id)  # nobody tells the agent
    late_pod = await node.pod(fractional("late", GPU_B, "1Gi"), name="late")
    late = await node.create(late_pod, "late")  # created while the agent was away: not injected
    assert "NVIDIA_VISIBLE_DEVICES" not in late.env

    agent = await node.start_agent()  # reads the stale records left on disk, then connects
    records = {r.container_id: r for r in agent.store.allocations()}
    # Synchronize looks at what each container received: the late one runs bare and is not recorded
    # as enforced; it is reported on its pod and counted instead.
    assert set(records) == {kept.id}
    assert records[kept.id].request_mib == 4096 and records[kept.id].pod_name == "kept"
    agent.store.flush()  # the files are written by the store's background writer (gpufrac.node.mapping)
    assert not (agent.store.directory / f"{gone.id}.json").exists()
    assert list(agent.injector.unenforced) == [late.id]
    assert agent.counters.read().without_injection == 1
    ((regarding, kind, reason, message),) = agent.events.emitted
    assert (regarding.kind, regarding.namespace, regarding.name, regarding.uid) == (
        "Pod",
        "ml",
        "late",
        "uid-" + late_pod[3:],
    )
    assert (kind, reason) == ("Warning", "GpuInjectionMissing")
    assert "ml/late container late runs without the GPU enforcement it needs" in message
    assert "NVIDIA_VISIBLE_DEVICES missing" in message and "NVIDIA_GPU_MEMORY_LIMIT missing" in message

    await node.runtime.restart()  # synchronized again: still counted, not reported twice
    await node.runtime.wait_registrations(1, timeout_s=10)
    assert list(agent.injector.unenforced) == [late.id] and agent.counters.read().without_injection == 1
    assert len(agent.events.emitted) == 1

    await node.runtime.stop_container(late.id)
    await node.runtime.remove_container(late.id)  # the kubelet replaces it; the gauge drops with it
    assert agent.injector.unenforced == {} and agent.counters.read().without_injection == 0


async def test_a_fail_open_container_is_reported_after_an_agent_restart(make_node) -> None:  # type: ignore[no-untyped-def]
    node: Node = await make_node(fail_open=True)
    pod = await node.pod(fractional("c", "all"), name="wide")
    bare = await node.create(pod, "c")  # "all" is refused; fail-open creates it without any GPU
    assert "NVIDIA_VISIBLE_DEVICES" not in bare.env and node.store.allocations() == []
    await node.agent.stop()

    agent = await node.start_agent(fail_open=True)
    assert agent.store.allocations() == [] and list(agent.injector.unenforced) == [bare.id]
    assert [e[2] for e in agent.events.emitted] == ["GpuInjectionMissing"]


async def test_plugin_waits_for_a_runtime_that_is_not_there_yet(make_node) -> None:  # type: ignore[no-untyped-def]
    node: Node = await make_node(agent=False)
    await node.runtime.stop()
    node.socket.unlink(missing_ok=True)
    agent = await node.start_agent(wait=False)
    await asyncio.sleep(0.3)  # a few failed connection attempts, with backoff
    assert agent.plugin.sessions == 0 and agent.plugin.last_error is not None

    await node.runtime.start()
    assert await node.runtime.wait_plugins(1, timeout_s=10) == 1
    pod = await node.pod(fractional("c", GPU_A))
    created = await node.create(pod, "c")
    assert created.env["NVIDIA_GPU_MEMORY_REQUEST"] == "2048"


async def test_synchronize_of_a_large_node_arrives_split_and_is_reassembled(node: Node) -> None:
    # ttrpc messages stop at 4 MiB; a runtime with more state splits Synchronize into parts flagged
    # "more", which a plugin must collect before acting on the whole.
    padding = "x" * 16_000
    ids = []
    for i in range(300):
        annotations = {**fractional("c", GPUS[i % 2], "1Gi"), "example.com/padding": padding}
        pod = await node.pod(annotations, name=f"big-{i}")
        created = await node.create(pod, "c")
        ids.append(created.id)
    await node.agent.stop()
    agent = await node.start_agent()
    assert agent.plugin.last_sync_parts > 1
    assert sorted(r.container_id for r in agent.store.allocations()) == sorted(ids)
