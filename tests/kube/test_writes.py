"""Preconditioned patches, pod conditions, the Binding subresource and Events on the real API server."""

from __future__ import annotations

import asyncio

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod

from gpufrac.kube.binding import bind_pod
from gpufrac.kube.errors import Conflict, KubeError, NotFound
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from gpufrac.kube.patch import merge_patch_version, set_annotations, set_pod_condition
from gpufrac.kube.stream import Selection, watch_objects
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


async def new_pod(client: AsyncClient, namespace: str, name: str = "p") -> Pod:
    return await client.create(
        Pod(
            metadata=ObjectMeta(name=name, namespace=namespace),
            spec=PodSpec(containers=[Container(name="app", image="busybox")], schedulerName="nobody"),
        )
    )


async def pending_settles(recorder: EventRecorder, expected: int, *, timeout_s: float = 10.0) -> bool:
    """Whether the recorder's pending count reaches ``expected``: a written Event is visible to a list
    before the recorder's own create call has returned, so the count can lag the list briefly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while recorder.pending != expected and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return recorder.pending == expected


async def test_a_patch_on_a_stale_version_is_a_typed_conflict(client: AsyncClient, namespace: str) -> None:
    pod = await new_pod(client, namespace)
    stale = pod.metadata.resourceVersion
    fresh = await set_annotations(
        client, Pod, name="p", namespace=namespace, annotations={"a": "1"}, resource_version=stale
    )
    assert fresh.metadata.annotations == {"a": "1"}
    with pytest.raises(Conflict) as raised:
        await set_annotations(
            client, Pod, name="p", namespace=namespace, annotations={"a": "2"}, resource_version=stale
        )
    assert raised.value.code == 409
    removed = await set_annotations(
        client, Pod, name="p", namespace=namespace, annotations={"a": None}, resource_version=None
    )
    assert not removed.metadata.annotations
    with pytest.raises(NotFound):
        await set_annotations(client, Pod, name="nope", namespace=namespace, annotations={"a": "1"})


async def test_binding_honours_its_preconditions_and_binds_once(client: AsyncClient, namespace: str) -> None:
    pod = await new_pod(client, namespace)
    annotated = await set_annotations(client, Pod, name="p", namespace=namespace, annotations={"x": "y"})
    with pytest.raises(Conflict):  # the version the binder annotated is no longer the pod's
        await bind_pod(
            client,
            name="p",
            namespace=namespace,
            node="n1",
            uid=pod.metadata.uid,
            resource_version=pod.metadata.resourceVersion,
        )
    await bind_pod(
        client,
        name="p",
        namespace=namespace,
        node="n1",
        uid=pod.metadata.uid,
        resource_version=annotated.metadata.resourceVersion,
    )
    bound = await client.get(Pod, "p", namespace=namespace)
    assert bound.spec.nodeName == "n1"
    assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]
    with pytest.raises(Conflict):
        await bind_pod(client, name="p", namespace=namespace, node="n2")


async def test_a_binding_can_carry_annotations_written_with_the_node(
    client: AsyncClient, namespace: str
) -> None:
    pod = await new_pod(client, namespace)
    await set_annotations(client, Pod, name="p", namespace=namespace, annotations={"x": "y"})
    with pytest.raises(Conflict):  # stale version: neither the node nor the annotations are written
        await bind_pod(
            client,
            name="p",
            namespace=namespace,
            node="n1",
            uid=pod.metadata.uid,
            resource_version=pod.metadata.resourceVersion,
            annotations={"devices": "GPU-1"},
        )
    current = await client.get(Pod, "p", namespace=namespace)
    assert not current.spec.nodeName and "devices" not in current.metadata.annotations
    events = watch_objects(
        client,
        Pod,
        selection=Selection(namespace=namespace, fields="metadata.name=p"),
        resource_version=current.metadata.resourceVersion,
        timeout_seconds=10,
    )
    await bind_pod(
        client,
        name="p",
        namespace=namespace,
        node="n1",
        uid=pod.metadata.uid,
        resource_version=current.metadata.resourceVersion,
        annotations={"devices": "GPU-1"},
    )
    # The first change anyone watching sees has both: never annotated-but-unbound, never bound-bare.
    first = await anext(events)
    await events.aclose()
    assert first.type == "MODIFIED"
    assert first.object.spec.nodeName == "n1"
    assert first.object.metadata.annotations == {"x": "y", "devices": "GPU-1"}


async def test_pod_condition_is_merged_by_type(client: AsyncClient, namespace: str) -> None:
    await new_pod(client, namespace)
    for message in ("first", "second"):
        await set_pod_condition(
            client,
            name="p",
            namespace=namespace,
            type="PodScheduled",
            status="False",
            reason="Unschedulable",
            message=message,
        )
    pod = await client.get(Pod, "p", namespace=namespace)
    assert [(c.type, c.status, c.reason, c.message) for c in pod.status.conditions] == [
        ("PodScheduled", "False", "Unschedulable", "second")
    ]


async def test_a_pod_condition_about_an_older_pod_never_lands_on_a_bound_one(
    client: AsyncClient, namespace: str
) -> None:
    """The scheduler's "unschedulable" report races its own later bind; the bind must win."""
    seen = await new_pod(client, namespace)
    await bind_pod(client, name="p", namespace=namespace, node="n1", uid=seen.metadata.uid)
    with pytest.raises(Conflict):
        await set_pod_condition(
            client,
            name="p",
            namespace=namespace,
            type="PodScheduled",
            status="False",
            reason="Unschedulable",
            message="0/1 nodes are available",
            resource_version=seen.metadata.resourceVersion,
        )
    pod = await client.get(Pod, "p", namespace=namespace)
    assert pod.spec.nodeName == "n1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]


async def test_repeated_events_are_aggregated_into_one_with_a_count(
    client: AsyncClient, namespace: str
) -> None:
    pod = await new_pod(client, namespace)
    recorder = EventRecorder(client=client, component="gpufrac-test", instance="t1", workers=1)
    task = asyncio.create_task(recorder.run())
    ref = ObjectRef(kind="Pod", namespace=namespace, name="p", uid=pod.metadata.uid)
    try:
        for _ in range(3):
            recorder.emit(regarding=ref, type=WARNING, reason="FailedScheduling", message="0/3 nodes")
        recorder.emit(regarding=ref, type=WARNING, reason="FailedScheduling", message="0/4 nodes")
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if sorted((e.message, e.count) for e in events) == [("0/3 nodes", 3), ("0/4 nodes", 1)]:
                break
            await asyncio.sleep(0.05)
        assert sorted((e.message, e.count) for e in events) == [("0/3 nodes", 3), ("0/4 nodes", 1)]
        assert {(e.involvedObject.uid, e.reportingComponent, e.reportingInstance) for e in events} == {
            (pod.metadata.uid, "gpufrac-test", "t1")
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_events_wait_while_the_recorder_yields_and_are_written_once_it_stops(
    client: AsyncClient, namespace: str
) -> None:
    """The scheduler's Scheduled Events yield to a burst being bound, so its writes go to binds first;
    an Event emitted without ``yields`` (a warning, a preemption) is written all the same."""
    pod = await new_pod(client, namespace)
    busy = True
    asked = asyncio.Event()
    calls = 0

    def binding() -> bool:
        nonlocal calls
        calls += 1
        if calls >= 3:  # the Event is held back and the worker keeps asking
            asked.set()
        return busy

    recorder = EventRecorder(
        client=client, component="gpufrac-test", instance="t1", workers=1, yield_to=binding
    )
    task = asyncio.create_task(recorder.run())
    ref = ObjectRef(kind="Pod", namespace=namespace, name="p", uid=pod.metadata.uid)
    try:
        recorder.emit(regarding=ref, type=NORMAL, reason="Scheduled", message="assigned", yields=True)
        await asyncio.wait_for(asked.wait(), timeout=10)
        assert [e async for e in client.list(Event, namespace=namespace)] == []
        recorder.emit(regarding=ref, type=WARNING, reason="Preempting", message="urgent")
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if events:
                break
            await asyncio.sleep(0.05)
        assert [e.message for e in events] == ["urgent"]  # written while the burst is on
        assert await pending_settles(recorder, 1)  # the Scheduled one, held back
        busy = False
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if len(events) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(e.message for e in events) == ["assigned", "urgent"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_event_held_by_a_burst_that_never_ends_is_written_after_max_hold(
    client: AsyncClient, namespace: str
) -> None:
    """Under load that never stops, an Event still comes, late: the hold is bounded by max_hold_s, and
    until it is written the recorder counts it as pending."""
    pod = await new_pod(client, namespace)
    recorder = EventRecorder(
        client=client,
        component="gpufrac-test",
        instance="t1",
        workers=1,
        yield_to=lambda: True,
        max_hold_s=1.0,
    )
    task = asyncio.create_task(recorder.run())
    ref = ObjectRef(kind="Pod", namespace=namespace, name="p", uid=pod.metadata.uid)
    try:
        recorder.emit(regarding=ref, type=NORMAL, reason="Scheduled", message="assigned late", yields=True)
        assert recorder.pending == 1
        events: list[Event] = []
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if events:
                break
            await asyncio.sleep(0.05)
        assert [e.message for e in events] == ["assigned late"]
        assert await pending_settles(recorder, 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_burst_longer_than_half_the_queue_has_its_events_written_as_it_goes_not_dropped(
    client: AsyncClient, namespace: str
) -> None:
    """At most half the queue is held back: the Events beyond it are written during the burst, late,
    instead of filling the queue and being dropped."""
    pod = await new_pod(client, namespace)
    recorder = EventRecorder(
        client=client,
        component="gpufrac-test",
        instance="t1",
        workers=1,
        queue_size=4,
        yield_to=lambda: True,
        max_hold_s=3600.0,
    )
    task = asyncio.create_task(recorder.run())
    try:
        for i in range(5):
            ref = ObjectRef(kind="Pod", namespace=namespace, name=f"p{i}", uid=pod.metadata.uid)
            recorder.emit(
                regarding=ref, type=NORMAL, reason="Scheduled", message=f"assigned {i}", yields=True
            )
            await asyncio.sleep(0)
        events: list[Event] = []
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if len(events) >= 4:
                break
            await asyncio.sleep(0.05)
        assert sorted(e.message for e in events) == [f"assigned {i}" for i in range(4)]  # oldest first
        assert recorder.dropped == 0
        assert await pending_settles(recorder, 1)  # the newest, still held while the burst goes on
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_patch_answering_the_new_version_is_applied_once_at_the_version_read_on_both_paths(
    controlplane: ControlPlane, client: AsyncClient, namespace: str
) -> None:
    """``merge_patch_version`` (a claim's per-pod writes): the lean path (the admin client) and httpx (a
    client whose own transport impersonates someone, here an admin) apply a patch at the version read,
    answer the object's new version, and refuse a second patch at the old one with a typed Conflict."""
    impersonating = controlplane.async_client(impersonate="someone", groups=["system:masters"])
    try:
        for writer, name in ((client, "lean"), (impersonating, "httpx")):
            pod = await new_pod(client, namespace, name)
            stale = pod.metadata.resourceVersion
            version = await merge_patch_version(
                writer,
                Pod,
                name=name,
                namespace=namespace,
                patch={"metadata": {"labels": {"writer": "first"}}},
                resource_version=stale,
            )
            with pytest.raises(Conflict):
                await merge_patch_version(
                    writer,
                    Pod.Status,
                    name=name,
                    namespace=namespace,
                    patch={"status": {"nominatedNodeName": "n1"}},
                    resource_version=stale,
                )
            read = await client.get(Pod, name, namespace=namespace)
            assert read.metadata.resourceVersion == version != stale, name
            assert read.metadata.labels == {"writer": "first"} and read.status.nominatedNodeName is None, name
            with pytest.raises(NotFound):
                await merge_patch_version(writer, Pod, name="nope", namespace=namespace, patch={})
    finally:
        await impersonating.close()


async def test_a_binding_goes_out_as_the_clients_transport_says(
    controlplane: ControlPlane, client: AsyncClient, namespace: str
) -> None:
    """A client whose transport impersonates a user without rights is refused the Binding: the lean
    write path must not speak as the client's own (admin) identity behind the transport's back."""
    await new_pod(client, namespace)
    nobody = controlplane.async_client(impersonate="system:serviceaccount:default:nobody")
    try:
        with pytest.raises(KubeError) as refused:
            await bind_pod(nobody, name="p", namespace=namespace, node="n1")
    finally:
        await nobody.close()
    assert refused.value.code == 403
    pod = await client.get(Pod, "p", namespace=namespace)
    assert pod.spec is not None and not pod.spec.nodeName


async def test_a_full_queue_drops_a_held_routine_event_rather_than_a_warning(
    client: AsyncClient, namespace: str
) -> None:
    """A burst's routine Events can fill the queue (a 16,000-pod fill's Scheduled ones, held while it
    is bound); a preemption or a warning emitted then still gets written, in place of the oldest held."""
    pod = await new_pod(client, namespace)
    busy = True
    recorder = EventRecorder(
        client=client,
        component="gpufrac-test",
        instance="t1",
        workers=1,
        queue_size=2,
        yield_to=lambda: busy,
        max_hold_s=3600.0,
    )
    ref = ObjectRef(kind="Pod", namespace=namespace, name="p", uid=pod.metadata.uid)
    for i in range(2):
        recorder.emit(regarding=ref, type=NORMAL, reason="Scheduled", message=f"assigned {i}", yields=True)
    recorder.emit(regarding=ref, type=NORMAL, reason="Scheduled", message="assigned 2", yields=True)
    assert recorder.dropped == 1  # a routine one meeting a full queue is dropped
    recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="evicted")
    assert recorder.dropped == 2 and recorder.pending == 2
    busy = False
    task = asyncio.create_task(recorder.run())
    try:
        events: list[Event] = []
        for _ in range(200):
            events = [e async for e in client.list(Event, namespace=namespace)]
            if len(events) >= 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(e.message for e in events) == ["assigned 1", "evicted"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
