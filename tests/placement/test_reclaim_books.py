"""Reclaim decided against the books as they will be (issue #36).

A scheduler decides reclaims one pod at a time while earlier victims are still terminating (booked in the
engine, holding their GPUs) and earlier reclaimers are only nominated. These tests drive the engine the
way ``gpufrac.scheduler.preemption`` does, a decision after another: each decision's victims are leaving
(``Engine.queue_shares(leaving=...)``, excluded as victims), its pod is nominated and the free part of
its room is held. The oracle recomputes the fair shares from the tree with ``fair_shares`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from placement_builders import mib, node, pod, whole

from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.fair_share import fair_shares
from gpufrac.placement.model import PendingPod, Queue, QueueResource, Quota
from gpufrac.placement.preemption import Kind, find_victims, free_part, simulate
from gpufrac.placement.queue_shares import Amount, QueueAmount, placed_amount, request_amount

GB80 = 81920
HALF = 40960
MEMORY = QueueResource.GPU_MEMORY


@dataclass
class Reclaims:
    """A scheduler's books between decisions: victims leaving, nominees and their held rooms."""

    engine: Engine
    leaving: set[str] = field(default_factory=set)
    nominated: dict[str, Placement] = field(default_factory=dict)
    pods: dict[str, PendingPod] = field(default_factory=dict)
    victims_of: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def decide(self, pending: PendingPod, waiting: list[PendingPod]):
        largest = int(self.engine.state.cap.max())
        rest = [QueueAmount(p.queue, request_amount(p.gpu, largest)) for p in waiting]
        shares = self.engine.queue_shares(leaving=self.leaving, waiting=rest)
        found = find_victims(self.engine, pending, kind=Kind.RECLAIM, shares=shares, exclude=self.leaving)
        if found is not None:
            self.leaving |= set(found.victims)
            self.engine.nominate(pending, found.node)
            key = f"room-hold/{pending.uid}"
            room = free_part(self.engine, key, found.placement)
            if room is not None:
                self.engine.hold(key, room, namespace=pending.namespace)
            self.nominated[pending.uid] = found.placement
            self.pods[pending.uid] = pending
            self.victims_of[pending.uid] = found.victims
        return found, shares

    def carry_out(self) -> None:
        """Every victim gone, every hold given back, every nominee booked where its plan placed it."""
        for uid in self.nominated:
            self.engine.release_hold(f"room-hold/{uid}")
        for uid in self.leaving:
            self.engine.forget(uid)
        for uid, placement in self.nominated.items():
            self.engine.drop_nomination(uid)
            self.engine.assume(self.pods[uid], placement)


def worked_example_queues() -> list[Queue]:
    """docs/queues.md's worked example tree (research: vision, nlp; prod; batch)."""
    return [
        Queue("research", gpu_memory=Quota(deserved=327680, over_quota_weight=2)),
        Queue("vision", parent="research", gpu_memory=Quota(deserved=163840)),
        Queue("nlp", parent="research", gpu_memory=Quota(deserved=163840, over_quota_weight=3)),
        Queue("prod", gpu_memory=Quota(deserved=245760, limit=327680)),
        Queue("batch", gpu_memory=Quota(deserved=0)),
    ]


def issue_cluster(held: dict[str, int]) -> Engine:
    e = Engine(policy="binpack", seed=1, queues=worked_example_queues())
    for i in range(4):
        e.add_node(node(f"n{i}", gpus=2, mib=GB80))
    for queue, count in held.items():
        for i in range(count):
            assert isinstance(e.place(pod(mib(HALF), name=f"{queue}-{i}", queue=queue)), Placement)
    return e


def allocated(e: Engine, queue: str) -> int:
    return e.queues.allocated(queue, MEMORY)


def test_five_prod_pods_at_once_reclaim_from_batch_not_vision_and_the_fifth_evicts_nobody():
    """The issue's first report: batch 245760 (deserved 0), prod 163840, vision 204800, nlp 40960 on a
    full cluster; five prod pods at once. Before, all five victims came from vision (its leaving pods
    still counted, prod's nominees not) and prod-9, refused by prod's limit, still evicted a pod."""
    e = issue_cluster({"batch": 6, "prod": 4, "vision": 5, "nlp": 1})
    books = Reclaims(e)
    pending = [pod(mib(HALF), name=f"prod-{5 + i}", queue="prod") for i in range(5)]
    outcomes = []
    for i, p in enumerate(pending):
        found, shares = books.decide(p, pending[i + 1 :])
        outcomes.append(found)
        if i == 0:
            # The numbers the Events tell: prod's share with its demand, batch's excess.
            assert shares.fair_share("prod") == 327680 and shares.allocated("prod") == 163840
            assert shares.fair_share("batch") == 81920 and shares.allocated("batch") == 245760
            assert shares.fair_share("vision") == 204800
    taken = [v for f in outcomes if f is not None for v in f.victims]
    queues = [e.bound_pod(v).queue for v in taken]
    assert queues == ["batch"] * 4, queues
    assert outcomes[4] is None  # prod at its limit 327680 with four nominees: prod-9 evicts nobody
    books.carry_out()
    assert allocated(e, "prod") == 327680 and allocated(e, "batch") == 81920
    assert allocated(e, "vision") == 204800 and allocated(e, "nlp") == 40960


def test_vision_reclaiming_from_prod_at_its_limit_leaves_prod_at_its_fair_share():
    """The issue's second report, the other way: prod at its limit, four vision pods waiting. Before, all
    four victims came from prod, far below its deserved 245760, while batch kept everything."""
    e = issue_cluster({"batch": 4, "prod": 8, "vision": 3, "nlp": 1})
    books = Reclaims(e)
    pending = [pod(mib(HALF), name=f"vision-{3 + i}", queue="vision") for i in range(4)]
    for i, p in enumerate(pending):
        books.decide(p, pending[i + 1 :])
    taken = [e.bound_pod(v).queue for v in books.leaving]
    books.carry_out()
    assert allocated(e, "prod") >= 245760, taken
    assert "batch" in taken
    assert allocated(e, "vision") <= 204800 + 2 * HALF


# -- property: random trees, pending sets, reclaimers one after another ----------------------------------


@st.composite
def trees(draw):
    """2-3 top-level queues, some with 1-2 children; pods join leaves."""
    queues, leaves = [], []
    for t in range(draw(st.integers(2, 3))):
        name = f"t{t}"
        deserved = draw(st.sampled_from([0, 8000, 16000, 32000]))
        weight = draw(st.sampled_from([0.0, 1.0, 2.0]))
        limit = draw(st.sampled_from([None, None, 24000, 48000]))
        queues.append(Queue(name, gpu_memory=Quota(deserved, weight, limit)))
        kids = draw(st.integers(0, 2))
        for k in range(kids):
            child = f"{name}.{k}"
            queues.append(
                Queue(
                    child,
                    parent=name,
                    gpu_memory=Quota(
                        draw(st.sampled_from([0, 8000, 16000])),
                        draw(st.sampled_from([0.0, 1.0, 3.0])),
                        draw(st.sampled_from([None, 16000])),
                    ),
                )
            )
            leaves.append(child)
        if not kids:
            leaves.append(name)
    return queues, leaves


shapes = st.sampled_from([mib(4000), mib(4000), mib(8000), mib(12000), whole(1)])


@st.composite
def situations(draw):
    queues, leaves = draw(trees())
    e = Engine(policy=draw(st.sampled_from(["binpack", "fgd"])), seed=draw(st.integers(0, 3)), queues=queues)
    for i in range(draw(st.integers(2, 3))):
        e.add_node(node(f"n{i}", gpus=2, mib=16000))
    # One queue holds most of a full cluster; the others come asking.
    hog = draw(st.sampled_from(leaves))
    for i in range(draw(st.integers(8, 20))):
        queue = hog if draw(st.integers(0, 9)) < 7 else draw(st.sampled_from(leaves))
        e.place(pod(draw(shapes), name=f"p{i}", queue=queue, priority=draw(st.integers(0, 2))))
    others = [q for q in leaves if q != hog] or leaves
    pending = [
        pod(draw(shapes), name=f"w{i}", queue=draw(st.sampled_from(others)), priority=draw(st.integers(0, 2)))
        for i in range(draw(st.integers(1, 6)))
    ]
    return e, pending


def will_be(e: Engine, books: Reclaims, waiting: list[PendingPod]):
    """The oracle's own account: per queue (subtree) what it will hold, and the fair shares."""
    own: dict[str, int] = {}
    for uid in e.bound_uids:
        if uid in books.leaving:
            continue
        held = e.booked_amount(uid)
        own[held.queue] = own.get(held.queue, 0) + held.amount.mib
    for uid, placement in books.nominated.items():
        queue = books.pods[uid].queue
        own[queue] = own.get(queue, 0) + placed_amount(placement).mib
    largest = int(e.state.cap.max())
    demand = dict(own)
    for p in waiting:
        demand[p.queue] = demand.get(p.queue, 0) + request_amount(p.gpu, largest).mib
    share = fair_shares(e.queues.queues, demand, int(e.state.cap_total.sum()))
    subtree: dict[str, int] = {}
    for queue, amount in own.items():
        for q in e.queues.lineage(queue):
            subtree[q] = subtree.get(q, 0) + amount
    return subtree, {q: int(v) for q, v in share.items()}


def within(before, freed, mine, ours, bar) -> bool:
    """The reclaimer's lineage ends within ``bar`` with its pod placed; no victim queue ends below it."""
    for q in ours:
        if before.get(q, 0) - freed.get(q, 0) + mine > bar.get(q, 0):
            return False
    return all(before[q] - gone >= bar.get(q, 0) for q, gone in freed.items() if q not in ours)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(situations())
def test_reclaimers_one_after_another_never_over_evict_nor_share_a_room(situation):
    e, pending = situation
    books = Reclaims(e)
    decided = 0
    for i, p in enumerate(pending):
        if e.queues.get(p.queue).parent is None and any(q.parent == p.queue for q in e.queues.queues):
            continue
        waiting = pending[i + 1 :]
        before, share = will_be(e, books, [*waiting, p])
        found, _ = books.decide(p, waiting)
        if found is None:
            continue
        assert not set(found.victims) & (books.leaving - set(found.victims)), "a victim chosen twice"
        mine = placed_amount(found.placement).mib
        ours = e.queues.lineage(p.queue)
        freed: dict[str, int] = {}
        for v in found.victims:
            held = e.booked_amount(v)
            assert held.queue not in ours, "reclaim took from the reclaimer's own queue"
            for q in e.queues.lineage(held.queue):
                freed[q] = freed.get(q, 0) + held.amount.mib
        deserved = {q.name: q.deserved(MEMORY, int(e.state.cap_total.sum())) for q in e.queues.queues}
        for q in ours:
            limit = e.queues.get(q).gpu_memory.limit
            after = before.get(q, 0) - freed.get(q, 0) + mine
            assert limit is None or after <= limit, f"queue {q} past its limit {limit}"
        # Fair share protected (KAI's first strategy), or else deserved quotas (its second).
        assert within(before, freed, mine, ours, share) or within(before, freed, mine, ours, deserved)
        # No victim evicted for a pod that would not then be placed (the held room given back first).
        e.release_hold(f"room-hold/{p.uid}")
        e.drop_nomination(p.uid)
        assert simulate(e, p, list(found.victims)) == found.placement
        e.nominate(p, found.node)
        room = free_part(e, f"room-hold/{p.uid}", found.placement)
        if room is not None:
            e.hold(f"room-hold/{p.uid}", room, namespace=p.namespace)
        decided += 1
    note(f"{decided} reclaim(s) decided")
    event("some reclaim decided" if decided else "no reclaim")
    # Every plan at once: the rooms are disjoint, no GPU is booked past its memory, no queue past a limit.
    books.carry_out()
    for n in e.node_names:
        for ledger in e.ledger(n):
            assert ledger.free_mib >= 0, f"{ledger.uuid} double-booked"
    for q in e.queues.queues:
        limit = q.gpu_memory.limit
        assert limit is None or e.queues.allocated(q.name, MEMORY) <= limit


def test_leaving_pods_do_not_count_and_nominees_do():
    e = issue_cluster({"batch": 2, "prod": 1})
    batch = [uid for uid in e.bound_uids if e.bound_pod(uid).queue == "batch"]
    p = pod(mib(HALF), name="prod-x", queue="prod")
    e.nominate(p, "n3")
    shares = e.queue_shares(leaving=batch[:1])
    assert shares.allocated("batch") == HALF
    assert shares.allocated("prod") == 2 * HALF
    assert shares.exceeded("prod", Amount(7 * HALF)) == ("prod", MEMORY, 327680)
    assert shares.exceeded("prod", Amount(7 * HALF), freed=[QueueAmount("prod", Amount(HALF))]) is None
