"""The queues' books a preemption decision reads (``gpufrac.scheduler.preemption_books``).

Preemption's book leaves the waiting pods' demand out (reading it is one look at every waiting pod); the
limit check it makes answers as the full book's does, and both books follow a filed plan.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.gang_preemption import GangPreemption
from gpufrac.placement.model import GpuDevice, NodeSpec, PendingPod, Queue, Quota
from gpufrac.placement.preemption import Kind, Preemption
from gpufrac.placement.queue_shares import Amount, QueueAmount
from gpufrac.scheduler.preemption_books import LeavingTally, PlanBooks, PlannedTally
from gpufrac.scheduler.preemption_events import plan_amounts

GIB = 1024


def half_gpu() -> PodGpuRequest:
    return PodGpuRequest((ContainerGpuRequest("main", GpuMemory(portion=0.5), None),))


def engine_with_one_pod() -> Engine:
    """Two 80 GiB GPUs; queue prod (limit 100 GiB) holds one half GPU (40 GiB); queue dev has none."""
    engine = Engine(policy="binpack", queues=[Queue("prod", gpu_memory=Quota(limit=100 * GIB)), Queue("dev")])
    gpus = tuple(GpuDevice(f"g{i}", i, 80 * GIB, "H100") for i in range(2))
    engine.add_node(NodeSpec("n", 64_000, 1 << 40, gpus=gpus))
    placed = engine.place(PendingPod("ns", "a", "a", half_gpu(), queue="prod"))
    assert isinstance(placed, Placement)
    return engine


def test_preemptions_book_checks_the_queue_limit_as_the_full_book_does_without_reading_the_waiting_pods() -> (
    None
):
    engine = engine_with_one_pod()
    asked: list[list[object]] = []
    # Pod b is an open plan's, held for prod: its demand is not counted twice.
    waiting = [
        ("d", QueueAmount("dev", Amount(120 * GIB, 0))),
        ("b", QueueAmount("prod", Amount(40 * GIB, 0))),
    ]
    planned = {"b": QueueAmount("prod", Amount(40 * GIB, 0))}

    def demand(cycle: list[object]) -> list[tuple[str, QueueAmount]]:
        asked.append(cycle)
        return waiting

    books = PlanBooks(engine, planned=lambda: planned, leaving=set, waiting=demand)
    held = books.of(Kind.PREEMPT)
    assert asked == []  # preemption's book never looked at the waiting pods
    full = books.of(Kind.RECLAIM)
    assert len(asked) == 1  # reclaim's did
    assert full.requested("prod") == 80 * GIB  # held 40 + nominated 40; b's ask not counted again
    # 40 GiB placed + 40 GiB nominated: 20 GiB more fits under the 100 GiB limit, 21 GiB does not.
    for mib in (20 * GIB, 21 * GIB):
        assert held.exceeded("prod", Amount(mib, 0)) == full.exceeded("prod", Amount(mib, 0))
    assert held.exceeded("prod", Amount(21 * GIB, 0)) is not None
    assert held.exceeded("prod", Amount(20 * GIB, 0)) is None
    # The fair shares are reclaim's: the waiting demand moves them, and only the full book has it.
    assert full.requested("dev") == 120 * GIB
    assert books.of(Kind.PREEMPT) is held and books.of() is full  # built once until something changes


def test_both_books_follow_a_filed_plan_and_a_new_cycle() -> None:
    engine = engine_with_one_pod()
    planned: dict[str, QueueAmount] = {}
    leaving: set[str] = set()
    books = PlanBooks(engine, planned=lambda: planned, leaving=lambda: leaving, waiting=lambda cycle: [])
    assert books.of(Kind.PREEMPT).allocated("prod") == 40 * GIB
    full = books.of()
    # A plan: pod a leaves, pod c (60 GiB) is nominated in its place.
    leaving.add("a")
    planned["c"] = QueueAmount("prod", Amount(60 * GIB, 0))
    assert books.filed() is full  # the book the plan was decided on, for its Events
    assert books.of(Kind.PREEMPT).allocated("prod") == 60 * GIB
    assert books.of().allocated("prod") == 60 * GIB
    assert books.of(Kind.PREEMPT).exceeded("prod", Amount(41 * GIB, 0)) is not None
    # A plan decided on preemption's book alone tells no fair shares: no full book to hand back.
    books.new_cycle([])
    books.of(Kind.PREEMPT)
    assert books.filed() is None


def test_the_waiting_pods_are_read_once_a_cycle_and_each_plan_takes_its_pod_out_of_them() -> None:
    engine = engine_with_one_pod()
    planned: dict[str, QueueAmount] = {}
    reads: list[list[object]] = []
    asks = [(uid, QueueAmount("dev", Amount(10 * GIB, 0))) for uid in ("x", "y", "z")]

    def demand(cycle: list[object]) -> list[tuple[str, QueueAmount]]:
        reads.append(cycle)
        return asks

    books = PlanBooks(engine, planned=lambda: planned, leaving=set, waiting=demand)
    books.new_cycle(["pod-of-this-cycle"])  # type: ignore[list-item]
    assert books.of().requested("dev") == 30 * GIB
    # A plan for x: x is a nominee now (held, 10 GiB), no longer waiting.
    planned["x"] = QueueAmount("dev", Amount(10 * GIB, 0))
    books.filed()
    assert books.of().allocated("dev") == 10 * GIB
    assert books.of().requested("dev") == 30 * GIB  # 10 held + y and z waiting, x not counted twice
    # A pod the engine nominated (a plan of an earlier cycle, seen on the watch) is held, not waiting.
    engine.nominate(PendingPod("ns", "y", "y", half_gpu(), queue="dev"), "n")
    books.filed()
    assert books.of().requested("dev") == 10 * GIB + 40 * GIB + 10 * GIB  # x, y's half GPU held; z waits
    assert reads == [["pod-of-this-cycle"]]  # one read for the cycle, its own pods with it
    books.new_cycle([])
    books.of()
    assert reads == [["pod-of-this-cycle"], []]


def _plan(uids: list[str], mib: int):
    """A plan making room for ``uids`` (a gang's when more than one), each booking ``mib`` on one GPU."""
    placements = tuple(
        Placement(
            uid,
            "n",
            (
                ContainerPlacement(
                    "main", ComputeMode.TIME_SLICING, False, (DeviceAssignment("GPU-0", 0, mib, mib, None),)
                ),
            ),
        )
        for uid in uids
    )
    if len(uids) == 1:
        return Preemption(Kind.PREEMPT, "n", ("victim",), placements[0])
    return GangPreemption(Kind.PREEMPT, ("victim",), ("n",), placements)


@settings(max_examples=200)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("file"),
                st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=3, unique=True),
                st.integers(1, 80 * GIB),
                st.sampled_from(["prod", "dev"]),
            ),
            st.tuples(st.just("close"), st.integers(0, 10)),
        ),
        max_size=30,
    )
)
def test_the_planned_tally_is_what_the_open_plans_book_after_any_filing_and_closing(ops) -> None:
    """Filed and closed as ``Preemptions`` does: a plan under its pods' uids (a gang's also under its
    key), a later plan for a pod taking that uid over, a plan closed once and only while open. A pod
    in two open plans (a gang member with a plan of its own) included."""
    open_: dict[str, tuple[object, str]] = {}
    tally = PlannedTally(lambda: list(open_.values()))
    for step, op in enumerate(ops):
        if op[0] == "file":
            _, uids, mib, queue = op
            entry = (_plan(uids, mib), queue)
            for key in ([f"gang-{step}"] if len(uids) > 1 else []) + uids:
                open_[key] = entry
            tally.filed(*entry)
        else:
            distinct = list({id(e): e for e in open_.values()}.values())
            if not distinct:
                continue
            entry = distinct[op[1] % len(distinct)]
            for key in [k for k, e in open_.items() if e is entry]:
                del open_[key]
            tally.closed(*entry)
        expected = plan_amounts(list(open_.values()))
        assert dict(tally.get()) == expected
        sums: dict[str, Amount] = {}
        for amount in expected.values():
            sums[amount.queue] = sums.get(amount.queue, Amount()) + amount.amount
        assert {e.queue: e.amount for e in tally.get().totals()} == sums


def test_the_leaving_tally_counts_a_cycles_victims_as_filed_and_reads_the_engine_again_when_stale() -> None:
    engine = engine_with_one_pod()
    engine.place(PendingPod("ns", "b", "b", half_gpu(), queue="dev"))
    leaving: set[str] = set()
    tally = LeavingTally(engine, lambda: leaving)
    assert tally.get().totals() == []
    tally.add(["a", "not-booked"])  # a plan's victims: what each holds, a pod not booked holds nothing
    assert tally.get().totals() == [QueueAmount("prod", Amount(40 * GIB, 0))]
    leaving.add("b")  # known to the engine's side only: not read until the tally is stale
    assert len(tally.get()) == 1
    tally.stale()
    assert {e.queue for e in tally.get().totals()} == {"dev"}
    assert engine.queue_shares(leaving=tally.get()).allocated("dev") == 0
    assert engine.queue_shares(leaving=tally.get()).allocated("prod") == 40 * GIB
