"""Pod fields kube-scheduler honours, through the scheduler service against the real API server (#19).

What a user saw before: three anti-affine inference replicas on two nodes all bound to one node; gated
pods and pods whose volumes live on one node were placed as if those fields were not there; a DaemonSet's
host port was not counted. Now each field is honoured, or the pod waits with a sentence naming it.
"""

from __future__ import annotations

from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node, PersistentVolume, PersistentVolumeClaim, Pod
from sched_harness import POOL_LABEL, Pool, add_nodes, condition, gpu_pod, running, wait_bound, wait_for

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, create_sim_nodes

pytestmark = pytest.mark.kube

HOST = "kubernetes.io/hostname"


def with_spec(pod: Pod, **spec: Any) -> Pod:
    body = pod.to_dict()
    body["spec"].update(spec)
    return Pod.from_dict(body)


async def reported(client: AsyncClient, pool: Pool, name: str) -> str:
    message = ""

    async def done() -> bool:
        nonlocal message
        pod = await client.get(Pod, name, namespace=pool.namespace)
        status, _, message = condition(pod)
        return status == "False"

    await wait_for(done, timeout=20, what=f"{name} reported unschedulable")
    return message or ""


async def test_anti_affine_replicas_spread_and_the_one_too_many_waits_with_the_reason(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=2)
    anti = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "infer"}}, "topologyKey": HOST}
            ]
        }
    }
    async with running(client, pool.config()):
        for i in range(3):
            pod = gpu_pod(pool, f"infer-{i}", {"gpu-fraction": "0.25"}, labels={"app": "infer"})
            await client.create(with_spec(pod, affinity=anti))
        pods = await wait_bound(client, pool.namespace, 2, timeout=30)
        nodes = [p.spec.nodeName for p in pods if p.spec.nodeName]
        assert len(set(nodes)) == 2
        waiting = next(p.metadata.name for p in pods if not p.spec.nodeName)
        message = await reported(client, pool, waiting)
        assert "2 node(s) didn't match pod anti-affinity rules" in message


async def test_a_gated_pod_waits_until_its_gate_is_removed(client: AsyncClient, pool: Pool) -> None:
    await add_nodes(client, pool, count=1)
    async with running(client, pool.config()):
        gated = with_spec(
            gpu_pod(pool, "gated", {"gpu-fraction": "0.25"}), schedulingGates=[{"name": "quota"}]
        )
        await client.create(gated)
        await client.create(gpu_pod(pool, "free", {"gpu-fraction": "0.25"}))
        await wait_bound(client, pool.namespace, 1, timeout=20)  # the free pod: the loop has run since
        pod = await client.get(Pod, "gated", namespace=pool.namespace)
        assert not pod.spec.nodeName
        assert condition(pod)[1] == "SchedulingGated"  # the API server's, not overwritten by ours
        await client.patch(Pod, "gated", {"spec": {"schedulingGates": None}}, namespace=pool.namespace)
        await wait_bound(client, pool.namespace, 2, timeout=20)


async def test_volumes_pin_the_pod_to_their_node_and_an_unbound_claim_is_refused_by_name(
    client: AsyncClient, pool: Pool
) -> None:
    nodes = await add_nodes(client, pool, count=3)
    target = nodes[1]
    pv = f"pv-{pool.id}"
    await client.create(
        PersistentVolume.from_dict(
            {
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "",
                    "local": {"path": "/data"},
                    "claimRef": {"namespace": pool.namespace, "name": "data"},
                    "nodeAffinity": {
                        "required": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": HOST, "operator": "In", "values": [target]}]}
                            ]
                        }
                    },
                },
            }
        )
    )
    for name, volume in (("data", pv), ("later", None)):
        await client.create(
            PersistentVolumeClaim.from_dict(
                {
                    "metadata": {"name": name, "namespace": pool.namespace},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": "",
                        "resources": {"requests": {"storage": "1Gi"}},
                        **({"volumeName": volume} if volume else {}),
                    },
                }
            )
        )
    try:
        async with running(client, pool.config()):
            for name, claim in (("uses-pv", "data"), ("uses-unbound", "later")):
                pod = gpu_pod(pool, name, {"gpu-fraction": "0.25"})
                volumes = [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]
                await client.create(with_spec(pod, volumes=volumes))
            pods = await wait_bound(client, pool.namespace, 1, timeout=20)
            assert {p.metadata.name: p.spec.nodeName for p in pods}["uses-pv"] == target
            message = await reported(client, pool, "uses-unbound")
            assert "spec.volumes[0] (PersistentVolumeClaim later)" in message
            assert "not bound" in message
    finally:
        await client.delete(PersistentVolume, pv)


async def test_a_daemonset_pods_host_port_keeps_our_pod_off_its_node(client: AsyncClient, pool: Pool) -> None:
    nodes = await add_nodes(client, pool, count=2)
    port = [{"containerPort": 9100, "hostPort": 9100}]
    daemon = Pod.from_dict(
        {
            "metadata": {"name": "exporter", "namespace": pool.namespace, "labels": {"app": "exporter"}},
            "spec": {
                "nodeName": nodes[0],  # bound as the DaemonSet controller binds: no scheduler at all
                "containers": [{"name": "c", "image": "busybox", "ports": port}],
            },
        }
    )
    await client.create(daemon)
    async with running(client, pool.config(policy="binpack")):
        for i in range(2):
            pod = gpu_pod(pool, f"web-{i}", {"gpu-fraction": "0.25"})
            body = pod.to_dict()
            body["spec"]["containers"][0]["ports"] = port
            await client.create(Pod.from_dict(body))
        pods = await wait_bound(client, pool.namespace, 2, timeout=20)  # the daemon pod and one of ours
        ours = {
            p.metadata.name: p.spec.nodeName
            for p in pods
            if p.metadata.name.startswith("web") and p.spec.nodeName
        }
        assert list(ours.values()) == [nodes[1]]
        waiting = next(f"web-{i}" for i in range(2) if f"web-{i}" not in ours)
        assert "free ports" in await reported(client, pool, waiting)


async def test_room_a_preemptor_nominated_is_held_until_the_nomination_is_cleared(
    client: AsyncClient, pool: Pool
) -> None:
    (roomy,) = await add_nodes(client, pool, count=1, shape=NodeShape(cpu="4"), prefix="roomy")
    await add_nodes(client, pool, count=1, shape=NodeShape(cpu="2"), prefix="small")

    def needs_3_cpus(name: str, **spec: Any) -> Pod:
        body = gpu_pod(pool, name, {"gpu-fraction": "0.25"}).to_dict()
        body["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
        body["spec"].update(spec)
        return Pod.from_dict(body)

    async with running(client, pool.config()):
        # The nominee waits behind a gate (as a preemptor's nominee waits for its victims to go).
        await client.create(needs_3_cpus("nominee", schedulingGates=[{"name": "victims"}]))
        await client.patch(
            Pod.Status, "nominee", {"status": {"nominatedNodeName": roomy}}, namespace=pool.namespace
        )
        await client.create(needs_3_cpus("latecomer"))
        message = await reported(client, pool, "latecomer")
        assert "insufficient cpu" in message
        await client.patch(
            Pod.Status, "nominee", {"status": {"nominatedNodeName": None}}, namespace=pool.namespace
        )
        pods = await wait_bound(client, pool.namespace, 1, timeout=20)
        assert {p.metadata.name: p.spec.nodeName for p in pods}["latecomer"] == roomy


async def create_unmanaged_node(client: AsyncClient, pool: Pool, name: str, *, zone: str) -> str:
    """A node gpufrac does not manage (no managed label; a CPU node, say), in the pool so it is cleaned."""
    node = Node.from_dict(
        {
            "metadata": {
                "name": name,
                "labels": {HOST: name, keys.ZONE_LABEL: zone, POOL_LABEL: pool.id},
            },
        }
    )
    await client.create(node)
    return name


async def test_unmanaged_nodes_are_topology_domains_and_their_pods_count(
    client: AsyncClient, pool: Pool
) -> None:
    # Before: gpufrac knew only its managed nodes, so it bound both pods below where kube-scheduler
    # would have refused them.
    (managed,) = await create_sim_nodes(
        client, count=1, prefix=f"{pool.id}-n-", labels={POOL_LABEL: pool.id}, zones=1
    )
    zone = (await client.get(Node, managed)).metadata.labels[keys.ZONE_LABEL]
    same_zone = await create_unmanaged_node(client, pool, f"{pool.id}-cpu-0", zone=zone)
    elsewhere = await create_unmanaged_node(client, pool, f"{pool.id}-cpu-1", zone="elsewhere")
    guard = Pod.from_dict(
        {
            "metadata": {"name": "guard", "namespace": pool.namespace, "labels": {"app": "guard"}},
            "spec": {
                "nodeName": same_zone,  # bound without any scheduler, on the unmanaged node
                "containers": [{"name": "c", "image": "busybox"}],
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "labelSelector": {"matchLabels": {"app": "infer"}},
                                "topologyKey": keys.ZONE_LABEL,
                            }
                        ]
                    }
                },
            },
        }
    )
    await client.create(guard)
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": keys.ZONE_LABEL,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "web"}},
        }
    ]
    async with running(client, pool.config(policy="binpack")):
        await client.create(gpu_pod(pool, "infer", {"gpu-fraction": "0.25"}, labels={"app": "infer"}))
        for i in range(2):
            pod = gpu_pod(pool, f"web-{i}", {"gpu-fraction": "0.25"}, labels={"app": "web"})
            await client.create(with_spec(pod, topologySpreadConstraints=spread))
        # The guard's anti-affinity, on a node gpufrac does not manage, keeps infer out of its zone.
        assert "existing pods anti-affinity" in await reported(client, pool, "infer")
        # Zone "elsewhere" (an unmanaged node, no web pod) holds the spread's minimum at 0: one web pod
        # fits in the managed node's zone, the second would make the skew 2.
        bound = await wait_bound(client, pool.namespace, 2, timeout=20)  # the guard and one web pod
        webs = [p.metadata.name for p in bound if p.metadata.name.startswith("web") and p.spec.nodeName]
        assert len(webs) == 1
        waiting = "web-1" if webs == ["web-0"] else "web-0"
        assert "topology spread constraints" in await reported(client, pool, waiting)
        # The guard goes: infer is placed at once (its anti-affinity no longer holds anyone off). The
        # parked pods are retried on their own only every unschedulable_resync_s (60 s): well after
        # these waits.
        await client.delete(Pod, "guard", namespace=pool.namespace, grace_period=0)
        await wait_for(
            lambda: _bound_to(client, pool, "infer", managed),
            timeout=20,
            what="infer bound after the guard left",
        )
        # A web pod arrives in zone elsewhere (bound there by another scheduler): the minimum is 1, and
        # the waiting web pod is placed at once.
        other = with_spec(
            gpu_pod(pool, "web-elsewhere", labels={"app": "web"}), nodeName=elsewhere, schedulerName=None
        )
        await client.create(other)
        await wait_for(
            lambda: _bound_to(client, pool, waiting, managed),
            timeout=20,
            what=f"{waiting} bound after a web pod arrived in the other zone",
        )


async def _bound_to(client: AsyncClient, pool: Pool, name: str, node: str) -> bool:
    return (await client.get(Pod, name, namespace=pool.namespace)).spec.nodeName == node
