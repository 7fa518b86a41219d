"""Queues bound to namespaces, against the real API server (issue 34): tenants, each a ServiceAccount
with rights only in its own namespace, cannot reach another team's queue through the scheduler, with or
without the webhook in the path (none runs here: this is the scheduler's half of the boundary).

Before the binding a tenant labelled its pod with team b's queue and a system-cluster-critical priority,
and the scheduler preempted team b's pods; a tenant at its queue's limit escaped it by another team's
label, KAI's label, dropping the label, or relabelling its pending pod.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.core_v1 import Event, Namespace, Pod
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from sched_harness import (
    Pool,
    add_nodes,
    condition,
    gpu_pod,
    metric,
    pods_of,
    running,
    scrape,
    wait_bound,
    wait_for,
)
from test_queues import SHAPE, _create, _refused, queue_crds  # noqa: F401 - a fixture

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.scheduler.queues import REFUSED_QUEUE, GpufracQueue

pytestmark = pytest.mark.kube

SYSTEM_CLUSTER_CRITICAL = 2_000_000_000
WHOLE = {"gpu-memory": "80000"}  # one GPU of SHAPE each


@dataclass
class Tenant:
    namespace: str
    client: AsyncClient


@contextlib.asynccontextmanager
async def tenant(controlplane: ControlPlane, admin: AsyncClient, namespace: str) -> AsyncIterator[Tenant]:
    """A ServiceAccount of ``namespace`` that may manage pods there and nowhere else."""
    await admin.create(
        Role(
            metadata=ObjectMeta(name="tenant", namespace=namespace),
            rules=[
                PolicyRule(
                    apiGroups=[""], resources=["pods"], verbs=["create", "get", "list", "patch", "update"]
                )
            ],
        )
    )
    await admin.create(
        RoleBinding(
            metadata=ObjectMeta(name="tenant", namespace=namespace),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="tenant"),
            subjects=[Subject(kind="ServiceAccount", name="tenant", namespace=namespace)],
        )
    )
    client = controlplane.async_client(
        impersonate=f"system:serviceaccount:{namespace}:tenant",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
        namespace=namespace,
    )
    try:
        yield Tenant(namespace, client)
    finally:
        await client.close()


@pytest.fixture
async def queues(akube: AsyncClient, queue_crds: None) -> AsyncIterator[list[tuple[type, str]]]:  # noqa: F811
    """Queues (kind, name) a test created; deleted after it."""
    created: list[tuple[type, str]] = []
    yield created
    for kind, name in reversed(created):
        with contextlib.suppress(ApiError):
            await akube.delete(kind, name)


@pytest.fixture
async def team_a(client: AsyncClient, pool: Pool) -> AsyncIterator[str]:
    """A second tenant namespace beside the pool's (which is team b's)."""
    name = f"{pool.namespace}-a"
    await client.create(Namespace(metadata=ObjectMeta(name=name, labels={"team": f"a-{pool.id}"})))
    yield name
    with contextlib.suppress(Exception):
        await client.delete(Namespace, name)


async def _reported(client: AsyncClient, namespace: str, names: set[str]) -> dict[str, Pod]:
    """The pods of ``names`` once each is bound or has PodScheduled=False."""
    seen: dict[str, Pod] = {}

    async def all_reported() -> bool:
        seen.clear()
        seen.update({p.metadata.name: p for p in await pods_of(client, namespace)})
        return all(n in seen and (seen[n].spec.nodeName or condition(seen[n])[0] == "False") for n in names)

    await wait_for(all_reported, timeout=20, what=f"{sorted(names)} reported in {namespace}")
    return dict(seen)


async def test_a_tenant_naming_another_teams_queue_at_system_priority_preempts_none_of_its_pods(
    client: AsyncClient,
    controlplane: ControlPlane,
    pool: Pool,
    team_a: str,
    queues: list[tuple[type, str]],
) -> None:
    team_b = pool.namespace
    q_a, q_b = f"{pool.id}-a", f"{pool.id}-b"
    await _create(client, queues, GpufracQueue, q_a, {"namespaces": [team_a]})
    await _create(client, queues, GpufracQueue, q_b, {"namespaces": [team_b]})
    await add_nodes(client, pool, count=1, shape=SHAPE)
    async with running(client, pool.config(preemption=True)) as service:
        for name in ("b-1", "b-2"):
            await client.create(gpu_pod(pool, name, WHOLE, labels={keys.QUEUE_LABEL: q_b}))
        await wait_bound(client, team_b, 2, timeout=20)

        async with tenant(controlplane, client, team_a) as a:
            for name, label in (("via-ours", keys.QUEUE_LABEL), ("via-kai", keys.KAI_QUEUE_LABEL)):
                pod = gpu_pod(pool, name, WHOLE, namespace=team_a, labels={label: q_b})
                pod.spec.priorityClassName = "system-cluster-critical"
                created = await a.client.create(pod)
                assert created.spec.priority == SYSTEM_CLUSTER_CRITICAL  # the API server allowed it
            pods = await _reported(client, team_a, {"via-ours", "via-kai"})

        for name, label in (("via-ours", keys.QUEUE_LABEL), ("via-kai", keys.KAI_QUEUE_LABEL)):
            assert condition(pods[name]) == (
                "False",
                "Unschedulable",
                f'label {label}="{q_b}" is refused: queue {q_b} admits only namespace {team_b}, '
                f"not namespace {team_a}",
            )
            assert not pods[name].spec.nodeName
            assert not (pods[name].status.nominatedNodeName if pods[name].status else None)
        team_b_pods = await pods_of(client, team_b)
        assert all(p.spec.nodeName and p.metadata.deletionTimestamp is None for p in team_b_pods)
        reasons = {e.reason async for e in client.list(Event, namespace=team_b)}
        assert not reasons & {"Preempted", "Reclaimed"}
        # Nor do they count as team b's pending pods (the gauge its GpufracGpuPodsPending alert reads).
        text = await scrape(service.probe_port)
        assert metric(text, "gpufrac_scheduler_pending_pods", queue=REFUSED_QUEUE) == 2
        with pytest.raises(AssertionError, match="not in the metrics"):
            metric(text, "gpufrac_scheduler_pending_pods", queue=q_b)


async def test_a_capped_tenant_cannot_leave_its_queue_by_any_label(
    client: AsyncClient,
    controlplane: ControlPlane,
    pool: Pool,
    team_a: str,
    queues: list[tuple[type, str]],
) -> None:
    team_b = pool.namespace
    q_a, q_b = f"{pool.id}-a", f"{pool.id}-b"
    # Team a's queue by label selector, capped at one GPU's memory; team b's by name, uncapped.
    await _create(
        client,
        queues,
        GpufracQueue,
        q_a,
        {
            "namespaceSelector": {"matchLabels": {"team": f"a-{pool.id}"}},
            "resources": {"gpuMemory": {"limit": 80_000}},
        },
    )
    await _create(client, queues, GpufracQueue, q_b, {"namespaces": [team_b]})
    # The admin makes q-a the namespace's default queue: dropping the label is no way out.
    await client.patch(Namespace, team_a, {"metadata": {"labels": {keys.NAMESPACE_DEFAULT_QUEUE_LABEL: q_a}}})
    await add_nodes(client, pool, count=2, shape=SHAPE)
    async with running(client, pool.config()), tenant(controlplane, client, team_a) as a:
        await a.client.create(gpu_pod(pool, "first", WHOLE, namespace=team_a, labels={keys.QUEUE_LABEL: q_a}))
        await wait_bound(client, team_a, 1, timeout=20)
        await a.client.create(
            gpu_pod(pool, "capped", WHOLE, namespace=team_a, labels={keys.QUEUE_LABEL: q_a})
        )
        await a.client.create(gpu_pod(pool, "unlabelled", WHOLE, namespace=team_a))
        await a.client.create(
            gpu_pod(pool, "foreign", WHOLE, namespace=team_a, labels={keys.QUEUE_LABEL: q_b})
        )
        await a.client.create(
            gpu_pod(pool, "kai", WHOLE, namespace=team_a, labels={keys.KAI_QUEUE_LABEL: q_b})
        )
        pods = await _reported(client, team_a, {"first", "capped", "unlabelled", "foreign", "kai"})
        limit = f"queue {q_a} would exceed its GPU-memory limit of 80000 MiB"
        assert limit in (condition(pods["capped"])[2] or ""), condition(pods["capped"])
        assert limit in (condition(pods["unlabelled"])[2] or ""), condition(pods["unlabelled"])
        refused = f"is refused: queue {q_b} admits only namespace {team_b}, not namespace {team_a}"
        assert condition(pods["foreign"])[2] == f'label {keys.QUEUE_LABEL}="{q_b}" {refused}'
        assert condition(pods["kai"])[2] == f'label {keys.KAI_QUEUE_LABEL}="{q_b}" {refused}'

        # Relabelling the capped pending pod into team b's queue is judged the same way.
        await a.client.patch(Pod, "capped", {"metadata": {"labels": {keys.QUEUE_LABEL: q_b}}})

        async def relabel_judged() -> bool:
            pod = await client.get(Pod, "capped", namespace=team_a)
            return condition(pod)[2] == f'label {keys.QUEUE_LABEL}="{q_b}" {refused}'

        await wait_for(relabel_judged, timeout=20, what="the relabelled pod refused")

        # Team b's own pod still finds its queue's room: nothing of team a's counts against it.
        await client.create(gpu_pod(pool, "b-own", WHOLE, labels={keys.QUEUE_LABEL: q_b}))
        await wait_bound(client, team_b, 1, timeout=20)
        bound = {p.metadata.name for p in await pods_of(client, team_a) if p.spec.nodeName}
        assert bound == {"first"}


async def test_the_crd_refuses_a_binding_it_could_not_read_naming_the_field(
    client: AsyncClient, pool: Pool, queues: list[tuple[type, str]]
) -> None:
    bad = f"{pool.id}-bad"
    message = await _refused(client, bad, {"namespaces": ["Team_A"]})
    assert "spec.namespaces[0]" in message
    gt = {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Gt", "values": ["1"]}]}}
    assert "spec.namespaceSelector.matchExpressions[0].operator" in await _refused(client, bad, gt)
    bare_in = {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}}
    assert "In and NotIn need values" in await _refused(client, bad, bare_in)
    assert "spec.maxPriority" in await _refused(client, bad, {"maxPriority": "high"})
    good = await _create(
        client,
        queues,
        GpufracQueue,
        f"{pool.id}-good",
        {"namespaces": ["team-a"], "namespaceSelector": {"matchLabels": {"team": "a"}}, "maxPriority": 1000},
    )
    assert good.spec["namespaces"] == ["team-a"] and good.spec["maxPriority"] == 1000
