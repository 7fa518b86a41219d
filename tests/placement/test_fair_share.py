"""Hierarchical fair share (gpufrac.placement.fair_share): the worked example of docs/queues.md, the
properties the docs promise (conservation, caps, deserved first, monotonicity), and queue limits on the
engine's books (a parent's limit caps its children; whole GPUs are counted)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import mib, node, pod, whole

from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.fair_share import QueueBook, fair_shares
from gpufrac.placement.model import Queue, QueueResource, Quota

DOC = Path(__file__).resolve().parents[2] / "docs" / "queues.md"
CLOSE = 1e-6


def _cell(text: str) -> int | None:
    text = text.strip()
    return int(text) if text else None


def test_the_worked_example_in_docs_queues_md():
    text = DOC.read_text()
    table = text.split("<!-- worked-example -->")[1].split("<!-- /worked-example -->")[0]
    rows = [r for r in table.strip().splitlines()[2:]]
    queues, demand, expected = [], {}, {}
    for row in rows:
        name, parent, deserved, weight, limit, want, share = (c.strip() for c in row.strip("|").split("|"))
        queues.append(
            Queue(
                name,
                parent=parent or None,
                gpu_memory=Quota(deserved=int(deserved), over_quota_weight=float(weight), limit=_cell(limit)),
            )
        )
        if want:
            demand[name] = int(want)
        expected[name] = int(share)
    capacity = int(re.search(r"(\d+) MiB of GPU memory", text).group(1))
    assert capacity == 4 * 2 * 81920
    got = fair_shares(queues, demand, capacity)
    assert {name: round(share) for name, share in got.items()} == expected
    assert all(math.isclose(got[n], expected[n], abs_tol=CLOSE) for n in expected)  # not only when rounded


def test_deserved_is_guaranteed_and_the_rest_follows_weights():
    queues = [
        Queue("a", gpu_memory=Quota(deserved=100, over_quota_weight=1)),
        Queue("b", gpu_memory=Quota(deserved=100, over_quota_weight=3)),
    ]
    # Both want everything: deserved 100 each, the remaining 400 split 1:3.
    assert fair_shares(queues, {"a": 1000, "b": 1000}, 600) == {"a": 200.0, "b": 400.0}
    # b wants nothing: a may use it all (work-conserving), its deserved is no cap.
    assert fair_shares(queues, {"a": 1000}, 600) == {"a": 600.0, "b": 0.0}


def test_over_committed_deserved_is_scaled_and_weight_zero_only_takes_leftovers():
    queues = [Queue("a", gpu_memory=Quota(deserved=300)), Queue("b", gpu_memory=Quota(deserved=100))]
    assert fair_shares(queues, {"a": 500, "b": 500}, 200) == {"a": 150.0, "b": 50.0}
    lazy = [
        Queue("w", gpu_memory=Quota(over_quota_weight=1)),
        Queue("z", gpu_memory=Quota(over_quota_weight=0)),
    ]
    assert fair_shares(lazy, {"w": 70, "z": 100}, 100) == {"w": 70.0, "z": 30.0}
    assert fair_shares(lazy, {"w": 700, "z": 100}, 100) == {"w": 100.0, "z": 0.0}


def test_whole_gpus_use_their_own_terms():
    queues = [Queue("a", gpus=Quota(deserved=3), gpu_memory=Quota(deserved=0)), Queue("b")]
    got = fair_shares(queues, {"a": 8, "b": 8}, 8, resource=QueueResource.GPUS)
    assert got == {"a": 5.5, "b": 2.5}


def test_unknown_parent_and_cycles_are_top_level():
    queues = [Queue("x", parent="y"), Queue("y", parent="x"), Queue("orphan", parent="gone")]
    got = fair_shares(queues, {"x": 10, "y": 10, "orphan": 10}, 30)
    assert got == {"x": 10.0, "y": 10.0, "orphan": 10.0}


# -- properties -----------------------------------------------------------------------------------------


@st.composite
def trees(draw: st.DrawFn, *, leaf_demand_only: bool = False) -> tuple[list[Queue], dict[str, int], int]:
    count = draw(st.integers(1, 8))
    queues: list[Queue] = []
    for i in range(count):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        limit = draw(st.one_of(st.none(), st.integers(0, 2000)))
        queues.append(
            Queue(
                f"q{i}",
                parent=None if parent is None else f"q{parent}",
                gpu_memory=Quota(
                    deserved=draw(st.integers(0, 1500)),
                    over_quota_weight=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])),
                    limit=limit,
                ),
            )
        )
    parents = {q.parent for q in queues}
    demand = {
        q.name: draw(st.integers(0, 2000)) for q in queues if not leaf_demand_only or q.name not in parents
    }
    return queues, demand, draw(st.integers(0, 5000))


def _wants(queues: list[Queue], demand: dict[str, int]) -> dict[str, int]:
    by_name = {q.name: q for q in queues}
    wants: dict[str, int] = {}
    for q in reversed(queues):  # children come after their parents
        total = demand.get(q.name, 0) + sum(wants[c.name] for c in queues if c.parent == q.name)
        limit = by_name[q.name].gpu_memory.limit
        wants[q.name] = total if limit is None else min(total, limit)
    return wants


@given(trees(leaf_demand_only=True))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_conservation_caps_and_deserved(case):
    queues, demand, capacity = case
    check_conservation_caps_and_deserved(queues, demand, capacity, fair_shares(queues, demand, capacity))


def check_conservation_caps_and_deserved(
    queues: list[Queue], demand: dict[str, int], capacity: int, shares: dict[str, float]
) -> None:
    """What every fair share keeps (docs/queues.md): nothing wanted idle, caps, deserved first."""
    wants = _wants(queues, demand)
    roots = [q for q in queues if q.parent is None]
    # Nothing wanted stays idle: the top level gets all of the capacity or all it wants.
    assert math.isclose(
        sum(shares[q.name] for q in roots), min(capacity, sum(wants[q.name] for q in roots)), abs_tol=CLOSE
    )
    for q in queues:
        children = [c for c in queues if c.parent == q.name]
        if children:  # a parent's share is divided entirely among its children
            assert math.isclose(sum(shares[c.name] for c in children), shares[q.name], abs_tol=CLOSE)
        assert shares[q.name] <= wants[q.name] + CLOSE
        if q.gpu_memory.limit is not None:
            assert shares[q.name] <= q.gpu_memory.limit + CLOSE
    # Deserved first: where the siblings' deserved amounts fit in what their parent has, each gets at
    # least its deserved amount (or all it wants).
    for parent in [None, *(q.name for q in queues)]:
        siblings = [q for q in queues if q.parent == parent]
        available = capacity if parent is None else shares[parent]
        promised = sum(min(q.gpu_memory.deserved, wants[q.name]) for q in siblings)
        if siblings and promised <= available:
            for q in siblings:
                assert shares[q.name] >= min(q.gpu_memory.deserved, wants[q.name]) - CLOSE


@given(trees(), st.integers(1, 3000))
@settings(max_examples=300, deadline=None)
def test_more_capacity_never_lowers_a_share(case, more):
    queues, demand, capacity = case
    before = fair_shares(queues, demand, capacity)
    after = fair_shares(queues, demand, capacity + more)
    assert all(after[n] >= before[n] - CLOSE for n in before)


@given(trees(), st.data())
@settings(max_examples=300, deadline=None)
def test_asking_for_more_never_raises_another_queues_share(case, data):
    queues, demand, capacity = case
    asker = data.draw(st.sampled_from([q.name for q in queues]))
    more = data.draw(st.integers(1, 2000))
    before = fair_shares(queues, demand, capacity)
    after = fair_shares(queues, {**demand, asker: demand.get(asker, 0) + more}, capacity)
    book = QueueBook()
    book.replace(queues)
    # The asker's own tree may gain: its ancestors, and through them queues beside its line (when the
    # capacity cannot cover the deserved amounts, a parent's part grows with what its children want,
    # and it divides that among all of them). No queue of another top-level tree does.
    root = book.lineage(asker)[-1]
    line = {q.name for q in queues if book.lineage(q.name)[-1] == root}
    assert after[asker] >= before[asker] - CLOSE
    for name in before:
        if name not in line:
            assert after[name] <= before[name] + CLOSE, (name, before[name], after[name])


# -- limits on the engine's books ------------------------------------------------------------------------


def build(*nodes, queues) -> Engine:
    e = Engine(policy="binpack", queues=queues)
    for n in nodes:
        e.add_node(n)
    return e


def test_a_parents_limit_caps_its_children_together():
    e = build(
        node("a", gpus=4),
        queues=[
            Queue("team", gpu_memory=Quota(limit=20_000)),
            Queue("x", parent="team"),
            Queue("y", parent="team"),
        ],
    )
    assert isinstance(e.place(pod(mib(12_000), name="x1", queue="x")), Placement)
    over = e.place(pod(mib(12_000), name="y1", queue="y"))
    assert isinstance(over, Unschedulable)
    assert "queue y would take its ancestor queue team past that queue's GPU-memory limit of 20000 MiB" in (
        over.message
    )
    assert isinstance(e.place(pod(mib(8_000), name="y2", queue="y")), Placement)
    assert e.queues.allocated("team", QueueResource.GPU_MEMORY) == 20_000
    assert e.queues.own("team", QueueResource.GPU_MEMORY) == 0


def test_whole_gpu_limit_counts_exclusive_devices_and_forget_returns_them():
    e = build(node("a", gpus=4), queues=[Queue("w", gpus=Quota(limit=2))])
    first = e.place(pod(whole(2), name="two", queue="w"))
    assert isinstance(first, Placement)
    assert e.queues.allocated("w", QueueResource.GPUS) == 2
    over = e.place(pod(whole(1), name="third", queue="w"))
    assert isinstance(over, Unschedulable) and "limit of 2 whole GPUs" in over.message
    # A fraction is no whole GPU: it is not counted against the whole-GPU limit.
    assert isinstance(e.place(pod(mib(1000), name="frac", queue="w")), Placement)
    e.forget(first.pod_uid)
    assert e.queues.allocated("w", QueueResource.GPUS) == 0
    assert isinstance(e.place(pod(whole(1), name="again", queue="w")), Placement)


def test_reparenting_moves_a_queues_usage_to_its_new_ancestors():
    e = build(node("a", gpus=2), queues=[Queue("p"), Queue("c", parent="p")])
    assert isinstance(e.place(pod(mib(5000), queue="c")), Placement)
    assert e.queues.allocated("p", QueueResource.GPU_MEMORY) == 5000
    e.set_queues([Queue("p"), Queue("q"), Queue("c", parent="q")])
    assert e.queues.allocated("p", QueueResource.GPU_MEMORY) == 0
    assert e.queues.allocated("q", QueueResource.GPU_MEMORY) == 5000


def placing_order(e, pods) -> list[str]:
    """The names of ``pods`` in the order ``Engine.schedule`` places them."""
    order: list[str] = []
    original = e.place

    def spy(p):
        order.append(p.name)
        return original(p)

    e.place = spy
    e.schedule(pods)
    return order


def test_queue_order_compares_parents_before_children():
    """The child of a parent below its share goes before the child of a parent above it, whatever the
    children's own standing."""
    e = build(
        node("a", gpus=2),
        queues=[
            Queue("rich", gpu_memory=Quota(deserved=10_000)),
            Queue("poor", gpu_memory=Quota(deserved=10_000)),
            Queue("rich-kid", parent="rich", gpu_memory=Quota(deserved=10_000)),
            Queue("rich-other", parent="rich"),
            Queue("poor-kid", parent="poor"),  # no deserved share of its own
        ],
    )
    assert isinstance(e.place(pod(mib(8000), queue="rich-other")), Placement)  # rich: 80% of its share
    order = placing_order(
        e,
        [
            pod(mib(1000), name="from-rich-kid", queue="rich-kid", arrival=1),
            pod(mib(1000), name="from-poor-kid", queue="poor-kid", arrival=2),
        ],
    )
    # Flat, rich-kid (0% of its share) would go first and poor-kid (no share) last.
    assert order == ["from-poor-kid", "from-rich-kid"]


def test_queue_order_follows_the_fair_share_not_only_the_deserved_quota():
    """Issue #36: one share drives order, reclaim and status. Two queues with no deserved quota used to
    tie (both "no share", arrival decides); by fair share (weights 1:3, the batch as demand) b holds
    nothing of its 4000 MiB share and a holds 8000 of 12000, so b's pod goes first."""
    e = build(
        node("a", gpus=2),
        queues=[
            Queue("a", gpu_memory=Quota(over_quota_weight=1)),
            Queue("b", gpu_memory=Quota(over_quota_weight=3)),
        ],
    )
    assert isinstance(e.place(pod(mib(8000), queue="a")), Placement)
    order = placing_order(
        e,
        [
            pod(mib(4000), name="from-a", queue="a", arrival=1),
            pod(mib(4000), name="from-b", queue="b", arrival=2),
        ],
    )
    assert order == ["from-b", "from-a"]
