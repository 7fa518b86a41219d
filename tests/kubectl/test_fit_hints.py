"""``kubectl gpufrac explain``'s advice for a waiting pod follows from why it waits, reason by reason."""

from __future__ import annotations

from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kubectl.view import GpuRow, Tenant, fit_hints

GPU_MIB = 81_559  # an H100-80GB's usable memory


def ask(annotations: dict[str, str], gpus: int = 0) -> PodGpuRequest:
    return parse_pod(annotations, [ContainerSpec(name="app", gpus=gpus)])


def gpu(node: str, index: int, *tenants: tuple[str, int], health: str = "Ready") -> GpuRow:
    return GpuRow(
        node=node,
        index=index,
        uuid=f"GPU-{node}-{index}",
        model="H100-80GB",
        usable_mib=GPU_MIB,
        health=health,
        tenants=[Tenant("ns", f"p{i}", "c", mode, mib, mib) for i, (mode, mib) in enumerate(tenants)],
    )


def test_a_request_larger_than_any_gpu_never_fits_and_is_not_told_to_wait() -> None:
    (hint,) = fit_hints(ask({"gpu-memory": "92160"}), [gpu("a", 0), gpu("a", 1, ("time-slicing", 10_000))])
    assert "it never fits here: the largest GPU has 81559 MiB usable (a GPU 0, H100-80GB)" in hint
    assert "tenants leave" not in hint and "fewer GPUs" not in hint and "instead of" not in hint


def test_more_gpus_than_any_node_has_never_fits_and_says_the_most_a_node_has() -> None:
    rows = [gpu("a", 0), gpu("a", 1), gpu("b", 0)]
    (hint,) = fit_hints(ask({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "4"}), rows)
    assert "no node has more than 2 GPU(s) that could hold it. Ask for at most 2 GPU(s) per pod" in hint


def test_a_pod_for_one_gpu_is_never_offered_fewer_gpus() -> None:
    (hint,) = fit_hints(ask({"gpu-fraction": "0.75"}), [gpu("a", 0, ("time-slicing", 40_000))])
    assert "It fits when tenants leave, or with a request of at most 41559 MiB" in hint
    assert "instead of" not in hint


def test_a_pod_for_several_gpus_may_be_offered_fewer() -> None:
    rows = [gpu("a", 0), gpu("a", 1, ("time-slicing", 70_000))]
    (hint,) = fit_hints(ask({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}), rows)
    assert "the most any node has now is 1" in hint and "with 1 GPU(s) instead of 2" in hint


def test_memory_free_on_a_gpu_of_the_other_mode_is_named_as_the_blocker() -> None:
    rows = [gpu("a", 0, ("sm-sharing", 10_000))]
    request = ask({"gpu-fraction": "0.5", "mps": "false"})
    (hint,) = fit_hints(request, rows)
    assert "1 GPU(s) have the memory free but serve the other compute mode" in hint


def test_a_whole_gpu_is_told_it_needs_an_empty_one_and_gets_no_memory_advice() -> None:
    (hint,) = fit_hints(ask({}, gpus=1), [gpu("a", 0, ("time-slicing", 1_000))])
    assert "1 GPU(s) have tenants (a whole GPU needs an empty one)" in hint
    assert "request of at most" not in hint


def test_a_pod_its_queue_holds_gets_the_queues_reason_and_no_gpu_advice() -> None:
    message = (
        "0/3 nodes are available: queue team-a would exceed its GPU-memory limit of 81920 MiB, "
        "3 insufficient GPU memory."
    )
    (hint,) = fit_hints(ask({"gpu-fraction": "0.5"}), [gpu("a", 0)], scheduled_message=message)
    assert hint.startswith(
        "held by its queue, not by GPU memory: queue team-a would exceed its GPU-memory limit of 81920 MiB."
    )
    assert "taint" not in hint and "tenants leave" not in hint


def test_when_gpus_are_free_memory_is_not_what_blocks_it() -> None:
    (hint,) = fit_hints(ask({"gpu-fraction": "0.5"}), [gpu("a", 0)])
    assert "node a has 1 such GPUs now, so GPU memory is not what blocks it" in hint


def test_without_a_ready_gpu_it_says_so() -> None:
    assert fit_hints(ask({"gpu-fraction": "0.5"}), [gpu("a", 0, health="Unhealthy")]) == [
        "no Ready GPU in the cluster: see kubectl gpufrac nodes"
    ]


def test_a_mig_request_is_not_judged_by_free_memory_of_a_gpu() -> None:
    """A MIG slice lands on a GPU in MIG mode, never in a fraction pool's free memory (docs/mig.md)."""
    rows = [gpu("a", 0)]
    (hint,) = fit_hints(ask({"gpufrac.io/container.app.mig.profile": "3g.40gb"}), rows)
    assert hint == (
        "app: needs 1 MIG slice(s) of 3g.40gb on one node; slices are placed on GPUs in MIG mode, not in a"
        " GPU's free memory: see the scheduler's reasons"
    )
    (hint,) = fit_hints(ask({"gpufrac.io/container.app.mig.gpu-memory": "20Gi"}), rows)
    assert "needs 1 MIG slice(s) of at least 20480 MiB on one node" in hint
