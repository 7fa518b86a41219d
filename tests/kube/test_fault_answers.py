"""gpufrac's Kubernetes layer under the answers the test API server never gives: 429, 5xx, a lost answer,
a watch cut mid-stream (played by tests/apiproxy.py in front of the real API server).

What each test shows is what the layer above relies on: a refused Binding did not happen and says so
with a typed error; a Binding whose answer was lost DID happen, and trying again is refused (409) rather
than applied twice; an informer whose watch is cut or refused still ends with every object; an eviction
the server throttles (429 without a budget's cause) or fails (503) is asked again, while a disruption
budget's 429 is a refusal at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from lightkube import ApiError, AsyncClient
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget

from apiproxy import (
    FaultProxy,
    Rule,
    answer,
    binds,
    cut_watch,
    evictions,
    lose_answer,
    proxied_client,
    watches,
)
from gpufrac.kube.binding import bind_pod
from gpufrac.kube.errors import Conflict, KubeError, TooManyRequests
from gpufrac.kube.eviction import evict_pod
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube


@pytest.fixture
async def direct(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def proxy(controlplane: ControlPlane) -> AsyncIterator[FaultProxy]:
    async with FaultProxy.for_controlplane(controlplane, max_requests=200, lifetime_s=60) as p:
        yield p
    assert p.refused_over_budget == 0


@pytest.fixture
async def through(proxy: FaultProxy) -> AsyncIterator[AsyncClient]:
    client = proxied_client(proxy)
    try:
        yield client
    finally:
        await client.close()


async def pending_pod(client: AsyncClient, namespace: str, name: str) -> Pod:
    pod = Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(containers=[Container(name="app", image="busybox")], schedulerName="nobody"),
    )
    return await client.create(pod)


async def bind(client: AsyncClient, pod: Pod, node: str) -> None:
    await bind_pod(
        client,
        name=pod.metadata.name,
        namespace=pod.metadata.namespace,
        node=node,
        uid=pod.metadata.uid,
        annotations={"gpufrac.io/test": "bound-once"},
    )


async def test_a_bind_refused_with_429_or_503_did_not_happen_and_the_next_one_binds(
    proxy: FaultProxy, through: AsyncClient, direct: AsyncClient, namespace: str
) -> None:
    proxy.rules.append(Rule("binds", binds, [answer(429, retry_after=1), answer(503)]))
    pod = await pending_pod(direct, namespace, "refused")
    with pytest.raises(TooManyRequests) as refused:
        await bind(through, pod, "node-a")
    assert "injected by the fault proxy" in refused.value.message
    with pytest.raises(KubeError) as unavailable:
        await bind(through, pod, "node-a")
    assert unavailable.value.code == 503
    assert (await direct.get(Pod, "refused", namespace=namespace)).spec.nodeName is None
    await bind(through, pod, "node-a")
    assert (await direct.get(Pod, "refused", namespace=namespace)).spec.nodeName == "node-a"
    assert [str(i.fault) for i in proxy.injected] == ["429 Retry-After 1", "503"]


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "closed"])
async def test_a_bind_whose_answer_is_lost_happened_once_and_a_retry_is_refused_with_409(
    proxy: FaultProxy, through: AsyncClient, direct: AsyncClient, namespace: str, reset: bool
) -> None:
    proxy.rules.append(Rule("binds", binds, [lose_answer(reset=reset)]))
    pod = await pending_pod(direct, namespace, "lost")
    with pytest.raises(OSError):  # ConnectionError: the answer never came
        await bind(through, pod, "node-a")
    applied = await direct.get(Pod, "lost", namespace=namespace)
    assert applied.spec.nodeName == "node-a"
    assert applied.metadata.annotations["gpufrac.io/test"] == "bound-once"
    with pytest.raises(Conflict) as again:
        await bind(through, pod, "node-b")
    assert "already assigned to node" in again.value.message
    assert (await direct.get(Pod, "lost", namespace=namespace)).spec.nodeName == "node-a"


class Names:
    def __init__(self) -> None:
        self.names: set[str] = set()

    def on_add(self, obj: ConfigMap) -> None:
        self.names.add(obj.metadata.name)

    def on_update(self, old: ConfigMap, new: ConfigMap) -> None:
        self.names.add(new.metadata.name)

    def on_delete(self, obj: ConfigMap) -> None:
        self.names.discard(obj.metadata.name)


async def test_an_informer_whose_watch_is_cut_or_refused_still_sees_every_change(
    proxy: FaultProxy, through: AsyncClient, direct: AsyncClient, namespace: str
) -> None:
    proxy.rules.append(
        Rule(
            "watch",
            watches("configmaps"),
            [cut_watch(after_lines=2), answer(500), answer(429, retry_after=1)],
        )
    )
    informer = Informer(client=through, resource=ConfigMap, selection=Selection(namespace=namespace))
    names = Names()
    informer.add_handler(names)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        expected = set(names.names)
        for i in range(6):
            await direct.create(ConfigMap(metadata=ObjectMeta(name=f"cm-{i}", namespace=namespace)))
            expected.add(f"cm-{i}")
        await direct.delete(ConfigMap, "cm-0", namespace=namespace)
        expected.discard("cm-0")
        deadline = asyncio.get_running_loop().time() + 20
        while names.names != expected or not proxy.rules[0].used_up:
            assert asyncio.get_running_loop().time() < deadline, (names.names, proxy.injected)
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [str(i.fault) for i in proxy.injected] == ["cut after 2 events", "500", "429 Retry-After 1"]
    assert proxy.watches_cut == 1
    assert informer.relists == 0  # resumed from its last version each time, never listed again


async def test_the_proxy_fronts_loopback_only_keeps_its_budget_and_stops_by_itself(
    controlplane: ControlPlane,
) -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy(upstream="https://10.0.0.1:6443", ca_file=controlplane.ca_file, cert=Path(), key=Path())
    proxy = await FaultProxy.for_controlplane(controlplane, lifetime_s=1.0, max_requests=1).start()
    assert proxy.url.startswith("http://127.0.0.1:")
    async with httpx2.AsyncClient(base_url=proxy.url, trust_env=False) as http:
        assert (await http.get("/api/v1/nodes")).status_code == 200
        assert (await http.get("/api/v1/nodes")).status_code == 503
        assert proxy.refused_over_budget == 1
        await asyncio.sleep(1.5)
        with pytest.raises(httpx2.TransportError):
            await http.get("/api/v1/nodes")


async def running_pod(client: AsyncClient, namespace: str, name: str, labels: dict[str, str]) -> Pod:
    pod = Pod(
        metadata=ObjectMeta(name=name, namespace=namespace, labels=labels),
        spec=PodSpec(
            containers=[Container(name="app", image="busybox")],
            schedulerName="nobody",
            terminationGracePeriodSeconds=0,
        ),
    )
    created = await client.create(pod)
    # The eviction API applies budgets only to running pods; no kubelet runs here to say so.
    await client.patch(Pod.Status, name, {"status": {"phase": "Running"}}, namespace=namespace)
    return created


async def test_an_eviction_throttled_with_429_or_failing_with_503_is_asked_again_and_evicts(
    proxy: FaultProxy, through: AsyncClient, direct: AsyncClient, namespace: str
) -> None:
    proxy.rules.append(Rule("evictions", evictions, [answer(429, retry_after=1), answer(503)]))
    pod = await running_pod(direct, namespace, "victim", {"app": "plain"})
    await evict_pod(through, name="victim", namespace=namespace, uid=pod.metadata.uid)
    with pytest.raises(ApiError) as gone:
        await direct.get(Pod, "victim", namespace=namespace)
    assert gone.value.status.code == 404
    assert [str(i.fault) for i in proxy.injected] == ["429 Retry-After 1", "503"]


async def test_a_disruption_budgets_429_is_a_refusal_at_once_not_a_throttle(
    proxy: FaultProxy, through: AsyncClient, direct: AsyncClient, namespace: str
) -> None:
    await direct.create(
        PodDisruptionBudget.from_dict(
            {
                "metadata": {"name": "keep", "namespace": namespace},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "kept"}}},
            }
        )
    )
    pod = await running_pod(direct, namespace, "kept", {"app": "kept"})
    proxy.rules.append(Rule("evictions", evictions, []))  # counts the evictions, changes none
    with pytest.raises(TooManyRequests) as refused:
        await evict_pod(through, name="kept", namespace=namespace, uid=pod.metadata.uid)
    assert refused.value.disruption_budget
    assert proxy.rules[0].hits == 1  # asked once: a budget's answer is not worth repeating
    assert (await direct.get(Pod, "kept", namespace=namespace)).metadata.deletionTimestamp is None
