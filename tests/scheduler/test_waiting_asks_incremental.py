"""The waiting pods' demand kept across cycles (``QueueStatusWriter.waiting_asks``, ``WaitingAsks``)
against reading every waiting pod afresh.

Reclaim's fair shares, the Queue status and the order a batch is placed in all read what the waiting
pods ask for; the scheduler keeps each pod's answer (its queue's refusal, its demand) between cycles and
sums them per queue. After any sequence of arrivals, binds, deletions, relabelled pods and namespaces,
queue changes and nominations, the kept answer must be the one a full read gives, or a queue is charged
for pods that left (or not charged for pods that arrived) and reclaims go the wrong way.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.local.simnodes import sim_node
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import PendingPod, QueueResource
from gpufrac.placement.queue_shares import Amount, QueueAmount
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import node_spec
from gpufrac.scheduler.placement_engine import build_engine
from gpufrac.scheduler.queue_status import QueueStatusWriter, pod_demand
from gpufrac.scheduler.queues import GpufracQueue, QueueDirectory

QUEUES = ("a", "b", "c", "parent")
NAMESPACES = ("ns1", "ns2")
FRACTIONS = ("0.25", "0.5", "1.5")  # 1.5 is invalid: no demand


class World:
    """A directory of real ``Queue`` objects, namespaces' labels, a scheduling queue's waiting pods and
    an engine with one node; every change a real cluster makes, applied to them."""

    def __init__(self) -> None:
        config = SchedulerConfig()
        self.engine: Engine = build_engine(config)  # type: ignore[assignment]
        self.engine.add_node(node_spec(sim_node(name="n1")))
        self.labels: dict[str, dict[str, str]] = {ns: {} for ns in NAMESPACES}
        self.directory = QueueDirectory(
            client=None,  # type: ignore[arg-type]  # nothing is listed: queues are put in the store
            config=config,
            apply=self.engine.set_queues,
            changed=lambda: None,
            namespace_labels=lambda name: self.labels.get(name),
        )
        self.directory.ours.installed = True
        self.waiting: dict[str, Pod] = {}
        self.queue_at: dict[str, str] = {}  # the queue a pod was filed under when it (last) arrived
        self.version = 0
        self.count = 0
        self.writer = QueueStatusWriter(
            client=None,  # type: ignore[arg-type]
            directory=self.directory,
            engine=lambda: self.engine,
            leaving=lambda: (),
            planned=lambda: {},
            waiting=lambda: [(self.queue_at[uid], p) for uid, p in self.waiting.items()],
            is_leader=lambda: True,
            interval=5.0,
        )
        for name in ("a", "b", "c"):
            self.set_queue(name, {"parentQueue": "parent"} if name == "c" else {})
        self.set_queue("parent", {})

    def bump(self) -> str:
        self.version += 1
        return str(self.version)

    def set_queue(self, name: str, spec: dict[str, Any] | None) -> None:
        """Create or change queue ``name``; None deletes it."""
        items = self.directory.ours.informer.store._items
        if spec is None:
            items.pop(name, None)
        else:
            items[name] = GpufracQueue(metadata=ObjectMeta(name=name), spec=spec)
        self.directory.refresh()

    def arrive(self, queue: str, namespace: str, fraction: str, priority: int) -> None:
        self.count += 1
        uid = f"u{self.count}"
        self.waiting[uid] = Pod.from_dict(
            {
                "metadata": {
                    "name": uid,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": self.bump(),
                    "labels": {"gpufrac.io/queue": queue},
                    "annotations": {"gpu-fraction": fraction},
                },
                "spec": {"priority": priority, "containers": [{"name": "app", "image": "x"}]},
            }
        )
        self.queue_at[uid] = self.directory.queue_of(self.waiting[uid])

    def pick(self, index: int) -> str | None:
        return sorted(self.waiting)[index % len(self.waiting)] if self.waiting else None

    def apply(self, op: tuple[Any, ...]) -> None:
        kind, *args = op
        if kind == "arrive":
            self.arrive(*args)
        elif kind in ("bind", "delete") and (uid := self.pick(args[0])) is not None:
            del self.waiting[uid]  # a bound or deleted pod leaves the scheduling queue alike
        elif kind == "relabel" and (uid := self.pick(args[0])) is not None:
            pod = self.waiting[uid]
            pod.metadata.labels = {"gpufrac.io/queue": args[1]}
            pod.metadata.resourceVersion = self.bump()
            self.queue_at[uid] = self.directory.queue_of(pod)  # an update files the pod again
        elif kind == "namespace":
            self.labels[args[0]] = {"team": args[1]} if args[1] else {}
        elif kind == "queue":
            spec: dict[str, Any] = {}
            if args[1] is not None:
                spec["namespaceSelector"] = {"matchLabels": {"team": args[1]}}
            if args[2] is not None:
                spec["maxPriority"] = args[2]
            self.set_queue(args[0], spec)
        elif kind == "reparent":  # queue c deleted, or made a child of another queue, or top-level
            self.set_queue("c", None if args[0] is None else {"parentQueue": args[0]} if args[0] else {})
        elif kind == "nominate" and (uid := self.pick(args[0])) is not None:
            pod = self.waiting[uid]
            pending = PendingPod(
                pod.metadata.namespace, uid, uid, _request(), queue=self.directory.queue_of(pod)
            )
            self.engine.nominate(pending, "n1")
        elif kind == "unnominate" and (uid := self.pick(args[0])) is not None:
            self.engine.drop_nomination(uid)

    def full_read(self, skip: set[str]) -> dict[str, Amount]:
        """Every waiting pod read afresh: its queue's refusal, its demand; per queue, in pod order."""
        largest = self.engine.gpu_capacity()[2]
        out: dict[str, Amount] = {}
        for uid, pod in self.waiting.items():
            if self.directory.refusal(pod) is not None or uid in skip or self.engine.nominated(uid):
                continue
            demand = pod_demand(pod, largest_gpu_mib=largest)
            if demand is not None:
                queue = self.queue_at[uid]
                out[queue] = out.get(queue, Amount()) + demand
        return out


def _request() -> Any:
    from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, PodGpuRequest

    return PodGpuRequest((ContainerGpuRequest("main", GpuMemory(portion=0.25), None),))


ops = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.sampled_from(QUEUES),
        st.sampled_from(NAMESPACES),
        st.sampled_from(FRACTIONS),
        st.sampled_from((5, 100, 1000)),
    ),
    st.tuples(st.sampled_from(("bind", "delete", "nominate", "unnominate")), st.integers(0, 50)),
    st.tuples(st.just("relabel"), st.integers(0, 50), st.sampled_from(QUEUES)),
    st.tuples(st.just("namespace"), st.sampled_from(NAMESPACES), st.sampled_from(("", "x", "y"))),
    st.tuples(
        st.just("queue"),
        st.sampled_from(("a", "b")),
        st.sampled_from((None, "x", "y")),
        st.sampled_from((None, 100)),
    ),
    st.tuples(st.just("reparent"), st.sampled_from((None, "", "a", "parent"))),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(ops, st.integers(0, 3)), min_size=1, max_size=40))
def test_the_kept_demand_is_a_full_reads_after_any_sequence_of_changes(steps: list[tuple[Any, int]]) -> None:
    world = World()
    for op, skipped in steps:
        world.apply(op)
        skip = {uid for i in range(skipped) if (uid := world.pick(i * 7)) is not None}
        got = world.writer.waiting_demand(skip)
        assert {q.queue: q.amount for q in got} == world.full_read(skip), op
        assert len(got) == len({q.queue for q in got})  # one entry a queue


def test_summed_demand_gives_the_fair_shares_the_pods_own_entries_give() -> None:
    """The books read the per-queue sums; the fair shares and requests must be those of the pods'
    own entries, which is how they were computed before the sums."""
    world = World()
    for i in range(30):
        world.arrive(QUEUES[i % 3], NAMESPACES[i % 2], FRACTIONS[i % 2], 5)
    largest = world.engine.gpu_capacity()[2]
    each = [
        QueueAmount(world.directory.queue_of(p), pod_demand(p, largest_gpu_mib=largest) or Amount())
        for p in world.waiting.values()
    ]
    summed = world.writer.waiting_demand()
    assert len(summed) == 3 and len(each) == 30
    by_pod, by_queue = world.engine.queue_shares(waiting=each), world.engine.queue_shares(waiting=summed)
    for queue in QUEUES:
        for resource in QueueResource:
            assert by_pod.fair_share(queue, resource) == by_queue.fair_share(queue, resource)
            assert by_pod.requested(queue, resource) == by_queue.requested(queue, resource)


def test_a_namespace_with_no_pod_waiting_is_forgotten_and_its_new_labels_read_when_one_comes() -> None:
    """A scheduler runs for months while namespaces come and go: it remembers the labels of the
    namespaces with pods waiting only, and a namespace relabelled while none waited is read afresh."""
    world = World()
    world.apply(("queue", "a", "x", None))  # queue a takes namespaces labelled team=x only
    world.apply(("namespace", "ns1", "x"))
    world.arrive("a", "ns1", "0.5", 5)
    assert {q.queue for q in world.writer.waiting_demand()} == {"a"}
    world.apply(("delete", 0))
    assert world.writer.waiting_demand() == []
    assert world.writer._namespaces == {}  # nothing kept for a namespace with no pod waiting
    world.apply(("namespace", "ns1", "y"))  # relabelled while empty: queue a refuses its pods now
    world.arrive("a", "ns1", "0.5", 5)
    assert world.writer.waiting_demand() == [] == list(world.full_read(set()).items())
