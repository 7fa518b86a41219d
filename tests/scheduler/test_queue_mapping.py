"""Queues without the API server: KAI's Queue objects mapped to ours, a spec that skipped the CRD's
validation, and the status the scheduler computes from its books and its waiting pods."""

from __future__ import annotations

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.placement.fair_share import QueueBook
from gpufrac.placement.model import Queue, QueueResource, Quota
from gpufrac.placement.queue_shares import Amount, QueueAmount, QueueShares
from gpufrac.scheduler.queue_status import pod_demand, queue_statuses
from gpufrac.scheduler.queues import GpufracQueue, KaiQueue, queue_from_kai, queue_from_object


def test_kai_queues_map_to_ours_never_promising_more_nor_capping_harder() -> None:
    """queue_types.go/resources.go: GPUs in fractions, -1 unlimited; ours counts whole GPUs."""
    kai = KaiQueue(
        metadata=ObjectMeta(name="k"),
        spec={
            "parentQueue": "org",
            "resources": {
                "gpu": {"quota": 2.7, "limit": 3.2, "overQuotaWeight": 4},
                "memory": {"quota": 1000, "limit": 2000},
            },
        },
    )
    q = queue_from_kai(kai)
    assert q.parent == "org"
    assert q.gpus == Quota(deserved=2, over_quota_weight=4.0, limit=4)
    assert q.gpu_memory == Quota(deserved=0, over_quota_weight=4.0, limit=None)  # host memory is ignored
    unlimited = queue_from_kai(
        KaiQueue(metadata=ObjectMeta(name="u"), spec={"resources": {"gpu": {"quota": -1, "limit": -1}}})
    )
    assert unlimited.gpus == Quota(deserved=0, over_quota_weight=1.0, limit=None)
    assert queue_from_kai(KaiQueue(metadata=ObjectMeta(name="bare"), spec={})).gpus == Quota()


def test_a_queue_stored_without_the_crds_validation_is_refused_naming_the_field() -> None:
    bad = GpufracQueue(metadata=ObjectMeta(name="b"), spec={"resources": {"gpus": {"limit": -2}}})
    with pytest.raises(
        ValueError, match=r"queue b: spec.resources.gpus.limit: -2 is not a non-negative integer"
    ):
        queue_from_object(bad)


def _pod(annotations: dict[str, str], *, whole: int = 0) -> Pod:
    resources = {"limits": {"nvidia.com/gpu": str(whole)}} if whole else {}
    return Pod.from_dict(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "x", "resources": resources}]},
        }
    )


def test_a_waiting_pods_demand_resolves_portions_against_the_largest_gpu() -> None:
    assert pod_demand(_pod({"gpu-fraction": "0.25"}), largest_gpu_mib=80_000) == Amount(20_000, 0)
    assert pod_demand(_pod({}, whole=2), largest_gpu_mib=80_000) == Amount(160_000, 2)
    assert pod_demand(_pod({"gpu-fraction": "1.5"}), largest_gpu_mib=80_000) is None  # invalid: no demand


def test_status_counts_subtrees_and_divides_by_demand() -> None:
    queues = [
        Queue("org", gpu_memory=Quota(limit=100_000)),
        Queue("a", parent="org", gpu_memory=Quota(deserved=30_000)),
        Queue("b", parent="org"),
        Queue("solo", deserved_share=0.25),
    ]
    book = QueueBook()
    book.replace(queues)
    book.charge("a", 40_000)
    book.charge("b", 10_000, 1)
    waiting = [QueueAmount(q, Amount(mib)) for q, mib in {"a": 50_000, "b": 50_000, "solo": 10_000}.items()]
    capacity = {QueueResource.GPU_MEMORY: 160_000, QueueResource.GPUS: 2}
    got = queue_statuses(queues=queues, shares=QueueShares(book, capacity, waiting=waiting))
    assert got["org"]["allocated"] == {"gpuMemory": 50_000, "gpus": 1}
    assert got["org"]["requested"] == {"gpuMemory": 150_000, "gpus": 1}
    # org wants 150000 but its limit caps it at 100000; solo wants 10000 of the rest.
    assert got["org"]["fairShare"]["gpuMemory"] == 100_000
    # Inside org: a gets its deserved 30000, the other 70000 split 1:1 -> a 65000, b 35000.
    assert got["a"]["fairShare"] == {"gpuMemory": 65_000, "gpus": 0}
    assert got["b"]["fairShare"] == {"gpuMemory": 35_000, "gpus": 1}
    assert got["solo"]["deserved"] == {"gpuMemory": 40_000, "gpus": 0}  # 0.25 of 160000
    assert got["solo"]["fairShare"]["gpuMemory"] == 10_000


def test_a_waiting_pods_demand_follows_its_queues_and_namespace_labels_between_passes() -> None:
    """The demand of a waiting pod is remembered between passes (each preemption decision reads it),
    yet a queue's binding or its namespace's labels changing changes whether the pod counts."""
    from gpufrac.local.simnodes import NodeShape, sim_node
    from gpufrac.scheduler.config import SchedulerConfig
    from gpufrac.scheduler.objects import node_spec
    from gpufrac.scheduler.placement_engine import build_engine
    from gpufrac.scheduler.queue_status import QueueStatusWriter
    from gpufrac.scheduler.queues import QueueDirectory

    config = SchedulerConfig()
    engine = build_engine(config)
    engine.add_node(node_spec(sim_node(name="n1")))
    labels: dict[str, dict[str, str]] = {"ns": {}}
    directory = QueueDirectory(
        client=None,  # type: ignore[arg-type]  # nothing is listed: the queues are put in the store below
        config=config,
        apply=lambda queues: None,
        changed=lambda: None,
        namespace_labels=lambda name: labels.get(name),
    )

    def queue_object(spec: dict) -> None:
        directory.ours.installed = True
        directory.ours.informer.store._items["team"] = GpufracQueue(
            metadata=ObjectMeta(name="team"), spec=spec
        )
        directory.refresh()

    pod = _pod({"gpu-fraction": "0.5"})
    pod.metadata.labels = {"gpufrac.io/queue": "team"}
    pod.metadata.resourceVersion = "7"
    writer = QueueStatusWriter(
        client=None,  # type: ignore[arg-type]
        directory=directory,
        engine=lambda: engine,
        leaving=lambda: (),
        planned=lambda: {},
        waiting=lambda: [("team", pod)],
        is_leader=lambda: True,
        interval=5.0,
    )
    assert writer.waiting_demand() == []  # queue team does not exist: no demand on it
    queue_object({"namespaceSelector": {"matchLabels": {"team": "a"}}})
    assert writer.waiting_demand() == []  # ns is not labelled team=a: refused
    labels["ns"] = {"team": "a"}
    half = writer.waiting_demand()
    assert half == [QueueAmount("team", pod_demand(pod, largest_gpu_mib=NodeShape().mib))]
    assert writer.waiting_demand() == half  # the same pod, queues and labels: the same answer
    queue_object({"namespaces": []})  # the queue now admits no namespace
    assert writer.waiting_demand() == []
