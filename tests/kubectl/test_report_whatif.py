"""``report --what-if-whole-gpu`` on the hand-worked history of test_report_figures.py: its five pods
(a/p1 and a/p2 a quarter GPU each, time-slicing; b/p3 a half and b/p5 a quarter, sm-sharing; b/p4 a whole
GPU) placed again by the engine on one node, as booked and with a whole GPU each."""

from __future__ import annotations

from test_report_figures import HISTORY

from gpufrac.contract.request import ComputeMode
from gpufrac.kubectl.report import FractionSample, History
from gpufrac.kubectl.report_whatif import FRACTIONS, WHOLE_GPUS, what_if, window_pods
from gpufrac.sim.trace import TraceNode


def node(gpus: int) -> TraceNode:
    return TraceNode("n1", cpu_milli=64_000, memory_mib=256_000, gpus=gpus, model="H100-80GB")


def test_the_window_pods_are_each_pod_once_with_its_share_of_one_gpu() -> None:
    pods, left_out = window_pods(HISTORY)
    assert left_out == []
    assert [(p.name, p.gpu_milli, p.num_gpu, p.mode) for p in pods] == [
        ("a/p1", 250, 1, ComputeMode.TIME_SLICING),
        ("a/p2", 250, 1, ComputeMode.TIME_SLICING),
        ("b/p3", 500, 1, ComputeMode.SM_SHARING),
        ("b/p4", 1000, 1, ComputeMode.TIME_SLICING),
        ("b/p5", 250, 1, ComputeMode.SM_SHARING),
    ]


def test_a_pod_on_two_gpus_asks_for_two_and_one_without_gpu_memory_is_left_out_and_named() -> None:
    def s(pod: str, gpu: str, memory: float) -> FractionSample:
        return FractionSample("n1", "a", pod, "c", gpu, "time-slicing", 20, 20, 0, 0, 0, memory)

    pods, left_out = window_pods(
        History([(0.0, [s("two", "G1", 80), s("two", "G2", 80), s("x", "G3", 0)])], 60)
    )
    assert [(p.name, p.num_gpu, p.gpu_milli) for p in pods] == [("a/two", 2, 250)]
    assert left_out == ["a/x: its GPU's memory was not exported"]


def test_fractions_fit_more_of_the_window_on_the_same_gpus_and_the_policy_matters() -> None:
    pods, _ = window_pods(HISTORY)
    rows = {
        (r.policy, r.allocation): r
        for r in what_if(nodes=[node(2)], pods=pods, policies=["binpack", "spread"])
    }
    # binpack: p1+p2 share GPU 0, p3+p5 (sm-sharing, one namespace) GPU 1; no GPU is left for p4.
    assert (rows["binpack", FRACTIONS].placed, rows["binpack", FRACTIONS].gpus_used) == (4, 2)
    # Whole GPUs: the first two pods take both GPUs, three wait.
    assert (rows["binpack", WHOLE_GPUS].placed, rows["binpack", WHOLE_GPUS].left_out) == (2, 3)
    # spread puts p1 and p2 on a GPU each: the sm-sharing pods find no GPU of their mode.
    assert rows["spread", FRACTIONS].placed == 2
    three = {
        (r.policy, r.allocation): r.placed for r in what_if(nodes=[node(3)], pods=pods, policies=["binpack"])
    }
    assert three == {("binpack", FRACTIONS): 5, ("binpack", WHOLE_GPUS): 3}
