"""The scheduler service in-process against the real API server: what a user sees on pods and nodes.

Every check reads the API objects (annotations, conditions, Events, the binding), never the scheduler's
memory, except where the test compares the two (metrics against the audit).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Pod
from prometheus_client.parser import text_string_to_metric_families
from sched_harness import (
    Pool,
    add_nodes,
    audit_pool,
    condition,
    gpu_pod,
    metric,
    nodes_of,
    pods_of,
    running,
    scheduled_events,
    scrape,
    set_agent_heartbeat,
    wait_bound,
    wait_for,
)

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.kube.patch import set_annotations
from gpufrac.local.simnodes import GPU_MODELS, NodeShape
from gpufrac.placement.decision import (
    ContainerPlacement,
    Decision,
    DeviceAssignment,
    Placement,
    Unschedulable,
)
from gpufrac.placement.model import NodeSelectorRequirement, NodeSelectorTerm, PendingPod, SelectorOperator
from gpufrac.scheduler import service as service_module
from gpufrac.scheduler.binder import binding_annotations
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.cycle import CycleItem, PostFilterResult
from gpufrac.scheduler.objects import gpu_request, node_inventory
from gpufrac.scheduler.placement_engine import PlacementEngine, build_engine
from gpufrac.scheduler.service import SchedulerService

pytestmark = pytest.mark.kube

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
H100 = GPU_MODELS["H100-80GB"]


def example(pool: Pool, file: str) -> Pod:
    body = yaml.safe_load((EXAMPLES / file).read_text())
    body["metadata"]["namespace"] = pool.namespace
    body["spec"]["schedulerName"] = pool.scheduler_name
    return Pod.from_dict(body)


def allocated(text: str, *, node: str, gpu: str) -> float:
    """The exported guaranteed MiB on one GPU."""
    return metric(text, "gpufrac_scheduler_gpu_memory_allocated_mib", node=node, gpu=gpu)


async def test_reference_examples_are_bound_with_the_contract_annotations(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=2)
    async with running(client, pool.config()) as service:
        await client.create(example(pool, "inference-sm-sharing.yaml"))
        await client.create(example(pool, "notebook-time-slicing.yaml"))
        pods = {p.metadata.name: p for p in await wait_bound(client, pool.namespace, 2, timeout=30)}
        nodes = {n.metadata.name: n for n in await nodes_of(client, pool)}

        inference = pods["inference"].metadata.annotations
        inference_gpus = inference[keys.devices_key("app")].split(",")
        on_node = {g.uuid for g in node_inventory(nodes[pods["inference"].spec.nodeName])}
        assert len(set(inference_gpus)) == 4 and set(inference_gpus) <= on_node
        assert inference[keys.memory_request_key("app")] == "40960Mi"
        assert inference[keys.memory_limit_key("app")] == "61440Mi"
        assert float(inference[keys.compute_portion_key("app")]) == pytest.approx(40960 / H100, abs=1e-6)

        notebook = pods["notebook"].metadata.annotations
        notebook_gpus = notebook[keys.devices_key("app")].split(",")
        assert len(set(notebook_gpus)) == 2
        assert notebook[keys.memory_request_key("app")] == f"{math.floor(0.5 * H100)}Mi"
        assert notebook[keys.memory_limit_key("app")] == f"{math.floor(0.8 * H100)}Mi"
        assert keys.compute_portion_key("app") not in notebook  # time-slicing reserves no compute
        assert not set(notebook_gpus) & set(inference_gpus)  # modes never share a GPU

        for pod in pods.values():
            assert condition(pod)[0] == "True"

        # Scheduled Events follow the binds (they wait while binds are in flight): wait for them.
        async def both_reported() -> bool:
            events = await scheduled_events(client, pool.namespace)
            return len(events) >= 2

        await wait_for(both_reported, timeout=20, what="two Scheduled Events")
        events = await scheduled_events(client, pool.namespace)
        assert sorted(e.involvedObject.name for e in events) == ["inference", "notebook"]
        assert all(e.message.startswith(f"Successfully assigned {pool.namespace}/") for e in events)

        async with httpx2.AsyncClient() as http:
            for path, body in (("/healthz", "ok: running\n"), ("/readyz", "ok: leading\n")):
                answer = await http.get(f"http://127.0.0.1:{service.probe_port}{path}")
                assert (answer.status_code, answer.text) == (200, body)
        text = await scrape(service.probe_port)
        assert metric(text, "gpufrac_scheduler_schedule_attempts_total", result="scheduled") == 2
        assert metric(text, "gpufrac_scheduler_leader") == 1
        assert allocated(text, node=pods["inference"].spec.nodeName, gpu=inference_gpus[0]) == 40960
        assert metric(text, "gpufrac_scheduler_events_pending") == 0  # both Events were written
        assert metric(text, "gpufrac_scheduler_events_dropped") == 0
        assert metric(text, "gpufrac_scheduler_events_failed") == 0
        assert metric(text, "python_gc_collections_total", generation="0") >= 0  # the collector's passes
        assert metric(text, "gpufrac_event_loop_lag_seconds_count") > 0  # the loop's timer has been sampled
        async with httpx2.AsyncClient() as http:
            answer = await http.get(
                f"http://127.0.0.1:{service.probe_port}/metrics",
                params={"name[]": "gpufrac_scheduler_leader"},
            )
        families = [f.name for f in text_string_to_metric_families(answer.text)]
        assert families == ["gpufrac_scheduler_leader"]  # a scrape by name skips the per-GPU series
    assert (await audit_pool(client, pool)).ok


async def test_readyz_waits_for_the_queue_informers(
    client: AsyncClient, pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica is ready only once it has read the queues too: while the API server is slow to answer
    the Queue probe, /readyz says not ready although every other informer has synced."""
    config = pool.config()
    service = SchedulerService(client=client, config=config, engine=build_engine(config))
    directory = service.queue_directory
    probing, answered = asyncio.Event(), asyncio.Event()
    real_probe = directory._installed

    async def slow_probe(resource: type) -> bool:
        probing.set()
        await answered.wait()
        return await real_probe(resource)

    monkeypatch.setattr(directory, "_installed", slow_probe)
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(probing.wait(), timeout=20)

        async def informers_synced() -> bool:
            return all(
                i.synced.is_set()
                for i in (service.pods, service.pod_watch.namespaces, service.node_watch.nodes)
            )

        await wait_for(informers_synced, timeout=20, what="the pod and node informers synced")
        async with httpx2.AsyncClient() as http:
            answer = await http.get(f"http://127.0.0.1:{service.probe_port}/readyz")
            assert answer.status_code == 503 and not service.synced
            answered.set()
            await service.wait_scheduling(timeout=30)
            answer = await http.get(f"http://127.0.0.1:{service.probe_port}/readyz")
            assert (answer.status_code, answer.text) == (200, "ok: leading\n")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_unschedulable_pod_says_why_and_is_placed_when_a_node_that_fits_arrives(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1)
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "big", {keys.memory_request_key("app"): "100Gi"}))

        async def reported() -> bool:
            pod = await client.get(Pod, "big", namespace=pool.namespace)
            return condition(pod)[0] == "False"

        await wait_for(reported, timeout=20, what="PodScheduled=False")
        pod = await client.get(Pod, "big", namespace=pool.namespace)
        assert condition(pod) == (
            "False",
            "Unschedulable",
            "0/1 nodes are available: 1 insufficient GPU memory.",
        )
        events = [
            e async for e in client.list(Event, namespace=pool.namespace) if e.reason == "FailedScheduling"
        ]
        assert [(e.type, e.message) for e in events] == [
            ("Warning", "0/1 nodes are available: 1 insufficient GPU memory.")
        ]

        await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1, model="H200-141GB"), prefix="big")
        pods = await wait_bound(client, pool.namespace, 1, timeout=20)
        assert pods[0].spec.nodeName.startswith(f"{pool.id}-big-")
        assert condition(pods[0])[0] == "True"


async def test_an_invalid_pod_that_slipped_past_admission_is_reported_not_fatal(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1)
    bad = {"gpu-fraction": "1.5"}
    with pytest.raises(InvalidPodRequest) as contract:
        parse_pod(bad, [ContainerSpec(name="app")])
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "bad", bad))
        await client.create(gpu_pod(pool, "good", {"gpu-fraction": "0.5"}))
        await wait_bound(client, pool.namespace, 1, timeout=20)

        async def reported() -> bool:
            pod = await client.get(Pod, "bad", namespace=pool.namespace)
            return condition(pod)[0] == "False"

        await wait_for(reported, timeout=20, what="bad pod reported")
        pod = await client.get(Pod, "bad", namespace=pool.namespace)
        assert condition(pod) == ("False", "Unschedulable", str(contract.value))
        assert not pod.spec.nodeName

        # The user fixes the pod (as an operator would with kubectl annotate): it is placed.
        await set_annotations(
            client, Pod, name="bad", namespace=pool.namespace, annotations={"gpu-fraction": "0.4"}
        )
        pods = await wait_bound(client, pool.namespace, 2, timeout=20)
        assert all(p.spec.nodeName for p in pods)


async def test_a_restart_rebuilds_the_ledgers_and_cleans_a_half_bound_pod(
    client: AsyncClient, pool: Pool
) -> None:
    (node,) = await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2))
    half = {"gpu-fraction": "0.5"}
    async with running(client, pool.config()):
        for name in ("a1", "a2"):
            await client.create(gpu_pod(pool, name, half))
        await wait_bound(client, pool.namespace, 2, timeout=20)

    # While no scheduler runs, a binder dies between its two writes: devices annotated, no node.
    orphan = await client.create(gpu_pod(pool, "orphan", half))
    request = gpu_request(orphan)
    nodes = await nodes_of(client, pool)
    free_gpu = sorted(g.uuid for g in node_inventory(nodes[0]))[0]
    c = request.containers[0]
    stale = binding_annotations(
        request,
        Placement(
            pod_uid=orphan.metadata.uid,
            node=node,
            containers=(
                ContainerPlacement(
                    "app",
                    c.mode,
                    False,
                    (DeviceAssignment(free_gpu, 0, c.request_mib(H100), c.limit_mib(H100), None),),
                ),
            ),
        ),
        device_style="uuid",
    )
    await set_annotations(client, Pod, name="orphan", namespace=pool.namespace, annotations=dict(stale))

    async with running(client, pool.config()) as service:
        for name in ("b1", "b2", "b3"):
            await client.create(gpu_pod(pool, name, half))
        # 2 GPUs hold 4 halves: a1 and a2 keep theirs, two of the four newcomers get the rest.
        await wait_bound(client, pool.namespace, 4, timeout=30)

        async def settled() -> bool:
            pods = await pods_of(client, pool.namespace)
            return all(p.spec.nodeName or condition(p)[0] == "False" for p in pods)

        await wait_for(settled, timeout=20, what="every pod bound or reported")
        pods = {p.metadata.name: p for p in await pods_of(client, pool.namespace)}
        assert pods["a1"].spec.nodeName == node and pods["a2"].spec.nodeName == node
        assert sum(1 for p in pods.values() if p.spec.nodeName) == 4
        for p in pods.values():
            if not p.spec.nodeName:
                assert keys.devices_key("app") not in (p.metadata.annotations or {})
                assert condition(p)[2] == "0/1 nodes are available: 1 insufficient GPU memory."
        assert service.bound_total == 2
    report = await audit_pool(client, pool)
    assert report.ok, report.problems
    assert report.placed_pods == 4


def mixed_pod(pool: Pool, i: int, namespace: str) -> Pod:
    kind = i % 20
    annotations: dict[str, str]
    whole = 0
    if kind < 8:
        annotations = {"gpu-fraction": "0.25"}
    elif kind < 12:
        annotations = {"gpu-memory": "8192"}
    elif kind < 16:
        annotations = {
            keys.memory_request_key("app"): "10Gi",
            keys.memory_limit_key("app"): "20Gi",
            keys.compute_mode_key("app"): "sm-sharing",
        }
    elif kind < 18:
        annotations = {"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}
    elif kind == 18:
        annotations, whole = {}, 1
    else:
        annotations = {"gpu-fraction": "0.1", keys.compute_mode_key("app"): "sm-sharing"}
    return gpu_pod(pool, f"m{i:03d}", annotations, namespace=namespace, whole_gpus=whole)


async def test_a_burst_of_500_mixed_pods_on_20_nodes_never_overcommits_nor_mixes_modes(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=20)
    namespaces = [pool.namespace, f"{pool.namespace}-b", f"{pool.namespace}-c"]
    for ns in namespaces[1:]:
        await client.create(Namespace(metadata=ObjectMeta(name=ns)))
    async with running(client, pool.config()) as service:
        gate = asyncio.Semaphore(32)

        async def create(i: int) -> None:
            async with gate:
                await client.create(mixed_pod(pool, i, namespaces[i % 3]))

        await asyncio.gather(*(create(i) for i in range(500)))

        async def all_bound() -> bool:
            return service.bound_total >= 500

        await wait_for(all_bound, timeout=120, interval=0.5, what="500 pods bound")
        report = await audit_pool(client, pool, namespaces)
        assert report.ok, report.problems[:10]
        assert report.placed_pods == 500
        pods = [p for ns in namespaces for p in await pods_of(client, ns)]
        assert all(p.spec.nodeName for p in pods)

        # The scheduler's ledgers, as exported, agree with the API objects.
        text = await scrape(service.probe_port)
        assert metric(text, "gpufrac_scheduler_schedule_attempts_total", result="scheduled") == 500
        for uuid, booking in report.gpus.items():
            assert allocated(text, node=booking.node, gpu=uuid) == booking.request_mib


class _FailsOn:
    """The real engine, except that placing the pod named ``name`` raises: a stand-in for an engine bug
    that one pod's data triggers (none is known; the service must survive the next one)."""

    def __init__(self, engine: PlacementEngine, name: str) -> None:
        self._engine = engine
        self._name = name

    def schedule(
        self, pods: Sequence[PendingPod], *, gang: bool = False, min_member: int | None = None
    ) -> list[Decision]:
        if any(p.name == self._name for p in pods):
            raise ZeroDivisionError(f"injected engine failure on {self._name}")
        return self._engine.schedule(pods, gang=gang, min_member=min_member)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


async def test_a_pod_the_scheduler_fails_on_is_reported_and_every_other_pod_is_placed(
    client: AsyncClient, pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading or placing one pod raised out of the scheduling loop, and the scheduler exited (a
    5000-digit quantity did it, crash-looping the scheduler while the pod was pending)."""
    real_parse = service_module.gpu_request

    def parse(pod: Pod) -> Any:
        if pod.metadata.name == "poison-read":
            raise KeyError("injected parser failure")
        return real_parse(pod)

    monkeypatch.setattr(service_module, "gpu_request", parse)
    await add_nodes(client, pool, count=1)
    config = pool.config(batch_window_ms=200)  # the poison pods and the good ones in one batch
    async with running(client, config, engine=_FailsOn(build_engine(config), "poison-place")) as service:
        half = {"gpu-fraction": "0.5"}
        huge = {keys.memory_request_key("app"): "1" + "0" * 5000}
        pods_in = [
            ("poison-read", half),
            ("good-1", half),
            ("poison-place", half),
            ("huge", huge),
            ("good-2", half),
        ]
        await asyncio.gather(*(client.create(gpu_pod(pool, name, notes)) for name, notes in pods_in))

        async def all_answered() -> bool:
            pods = await pods_of(client, pool.namespace)
            return all(p.spec.nodeName or condition(p)[0] == "False" for p in pods)

        await wait_for(all_answered, timeout=30, what="every pod bound or reported")
        pods = {p.metadata.name: p for p in await pods_of(client, pool.namespace)}
        assert pods["good-1"].spec.nodeName and pods["good-2"].spec.nodeName
        assert condition(pods["poison-read"]) == (
            "False",
            "SchedulerError",
            "the scheduler failed reading this pod (KeyError: 'injected parser failure'); "
            "it is tried again when the cluster changes",
        )
        assert condition(pods["poison-place"]) == (
            "False",
            "SchedulerError",
            "the scheduler failed placing this pod (ZeroDivisionError: injected engine failure on "
            "poison-place); it is tried again when the cluster changes",
        )
        # However the contract answers a 5000-digit quantity, the pod is told, and nothing else stops.
        assert condition(pods["huge"])[0] == "False" and not pods["huge"].spec.nodeName
        assert len(condition(pods["huge"])[2]) < 1000
        text = await scrape(service.probe_port)
        assert metric(text, "gpufrac_scheduler_schedule_attempts_total", result="scheduled") == 2


async def test_a_pod_naming_a_queue_that_is_not_configured_stays_pending_and_says_so(
    client: AsyncClient, pool: Pool
) -> None:
    """An unknown queue label used to give an unlimited queue: a tenant escaped its cap by relabelling."""
    await add_nodes(client, pool, count=1)
    config = pool.config(queues=[{"name": "default"}, {"name": "capped", "gpu_memory_limit_mib": 100_000}])
    half = {"gpu-fraction": "0.5"}
    async with running(client, config):
        await client.create(gpu_pod(pool, "mine", half, labels={keys.QUEUE_LABEL: "escape"}))
        await client.create(gpu_pod(pool, "kai", half, labels={keys.KAI_QUEUE_LABEL: "elsewhere"}))
        await client.create(gpu_pod(pool, "unlabelled", half))
        await wait_bound(client, pool.namespace, 1, timeout=20)

        async def reported() -> bool:
            pods = await pods_of(client, pool.namespace)
            return all(p.spec.nodeName or condition(p)[0] == "False" for p in pods)

        await wait_for(reported, timeout=20, what="the unknown queues reported")
        pods = {p.metadata.name: p for p in await pods_of(client, pool.namespace)}
        assert pods["unlabelled"].spec.nodeName  # no label: the default queue, as before
        assert condition(pods["mine"]) == (
            "False",
            "Unschedulable",
            "queue escape (label gpufrac.io/queue) is not configured",
        )
        assert condition(pods["kai"]) == (
            "False",
            "Unschedulable",
            "queue elsewhere (label kai.scheduler/queue) is not configured",
        )
        assert not pods["mine"].spec.nodeName and not pods["kai"].spec.nodeName

        # Relabelled into a configured queue, the pod is placed under that queue's cap.
        await client.patch(
            Pod, "mine", {"metadata": {"labels": {keys.QUEUE_LABEL: "capped"}}}, namespace=pool.namespace
        )
        pods_now = await wait_bound(client, pool.namespace, 2, timeout=20)
        assert {p.metadata.name for p in pods_now if p.spec.nodeName} == {"unlabelled", "mine"}


async def test_a_node_whose_agent_heartbeat_is_old_takes_no_pod_until_the_heartbeat_is_refreshed(
    client: AsyncClient, pool: Pool
) -> None:
    """A SIGKILLed node agent left its condition True for ever, and pods were placed on its node
    without any enforcement. The heartbeat in that condition is now read, with an expiry."""
    (node,) = await add_nodes(client, pool, count=1)
    await set_agent_heartbeat(client, node, datetime.now(UTC) - timedelta(hours=1))
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "p", {"gpu-fraction": "0.5"}))

        async def reported() -> bool:
            return condition(await client.get(Pod, "p", namespace=pool.namespace))[0] == "False"

        await wait_for(reported, timeout=20, what="PodScheduled=False")
        pod = await client.get(Pod, "p", namespace=pool.namespace)
        assert condition(pod) == (
            "False",
            "Unschedulable",
            "0/1 nodes are available: 1 node agent heartbeat(s) expired.",
        )
        await set_agent_heartbeat(client, node, datetime.now(UTC))
        (bound,) = await wait_bound(client, pool.namespace, 1, timeout=20)
        assert bound.spec.nodeName == node


async def test_a_node_expires_when_its_agent_stops_heartbeating_and_comes_back_when_it_resumes(
    client: AsyncClient, pool: Pool
) -> None:
    """Expiry is time passing, with no API event: the scheduler re-evaluates on its own."""
    (node,) = await add_nodes(client, pool, count=1)

    async def agent() -> None:  # the node agent's heartbeat, every second
        while True:
            await set_agent_heartbeat(client, node, datetime.now(UTC))
            await asyncio.sleep(1.0)

    async def expired_nodes(port: int) -> float:
        return metric(await scrape(port), "gpufrac_scheduler_nodes_heartbeat_expired")

    heartbeat = asyncio.create_task(agent())
    try:
        async with running(client, pool.config(node_heartbeat_expiry_s=6)) as service:
            await client.create(gpu_pod(pool, "while-alive", {"gpu-fraction": "0.25"}))
            await wait_bound(client, pool.namespace, 1, timeout=20)
            assert await expired_nodes(service.probe_port) == 0

            heartbeat.cancel()  # the agent is SIGKILLed: nothing writes the Node any more
            await asyncio.gather(heartbeat, return_exceptions=True)

            async def expired() -> bool:
                return await expired_nodes(service.probe_port) == 1

            await wait_for(expired, timeout=20, what="the heartbeat expired")
            await client.create(gpu_pod(pool, "while-dead", {"gpu-fraction": "0.25"}))

            async def reported() -> bool:
                return condition(await client.get(Pod, "while-dead", namespace=pool.namespace))[0] == "False"

            await wait_for(reported, timeout=20, what="PodScheduled=False")
            pod = await client.get(Pod, "while-dead", namespace=pool.namespace)
            assert condition(pod)[2] == "0/1 nodes are available: 1 node agent heartbeat(s) expired."

            heartbeat = asyncio.create_task(agent())  # the agent restarts
            pods = await wait_bound(client, pool.namespace, 2, timeout=20)
            assert all(p.spec.nodeName == node for p in pods)
            assert await expired_nodes(service.probe_port) == 0
    finally:
        heartbeat.cancel()
        await asyncio.gather(heartbeat, return_exceptions=True)


class _OnlyNode:
    """A PodFilter: pods labelled ``pin`` may only go to the node the label names; ``deny`` may go
    nowhere (with a sentence)."""

    def narrow(self, pending: PendingPod, pod: Pod, cache: BookingCache) -> PendingPod | str:
        labels = pod.metadata.labels or {}
        if "deny" in labels:
            return "denied by the test filter"
        if "pin" in labels:
            term = NodeSelectorTerm(
                (NodeSelectorRequirement("kubernetes.io/hostname", SelectorOperator.IN, (labels["pin"],)),)
            )
            return replace(pending, affinity=(*pending.affinity, term))
        return pending


class _TakesBig:
    """A PostFilter (the preemption step's seat): takes the pod named ``big`` in hand."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.called = asyncio.Event()

    def post_filter(
        self, item: CycleItem, decision: Unschedulable, cache: BookingCache
    ) -> PostFilterResult | None:
        self.seen.append((item.pending.name, decision.message))
        self.called.set()
        return PostFilterResult() if item.pending.name == "big" else None


async def test_filters_narrow_where_a_pod_goes_and_the_post_filter_gets_the_pods_that_fit_nowhere(
    client: AsyncClient, pool: Pool
) -> None:
    """The extension points other modules plug into (pod affinity filters, preemption)."""
    nodes = await add_nodes(client, pool, count=2)
    pins = [nodes[0], nodes[1], nodes[0]]  # left alone, the policy would put all three on one node
    post = _TakesBig()
    config = pool.config()
    service = SchedulerService(
        client=client, config=config, engine=build_engine(config), filters=[_OnlyNode()], post_filter=post
    )
    task = asyncio.create_task(service.run())
    try:
        await service.wait_scheduling(timeout=30)
        for i, pin in enumerate(pins):
            await client.create(gpu_pod(pool, f"pinned-{i}", {"gpu-fraction": "0.25"}, labels={"pin": pin}))
        await client.create(gpu_pod(pool, "denied", {"gpu-fraction": "0.25"}, labels={"deny": "yes"}))
        await client.create(gpu_pod(pool, "big", {keys.memory_request_key("app"): "100Gi"}))
        await wait_bound(client, pool.namespace, 3, timeout=30)

        async def denied_reported() -> bool:
            return condition(await client.get(Pod, "denied", namespace=pool.namespace))[0] == "False"

        await wait_for(denied_reported, timeout=20, what="the denied pod reported")
        await asyncio.wait_for(post.called.wait(), timeout=20)
        pods = {p.metadata.name: p for p in await pods_of(client, pool.namespace)}
        assert [pods[f"pinned-{i}"].spec.nodeName for i in range(3)] == pins
        assert condition(pods["denied"]) == ("False", "Unschedulable", "denied by the test filter")
        assert ("big", "0/2 nodes are available: 2 insufficient GPU memory.") in post.seen
        assert not pods["big"].spec.nodeName
        assert pods["big"].metadata.uid in service.queue  # parked by the post filter, waiting for a change
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
