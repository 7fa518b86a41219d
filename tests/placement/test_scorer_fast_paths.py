"""fgd-room's scorers give, on the short paths they take for speed, exactly what the straightforward
arithmetic gives: the stranded room with one share size for the whole cluster and no CPU charge, the
alignment with one request for all nodes, FGD's best score per node. A placement that moved because a
shortcut rounded differently would change every decision after it, so equality is exact."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
from placement_builders import fraction, mib, node, pod, whole

from gpufrac.contract.request import ComputeMode, GpuMemory
from gpufrac.placement.decision import Placement
from gpufrac.placement.demand import Demand, demand_of
from gpufrac.placement.engine import Engine
from gpufrac.placement.filters import Fit, GpuRules, resource_fit
from gpufrac.placement.fragmentation import Fgd, _sigmoid_score, cpu_stranded
from gpufrac.placement.room_waste import RoomWaste, one_gpu_shares, stranded_table
from gpufrac.placement.scoring import Alignment, milli_of, reference_cap, request_milli_total
from gpufrac.placement.state import ClusterState
from gpufrac.placement.typical import TypicalPod

# Shares that ask for a lot of CPU, so some shares leave a node short of CPU and the charge is not 0.
PRIOR = Counter(
    {
        TypicalPod(cpu_milli=4000, memory=None, exclusive=True): 2,
        TypicalPod(cpu_milli=6000, memory=GpuMemory(portion=0.65)): 1,
        TypicalPod(cpu_milli=6000, memory=GpuMemory(portion=0.47)): 1,
        TypicalPod(cpu_milli=2000, memory=GpuMemory(portion=0.32)): 1,
    }
)
SHARES = [fraction(0.1), fraction(0.25), fraction(0.47), fraction(0.5), mib(5000), mib(12000)]


def _room_reference(scorer: RoomWaste, state: ClusterState, demand: Demand, fit: Fit):
    """RoomWaste.score slot by slot with each slot's own GPU size, the CPU charge always subtracted."""
    single = demand.single
    assert single is not None
    typical = scorer.source.current()
    cap = state.cap[fit.nodes]
    room = fit.free_milli()
    left = np.maximum(room - milli_of(single.request_mib(cap), cap), 0)
    removed = np.zeros(room.shape, dtype=np.int64)
    for size in np.unique(cap[cap > 0]).tolist():
        table = np.rint(stranded_table(one_gpu_shares(typical, size), scorer.stop)).astype(np.int64)
        on = cap == size
        removed[on] = table[room[on]] - table[left[on]]
    charge = np.rint(cpu_stranded(state, typical, demand, fit)).astype(np.int64)
    removed = np.maximum(removed - charge, -RoomWaste.CLIP)
    values = np.where(fit.masks[0], RoomWaste.CLIP + removed, -1)
    best = values.argmax(axis=1)
    return values[np.arange(best.size), best], best


def _alignment_reference(scorer: Alignment, state: ClusterState, demand: Demand, fit: Fit):
    """Alignment.score with the GPU request computed on every node."""
    nodes = fit.nodes
    gpu_free = fit.free_milli().sum(axis=1).astype(np.float64)
    cpu_free = state.cpu_free[nodes] / scorer.cpu_per_gpu_milli
    gpu_req = request_milli_total(demand, reference_cap(state, nodes)).astype(np.float64)
    cpu_req = demand.cpu_milli / scorer.cpu_per_gpu_milli
    dot = gpu_free * gpu_req + cpu_free * cpu_req
    norm = np.hypot(gpu_free, cpu_free) * np.hypot(gpu_req, cpu_req)
    cosine = np.divide(dot, norm, out=np.zeros_like(dot), where=norm > 0)
    return np.floor(cosine * scorer.levels).astype(np.int64)


def _filled(nodes: list, seed: int) -> Engine:
    """An fgd-room engine on ``nodes`` with a random mix of shares and whole GPUs placed on it."""
    rng = random.Random(seed)
    e = Engine(policy="fgd-room", seed=seed, typical=PRIOR)
    for spec in nodes:
        e.add_node(spec)
    for _ in range(len(nodes) * 6):
        gpu = rng.choice([*SHARES, whole(1), fraction(0.25, count=2)])
        e.place(pod(gpu, cpu_milli=rng.choice([500, 3000, 9000])))
    return e


def _compare(e: Engine) -> int:
    """Every scorer's answer against its reference for each share and CPU ask; returns the number of
    (pod, node) pairs whose stranded room was charged for CPU, so a test can see the charge exercised."""
    room, fgd, align = (scorer for scorer, _ in e.policy("fgd-room").scorers)
    assert isinstance(room, RoomWaste) and isinstance(fgd, Fgd) and isinstance(align, Alignment)
    charged = 0
    for gpu in [*SHARES, fraction(0.3, mode=ComputeMode.SM_SHARING), whole(1)]:
        for cpu in (500, 5000, 20000):
            demand = demand_of(pod(gpu, cpu_milli=cpu), policy="fgd-room")
            fit = resource_fit(e.state, demand, e.state.live(), GpuRules()).feasible()
            if not fit.nodes.size:
                continue
            assert np.array_equal(
                align.score(e.state, demand, fit)[0], _alignment_reference(align, e.state, demand, fit)
            )
            single = demand.single
            if single is None or single.exclusive:
                continue
            got, chosen = room.score(e.state, demand, fit)
            want, want_gpu = _room_reference(room, e.state, demand, fit)
            assert np.array_equal(got, want) and np.array_equal(chosen, want_gpu), (gpu, cpu)
            charged += int((cpu_stranded(e.state, room.source.current(), demand, fit) > 0).sum())
            delta, mask = fgd.deltas(e.state, demand, fit)
            assert mask is not None
            scores = np.where(mask, _sigmoid_score(delta, fgd.scale), -1)
            best = scores.argmax(axis=1)
            assert np.array_equal(fgd.score(e.state, demand, fit)[0], scores[np.arange(best.size), best])
    return charged


def test_one_gpu_size_with_absent_slots_scores_as_the_slot_by_slot_arithmetic():
    # One GPU size; nodes of 2 and 4 GPUs leave absent slots (capacity 0) on the smaller ones, and
    # 12-core nodes are left short of CPU by the 5- and 20-core asks.
    nodes = [node(f"n{i}", gpus=2 + 2 * (i % 2), cpu=(12_000, 64_000)[i % 3 == 0]) for i in range(12)]
    charged = sum(_compare(_filled(nodes, seed)) for seed in range(3))
    assert charged > 0


def test_mixed_gpu_sizes_score_as_the_slot_by_slot_arithmetic():
    nodes = [
        node(f"n{i}", gpus=4, mib=(16384, 24576)[i % 2], cpu=(12_000, 64_000)[i % 3 == 0]) for i in range(10)
    ]
    for seed in range(2):
        _compare(_filled(nodes, seed))


def test_a_cluster_whose_one_gpu_size_changes_is_scored_with_the_new_size():
    """The share's thousandths are remembered per size: after the 16 GiB nodes leave and 24 GiB ones
    come, a 5,000 MiB share is 0.204 of a GPU, not 0.306, and the scores follow."""
    e = _filled([node(f"a{i}", gpus=4, mib=16384) for i in range(4)], seed=7)
    _compare(e)
    for i in range(4):
        e.remove_node(f"a{i}")
    for i in range(4):
        e.add_node(node(f"b{i}", gpus=4, mib=24576))
    for _ in range(10):
        assert isinstance(e.place(pod(mib(5000), cpu_milli=500)), Placement)
    _compare(e)


def test_the_stranded_table_is_the_plain_recurrence_to_the_last_bit():
    """``stranded_table`` keeps the fitting shares between their sizes; the plain loop re-selects them
    for every room. Both must give the same floats (the batch order floors them into tiers)."""

    def plain(shares: list[tuple[int, float]], stop: float) -> np.ndarray:
        table = np.zeros(1001)
        size = np.array([s for s, _ in shares], dtype=np.int64)
        weight = np.array([w for _, w in shares])
        for r in range(1, 1000):
            fits = size <= r
            q = weight[fits]
            table[r] = (float(q @ table[r - size[fits]]) + stop * r) / (float(q.sum()) + stop)
        return table

    rng = random.Random(5)
    for _ in range(40):
        raw = [(rng.randint(1, 999), rng.random()) for _ in range(rng.randint(1, 10))]
        total = sum(w for _, w in raw)
        shares = [(s, w / total) for s, w in raw]
        stop = rng.choice([0.001, 0.005, 0.05])
        assert np.array_equal(stranded_table(shares, stop), plain(shares, stop))
