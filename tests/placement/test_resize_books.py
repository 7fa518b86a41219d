"""Resizes against the engine's books: a random sequence of resize requests never takes a GPU past its
capacity, what is booked is exactly what the binding says, and a refused resize changes nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from placement_builders import mib, node, pod

from gpufrac.contract.keys import compute_portion_key
from gpufrac.contract.render import DeviceChoice, read_binding, render_binding
from gpufrac.contract.request import ComputeMode, GpuMemory
from gpufrac.contract.resize import ResizeAsk
from gpufrac.placement.decision import Placement
from gpufrac.placement.demand import PPM, portion_ppm
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import Queue, Quota
from gpufrac.placement.resize import ResizeOutcome, decide_resize

GPU_MIB = 16384


def _ask(request: int | float, limit: int | float | None = None) -> dict[str, ResizeAsk]:
    def memory(amount: int | float) -> GpuMemory:
        return GpuMemory(portion=amount) if isinstance(amount, float) else GpuMemory(mib=amount)

    low = memory(request)
    return {"main": ResizeAsk("main", low, memory(limit) if limit is not None else low, ("k", "v"))}


def _engine(*pods_mib: int, queues: tuple[Queue, ...] = ()) -> tuple[Engine, list[str]]:
    engine = Engine(policy="binpack", queues=queues)
    engine.add_node(node("n", gpus=2, mib=GPU_MIB))
    uids = []
    for amount in pods_mib:
        placed = engine.schedule([pod(mib(amount))])[0]
        assert isinstance(placed, Placement)
        uids.append(placed.pod_uid)
    return engine, uids


def _booked_as_written(engine: Engine, uid: str) -> None:
    """Render the booked placement as the binder would and read it back as the node (and a restarted
    scheduler) would: the same MiB."""
    placement = engine.placement_of(uid)
    held = engine.bound_pod(uid)
    assert placement is not None and held is not None
    choices = [
        DeviceChoice(c.container, c.uuids, c.devices[0].request_mib, c.devices[0].limit_mib)
        for c in placement.containers
    ]
    (bound,) = read_binding(render_binding(held.gpu, choices))
    (c,) = placement.containers
    assert (bound.request_mib, bound.limit_mib) == (c.devices[0].request_mib, c.devices[0].limit_mib)


def test_a_grow_that_fits_is_booked_on_the_same_gpu() -> None:
    engine, (small, _) = _engine(4096, 8192)
    gpu = engine.placement_of(small).containers[0].uuids  # type: ignore[union-attr]
    decision = decide_resize(engine, small, _ask(8192))
    assert decision.outcome is ResizeOutcome.FITS
    assert decision.placement.containers[0].uuids == gpu
    engine.assume(engine.bound_pod(small), decision.placement)  # type: ignore[arg-type]
    assert sum(g.capacity_mib - g.free_mib for g in engine.ledger("n")) == 16384
    _booked_as_written(engine, small)


def test_a_grow_beside_a_full_gpu_is_deferred_and_names_who_holds_the_room() -> None:
    engine, (a, b) = _engine(8192, 8192)  # binpack: both on the first GPU
    decision = decide_resize(engine, a, _ask(12288))
    assert decision.outcome is ResizeOutcome.DEFERRED
    assert "has 8192 MiB beside its other bookings; the pod would need 12288 MiB" in decision.message
    assert f"{engine.bound_pod(b).key} 8192 MiB" in decision.message  # type: ignore[union-attr]


def test_larger_than_the_gpu_or_past_the_queue_limit_is_infeasible() -> None:
    engine, (a,) = _engine(4096)
    assert decide_resize(engine, a, _ask(GPU_MIB + 1)).outcome is ResizeOutcome.INFEASIBLE
    limited = Queue("default", gpu_memory=Quota(limit=6144))
    engine, (a,) = _engine(4096, queues=(limited,))
    decision = decide_resize(engine, a, _ask(8192))
    assert decision.outcome is ResizeOutcome.INFEASIBLE and "limit of 6144 MiB" in decision.message
    assert decide_resize(engine, a, _ask(2048)).outcome is ResizeOutcome.FITS  # shrinking is never limited


resize = st.tuples(
    st.integers(0, 3),
    st.one_of(st.integers(1, 20000), st.floats(0.01, 0.99)),
    st.one_of(st.none(), st.integers(0, 8192)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(512, 8192), min_size=1, max_size=4), st.lists(resize, max_size=12))
def test_random_resize_sequences_keep_the_books_whole(sizes: list[int], steps: list[tuple]) -> None:
    engine, uids = _engine()
    for amount in sizes:
        placed = engine.schedule([pod(mib(amount))])[0]
        if isinstance(placed, Placement):
            uids.append(placed.pod_uid)
    for index, request, extra in steps:
        if not uids:
            break
        uid = uids[index % len(uids)]
        limit = None if extra is None or isinstance(request, float) else request + extra
        before = [engine.ledger("n"), engine.placement_of(uid)]
        decision = decide_resize(engine, uid, _ask(request, limit))
        if decision.outcome is ResizeOutcome.FITS:
            engine.assume(engine.bound_pod(uid), decision.placement)  # type: ignore[arg-type]
            (c,) = engine.placement_of(uid).containers  # type: ignore[union-attr]
            assert c.uuids == before[1].containers[0].uuids  # type: ignore[union-attr]  # never a move
        else:
            assert [engine.ledger("n"), engine.placement_of(uid)] == before
        for ledger in engine.ledger("n"):
            assert 0 <= ledger.free_mib <= ledger.capacity_mib
        booked = sum(
            d.request_mib
            for u in uids
            for c in engine.placement_of(u).containers
            for d in c.devices  # type: ignore[union-attr]
        )
        assert booked == sum(g.capacity_mib - g.free_mib for g in engine.ledger("n"))
        for u in uids:
            _booked_as_written(engine, u)


def test_an_sm_sharing_resize_keeps_its_compute_portion_and_a_multi_gpu_one_its_gpus() -> None:
    engine, _ = _engine()
    placed = engine.schedule([pod(mib(4096, mode=ComputeMode.SM_SHARING, count=2))])[0]
    assert isinstance(placed, Placement)
    before = [(g.uuid, g.compute_ppm) for g in engine.ledger("n")]
    decision = decide_resize(engine, placed.pod_uid, _ask(6144))
    assert decision.outcome is ResizeOutcome.FITS
    (c,) = decision.placement.containers
    assert c.uuids == placed.containers[0].uuids and len(c.uuids) == 2
    assert [d.compute_portion for d in c.devices] == [d.compute_portion for d in placed.containers[0].devices]
    assert {(d.request_mib, d.limit_mib) for d in c.devices} == {(6144, 6144)}
    engine.assume(engine.bound_pod(placed.pod_uid), decision.placement)  # type: ignore[arg-type]
    assert [(g.uuid, g.compute_ppm) for g in engine.ledger("n")] == before


def _compute(portion: float, memory: int | None = None) -> dict[str, ResizeAsk]:
    low = GpuMemory(mib=memory) if memory is not None else None
    return {"main": ResizeAsk("main", low, low, ("k", "v"), compute=portion)}


def test_an_sm_sharing_compute_resize_fits_beside_the_gpus_other_portions_or_waits() -> None:
    engine, _ = _engine()
    sm = ComputeMode.SM_SHARING
    a = engine.schedule([pod(mib(4096, mode=sm))])[0]
    b = engine.schedule([pod(mib(4096, mode=sm))])[0]
    assert isinstance(a, Placement) and isinstance(b, Placement)
    assert a.containers[0].uuids == b.containers[0].uuids  # binpack: one GPU, 0.25 + 0.25 of its compute
    (gpu,) = a.containers[0].uuids
    decision = decide_resize(engine, a.pod_uid, _compute(0.75))
    assert decision.outcome is ResizeOutcome.FITS, decision.message
    (c,) = decision.placement.containers
    assert [d.compute_portion for d in c.devices] == [0.75] and c.devices[0].request_mib == 4096
    assert "compute portion 0.25 -> 0.75" in decision.message
    engine.assume(engine.bound_pod(a.pod_uid), decision.placement)  # type: ignore[arg-type]
    assert {g.uuid: g.compute_ppm for g in engine.ledger("n")}[gpu] == 1_000_000

    grow = decide_resize(engine, b.pod_uid, _compute(0.5, memory=2048))  # memory fits, compute does not
    assert grow.outcome is ResizeOutcome.DEFERRED
    assert "has a compute portion of 0.25 beside its other sm-sharing bookings" in grow.message
    assert f"{engine.bound_pod(a.pod_uid).key} 0.75" in grow.message  # type: ignore[union-attr]
    shrink = decide_resize(engine, a.pod_uid, _compute(0.5))
    assert shrink.outcome is ResizeOutcome.FITS
    engine.assume(engine.bound_pod(a.pod_uid), shrink.placement)  # type: ignore[arg-type]
    both = decide_resize(engine, b.pod_uid, _compute(0.5, memory=2048))
    assert both.outcome is ResizeOutcome.FITS
    (c,) = both.placement.containers
    assert (c.devices[0].request_mib, c.devices[0].compute_portion) == (2048, 0.5)


def test_a_compute_resize_of_a_time_slicing_container_is_infeasible() -> None:
    engine, (a,) = _engine(4096)
    decision = decide_resize(engine, a, _compute(0.5))
    assert decision.outcome is ResizeOutcome.INFEASIBLE and "reserves no compute share" in decision.message


compute_step = st.tuples(
    st.integers(0, 3),
    st.one_of(st.none(), st.integers(1, 12000)),
    st.one_of(st.none(), st.integers(1, 1000).map(lambda n: n / 1000)),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(512, 8192), min_size=1, max_size=4), st.lists(compute_step, max_size=10))
def test_random_sm_sharing_resizes_keep_each_gpus_compute_within_one(
    sizes: list[int], steps: list[tuple]
) -> None:
    """Memory and compute asks on sm-sharing pods: a GPU's portions never sum past 1, the ledger's sum is
    the placements', and the portion booked is the one the binding says."""
    engine, uids = _engine()
    for amount in sizes:
        placed = engine.schedule([pod(mib(amount, mode=ComputeMode.SM_SHARING))])[0]
        if isinstance(placed, Placement):
            uids.append(placed.pod_uid)
    for index, memory, portion in steps:
        if not uids or (memory is None and portion is None):
            continue
        uid = uids[index % len(uids)]
        low = GpuMemory(mib=memory) if memory is not None else None
        asks = {"main": ResizeAsk("main", low, low, ("k", "v"), compute=portion)}
        before = [engine.ledger("n"), engine.placement_of(uid)]
        decision = decide_resize(engine, uid, asks)
        if decision.outcome is ResizeOutcome.FITS:
            engine.assume(engine.bound_pod(uid), decision.placement)  # type: ignore[arg-type]
        else:
            assert [engine.ledger("n"), engine.placement_of(uid)] == before
        held: dict[str, int] = {}
        for u in uids:
            placement = engine.placement_of(u)
            held_pod = engine.bound_pod(u)
            assert placement is not None and held_pod is not None
            (c,) = placement.containers
            for d in c.devices:
                assert d.compute_portion is not None
                held[d.uuid] = held.get(d.uuid, 0) + portion_ppm(d.compute_portion)
            choice = DeviceChoice(
                c.container,
                c.uuids,
                c.devices[0].request_mib,
                c.devices[0].limit_mib,
                c.devices[0].compute_portion,
            )
            written = render_binding(held_pod.gpu, [choice])[compute_portion_key("main")]
            # What a restarted scheduler books again from the pod's annotation: the same ppm.
            assert portion_ppm(float(written)) == portion_ppm(c.devices[0].compute_portion)
        for ledger in engine.ledger("n"):
            assert ledger.compute_ppm == held.get(ledger.uuid, 0) <= PPM
