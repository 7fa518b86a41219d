"""Events whose write fails for a reason that may pass are tried again; a refusal is not (kube.events).

The failures are injected at the recorder's one write call (``create_object``); every write that gets
through goes to the real API server, and the test reads the Events back from it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod

from gpufrac.kube import events as events_module
from gpufrac.kube.errors import KubeError
from gpufrac.kube.events import MAX_TRIES, WARNING, EventRecorder, ObjectRef


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


def failing_first(count: int, error: Callable[[], Exception], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the recorder's first ``count`` writes fail with ``error()``; the rest reach the server.
    Returns the outcome of each write, in order."""
    real: Callable[..., Awaitable[Any]] = events_module.create_object
    outcomes: list[str] = []

    async def create_object(client: AsyncClient, obj: Any, **kwargs: Any) -> Any:
        if len(outcomes) < count:
            outcomes.append("failed")
            raise error()
        outcomes.append("sent")
        return await real(client, obj, **kwargs)

    monkeypatch.setattr(events_module, "create_object", create_object)
    return outcomes


async def victim_ref(client: AsyncClient, namespace: str) -> ObjectRef:
    pod = await client.create(
        Pod(
            metadata=ObjectMeta(name="victim", namespace=namespace),
            spec=PodSpec(containers=[Container(name="app", image="busybox")], schedulerName="nobody"),
        )
    )
    return ObjectRef(kind="Pod", namespace=namespace, name="victim", uid=pod.metadata.uid)


@contextlib.asynccontextmanager
async def running(client: AsyncClient, *, retry_initial_s: float) -> AsyncIterator[EventRecorder]:
    """A recorder writing with one worker, a fast retry, stopped when the block ends."""
    recorder = EventRecorder(
        client=client, component="gpufrac-test", instance="t1", workers=1, retry_initial_s=retry_initial_s
    )
    task = asyncio.create_task(recorder.run())
    try:
        yield recorder
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def settled(recorder: EventRecorder, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while recorder.pending and loop.time() < deadline:
        await asyncio.sleep(0.02)
    assert recorder.pending == 0, "every Event written or given up"


async def events_in(client: AsyncClient, namespace: str) -> list[tuple[str, str]]:
    return sorted((e.reason, e.message) for e in [e async for e in client.list(Event, namespace=namespace)])


@pytest.mark.parametrize(
    "error",
    [
        lambda: TimeoutError("no answer"),
        lambda: ConnectionResetError("connection reset by peer"),
        lambda: KubeError("too many requests, please try again later", code=429, reason="TooManyRequests"),
        lambda: KubeError("etcdserver: request timed out", code=500, reason="InternalError"),
    ],
    ids=["timeout", "reset", "429", "500"],
)
async def test_a_preemption_event_whose_writes_fail_for_a_passing_reason_is_written_once(
    client: AsyncClient, namespace: str, monkeypatch: pytest.MonkeyPatch, error: Callable[[], Exception]
) -> None:
    outcomes = failing_first(2, error, monkeypatch)
    ref = await victim_ref(client, namespace)
    async with running(client, retry_initial_s=0.05) as recorder:
        recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="by p")
        await settled(recorder)
        assert outcomes == ["failed", "failed", "sent"]
        assert await events_in(client, namespace) == [("Preempted", "by p")]
        assert (recorder.failed, recorder.dropped) == (0, 0)


async def test_a_refused_event_is_not_tried_again_and_is_counted(
    client: AsyncClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = failing_first(
        1, lambda: KubeError("Event is invalid", code=422, reason="Invalid"), monkeypatch
    )
    ref = await victim_ref(client, namespace)
    async with running(client, retry_initial_s=0.05) as recorder:
        recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="refused")
        await settled(recorder)
        recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="next")
        await settled(recorder)
        assert outcomes == ["failed", "sent"]  # the refused one once, then the next Event
        assert await events_in(client, namespace) == [("Preempted", "next")]
        assert recorder.failed == 1


async def test_an_event_failing_every_try_is_given_up_after_max_tries_and_counted(
    client: AsyncClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = failing_first(MAX_TRIES, lambda: TimeoutError("no answer"), monkeypatch)
    ref = await victim_ref(client, namespace)
    async with running(client, retry_initial_s=0.01) as recorder:
        recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="lost")
        await settled(recorder)
        assert outcomes == ["failed"] * MAX_TRIES
        assert await events_in(client, namespace) == []
        assert recorder.failed == 1


async def test_a_full_queue_gives_up_a_repeated_warning_for_a_victims_event_never_the_victims(
    client: AsyncClient, namespace: str
) -> None:
    """A burst's FailedScheduling warnings can fill the queue with nothing routine held back to give up:
    a kept Event (a victim's ``Preempted``) then takes the oldest warning's place; a warning finding the
    queue full of kept Events is dropped itself."""
    ref = await victim_ref(client, namespace)
    recorder = EventRecorder(client=client, component="gpufrac-test", instance="t1", workers=1, queue_size=2)
    # Nothing writes yet: the queue fills as it would while the writers are behind.
    recorder.emit(regarding=ref, type=WARNING, reason="FailedScheduling", message="0/3 nodes (1)")
    recorder.emit(regarding=ref, type=WARNING, reason="FailedScheduling", message="0/3 nodes (2)")
    recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="by p", keep=True)
    recorder.emit(regarding=ref, type=WARNING, reason="Preempted", message="by q", keep=True)
    recorder.emit(regarding=ref, type=WARNING, reason="FailedScheduling", message="0/3 nodes (3)")
    assert recorder.dropped == 3 and recorder.pending == 2
    task = asyncio.create_task(recorder.run())
    try:
        await settled(recorder)
        assert await events_in(client, namespace) == [("Preempted", "by p"), ("Preempted", "by q")]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
