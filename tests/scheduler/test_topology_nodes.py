"""Nodes the scheduler does not manage, in the booking cache: topology domains whose pods count (#19).

kube-scheduler counts every node as an affinity and spread domain and every bound pod, so the cache tells
the engine of unmanaged nodes (read narrowly, ``objects.NodeTopology``) and counts the pods the API
shows bound to them, through every way a node and a pod can come and go: a pod seen before its node, a
node that becomes managed or stops being managed, a pod that leaves. The check is what a user sees: a
zone-anti-affine pod refused while such a pod is counted in its only zone, placed once it is not.
"""

from __future__ import annotations

import json

import msgspec
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, sim_node
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import ModePolicy, PendingPod, TaintEffect
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.objects import (
    NodeTopology,
    gpu_request,
    node_spec,
    pending_pod,
    topology_node_spec,
)

ZONE = "z1"


def managed(name: str) -> Node:
    return sim_node(name=name, shape=NodeShape(gpus=1), labels={keys.ZONE_LABEL: ZONE})


def unmanaged(name: str) -> NodeTopology:
    """The narrow read of a node without the managed label, decoded from the API's JSON."""
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "7",
            "labels": {keys.HOSTNAME_LABEL: name, keys.ZONE_LABEL: ZONE},
        },
        "spec": {"taints": [{"key": "dedicated", "value": "cpu", "effect": "NoSchedule"}]},
        "status": {"images": [{"names": ["registry/image:tag"], "sizeBytes": 1}] * 50},
    }
    return msgspec.json.decode(json.dumps(body).encode(), type=NodeTopology)


def bound_pod(name: str, node: str, *, labels: dict[str, str]) -> Pod:
    return Pod.from_dict(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        }
    )


def zone_apart(name: str) -> PendingPod:
    """A pending pod that may not share a zone with app=web."""
    pod = Pod.from_dict(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "annotations": {"gpu-fraction": "0.1"},
            },
            "spec": {
                "containers": [{"name": "c", "image": "busybox"}],
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": keys.ZONE_LABEL}
                        ]
                    }
                },
            },
        }
    )
    return pending_pod(
        pod, gpu=gpu_request(pod), arrival=0, default_queue="default", mode_policy=ModePolicy.REQUIRED
    )


def blocked(cache: BookingCache, name: str) -> bool:
    engine = cache.engine
    assert isinstance(engine, Engine)
    decision = engine.place(zone_apart(name))
    if isinstance(decision, Placement):
        engine.forget(decision.pod_uid)
        return False
    assert isinstance(decision, Unschedulable)
    assert "pod anti-affinity rules" in decision.message
    return True


def new_cache() -> BookingCache:
    cache = BookingCache(engine=Engine(policy="binpack"), default_queue="default")
    cache.set_node(node_spec(managed("gpu-0")))
    return cache


def test_the_narrow_read_of_a_node_keeps_its_labels_and_taints_and_nothing_else() -> None:
    node = unmanaged("cpu-0")
    spec = topology_node_spec(node)
    assert spec.labels == {keys.HOSTNAME_LABEL: "cpu-0", keys.ZONE_LABEL: ZONE}
    assert [(t.key, t.value, t.effect) for t in spec.taints] == [
        ("dedicated", "cpu", TaintEffect.NO_SCHEDULE)
    ]
    assert not hasattr(node, "status")
    assert spec.gpus == () and spec.cpu_milli == 0


def test_a_pod_seen_before_its_unmanaged_node_counts_once_the_node_is_known() -> None:
    cache = new_cache()
    web = bound_pod("web", "cpu-0", labels={"app": "web"})
    cache.confirm(web)  # the node is not known yet: the pod waits for it
    assert not blocked(cache, "a")
    assert cache.set_topology_node(topology_node_spec(unmanaged("cpu-0")))
    assert not cache.set_topology_node(topology_node_spec(unmanaged("cpu-0")))  # unchanged
    assert blocked(cache, "b")
    assert cache.remove(web)  # the pod leaves: something changed for pods waiting on it
    assert not blocked(cache, "c")


def test_a_pod_bound_to_a_known_unmanaged_node_counts_at_once_and_relabelling_it_is_seen() -> None:
    cache = new_cache()
    cache.set_topology_node(topology_node_spec(unmanaged("cpu-0")))
    cache.confirm(bound_pod("web", "cpu-0", labels={"app": "web"}))
    assert blocked(cache, "a")
    cache.confirm(bound_pod("web", "cpu-0", labels={"app": "batch"}))
    assert not blocked(cache, "b")


def test_an_unmanaged_node_that_becomes_managed_books_its_pods_as_bound_pods() -> None:
    cache = new_cache()
    cache.set_topology_node(topology_node_spec(unmanaged("gpu-1")))
    web = bound_pod("web", "gpu-1", labels={"app": "web"})
    cache.confirm(web)
    cache.set_node(node_spec(managed("gpu-1")))  # the managed label arrived
    assert "gpu-1" not in cache.topology_nodes and web.metadata.uid in cache
    assert blocked(cache, "a")  # counted once, now as a bound pod of a managed node
    assert not cache.set_topology_node(topology_node_spec(unmanaged("gpu-1")))  # managed: not a domain twice
    cache.remove_node("gpu-1")  # the label went: the node is unmanaged again, its pod kept aside
    assert not blocked(cache, "b")
    assert cache.set_topology_node(topology_node_spec(unmanaged("gpu-1")))
    assert blocked(cache, "c")  # the kept booking counts on the topology-only node
    assert cache.remove_topology_node("gpu-1") and not cache.remove_topology_node("gpu-1")
    assert not blocked(cache, "d")
