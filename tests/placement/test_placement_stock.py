"""The model of the stock kube-scheduler with DRA (``kube-dra``): its scores against the Go formulas worked
by hand, its device order, and a case where it strands a whole GPU that fgd-plus keeps free."""

from __future__ import annotations

from collections import Counter

import numpy as np
from placement_builders import GIB, fraction, host_only, node, pod, whole

from gpufrac.contract.request import ComputeMode, GpuMemory
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.filters import GpuRules, resource_fit
from gpufrac.placement.stock import KubeBalancedAllocation, KubeLeastAllocated
from gpufrac.placement.typical import TypicalPod


def build(policy: str, *nodes, prior=None) -> Engine:
    e = Engine(policy=policy, seed=0, typical=prior)
    for n in nodes:
        e.add_node(n)
    return e


def hold(e: Engine, node_name: str, gpu: int, portion: float) -> None:
    """Book a share on one chosen GPU, as a pod bound by someone else would hold it."""
    held = pod(fraction(portion), cpu_milli=1000)
    spec = e.state.nodes[e.state.index[node_name]]
    device = spec.gpus[gpu]
    mib = GpuMemory(portion=portion).resolve(device.memory_mib)
    assignment = DeviceAssignment(device.uuid, device.index, mib, mib, None)
    containers = (ContainerPlacement("main", ComputeMode.TIME_SLICING, False, (assignment,)),)
    e.assume(held, Placement(held.uid, node_name, containers))


def gpus_of(p: Placement) -> list[int]:
    return [d.index for d in p.containers[0].devices]


def test_scores_are_kube_schedulers_worked_by_hand():
    """Node a holds a pod of 32 cores and 32 GiB, node b nothing (both 64 cores, 256 GiB). The incoming
    pod asks 8 cores and 64 GiB. By the Go code (least_allocated.go, balanced_allocation.go v1.37.2):
    LeastAllocated a: cpu (64000-40000)*100/64000 = 37, memory (256-96)*100/256 = 62, mean 49;
    b: cpu 87, memory 75, mean 81. BalancedAllocation a: before |0.5-0.125|/2 -> 81, after
    |0.625-0.375|/2 -> 87, 50 + (50+87-81)/2 = 78; b: before 100, after |0.125-0.25|/2 -> 93,
    50 + (50+93-100)/2 = 71."""
    e = build("kube-dra", node("a", gpus=0), node("b", gpus=0))
    busy = pod(cpu_milli=32_000, memory_bytes=32 * GIB)
    e.assume(busy, host_only(busy, "a"))
    incoming = pod(cpu_milli=8_000, memory_bytes=64 * GIB)
    nodes = np.array([e.state.index["a"], e.state.index["b"]])
    fit = resource_fit(e.state, e.demand(incoming), nodes, GpuRules())
    assert KubeLeastAllocated().score(e.state, e.demand(incoming), fit)[0].tolist() == [49, 81]
    assert KubeBalancedAllocation().score(e.state, e.demand(incoming), fit)[0].tolist() == [78, 71]
    placed = e.place(incoming)
    assert isinstance(placed, Placement) and placed.node == "b"  # 81 + 71 > 49 + 78


def test_a_pod_asking_for_no_cpu_or_memory_gets_no_balance_score():
    e = build("kube-dra", node("a", gpus=0))
    busy = pod(cpu_milli=32_000)
    e.assume(busy, host_only(busy, "a"))
    best_effort = pod()
    fit = resource_fit(e.state, e.demand(best_effort), np.array([e.state.index["a"]]), GpuRules())
    assert KubeBalancedAllocation().score(e.state, e.demand(best_effort), fit)[0].tolist() == [0]


def test_gpu_pods_spread_by_cpu_whatever_the_gpus_hold():
    """The stock node score sees CPU and memory only: a node whose GPUs are nearly full but whose CPU is
    free wins over a node with empty GPUs and busy CPU, where binpack goes by the GPUs too."""
    busy_cpu, full_gpus = node("busy-cpu", gpus=2), node("full-gpus", gpus=2)
    for policy, expected in (("kube-dra", "full-gpus"), ("binpack", "busy-cpu")):
        e = build(policy, busy_cpu, full_gpus)
        busy = pod(cpu_milli=48_000, memory_bytes=64 * GIB)
        e.assume(busy, host_only(busy, "busy-cpu"))
        hold(e, "full-gpus", 0, 0.75)
        hold(e, "full-gpus", 1, 0.75)
        placed = e.place(pod(fraction(0.25), cpu_milli=2_000, memory_bytes=4 * GIB))
        assert isinstance(placed, Placement) and placed.node == expected, policy


def test_the_first_gpu_in_slice_order_with_room():
    """GPU 0 has 0.8 free, GPU 1 0.4, GPUs 2-3 are empty. A 0.3 share takes GPU 0, the first with room
    (best fit would take GPU 1); two whole GPUs take 2 and 3, the first two empty ones."""
    for policy, expected in (("kube-dra", [0]), ("binpack", [1])):
        e = build(policy, node("n", gpus=4))
        hold(e, "n", 0, 0.2)
        hold(e, "n", 1, 0.6)
        placed = e.place(pod(fraction(0.3), cpu_milli=1000))
        assert isinstance(placed, Placement) and gpus_of(placed) == expected, policy
    e = build("kube-dra", node("n", gpus=4))
    hold(e, "n", 1, 0.5)
    placed = e.place(pod(whole(2), cpu_milli=1000))
    assert isinstance(placed, Placement) and gpus_of(placed) == [0, 2]
    share = e.place(pod(fraction(0.6), cpu_milli=1000))  # 0 and 2 are taken whole, 1 has 0.5 free
    assert isinstance(share, Placement) and gpus_of(share) == [3]


def test_fgd_plus_keeps_a_whole_gpu_free_where_the_stock_model_does_not():
    """Two nodes of one GPU. Two half-GPU pods, then a whole-GPU pod. The stock scores spread the halves
    over both nodes (LeastAllocated), so the whole-GPU pod finds no GPU; fgd-plus puts the second half
    beside the first and the whole-GPU pod fits."""
    prior = Counter(
        {TypicalPod(4_000, GpuMemory(portion=0.5)): 1, TypicalPod(4_000, None, exclusive=True): 1}
    )
    outcomes = {}
    for policy in ("kube-dra", "fgd-plus"):
        e = build(policy, node("a", gpus=1), node("b", gpus=1), prior=prior)
        halves = [e.place(pod(fraction(0.5), cpu_milli=4_000, memory_bytes=8 * GIB)) for _ in range(2)]
        assert all(isinstance(h, Placement) for h in halves)
        outcomes[policy] = ({h.node for h in halves}, e.place(pod(whole(), cpu_milli=4_000)))
    kube_nodes, kube_whole = outcomes["kube-dra"]
    assert kube_nodes == {"a", "b"} and isinstance(kube_whole, Unschedulable)
    ours_nodes, ours_whole = outcomes["fgd-plus"]
    assert len(ours_nodes) == 1 and isinstance(ours_whole, Placement) and ours_whole.node not in ours_nodes
