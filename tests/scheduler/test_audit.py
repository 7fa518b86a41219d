"""The audit oracle fed broken states: each broken promise must be reported, and a sound state must not.

``audit`` judges every burst, restart and soak test; an oracle that reports nothing passes them all.
Each test here breaks exactly one promise and expects exactly the sentence of the check that guards it,
so deleting any one check of ``gpufrac.scheduler.booking_audit`` fails a test.
"""

from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.local.simnodes import GPU_MODELS, NodeShape, gpu_uuid, sim_node
from gpufrac.placement.decision import Placement
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.binder import binding_annotations
from gpufrac.scheduler.booking_audit import AuditReport, audit
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import gpu_request, node_spec, pending_pod
from gpufrac.scheduler.placement_engine import build_engine

SHAPE = NodeShape(gpus=2, model="H100-80GB")
CAPACITY = GPU_MODELS["H100-80GB"]
N1_GPU0, N1_GPU1, N2_GPU0 = gpu_uuid("n1", 0), gpu_uuid("n1", 1), gpu_uuid("n2", 0)


def nodes() -> list[Node]:
    return [sim_node(name="n1", shape=SHAPE), sim_node(name="n2", shape=SHAPE)]


def pod(
    name: str,
    *,
    node: str | None = "n1",
    namespace: str = "team-a",
    containers: dict[str, dict[str, str]] | None = None,
    whole_gpus: int = 0,
) -> Pod:
    """A pod as the binder leaves it: per container its contract keys (suffix -> value)."""
    annotations = {
        keys.container_key(c, suffix): value
        for c, fields in (containers or {}).items()
        for suffix, value in fields.items()
    }
    spec: dict[str, object] = {
        "containers": [
            {"name": c, "image": "x"}
            | ({"resources": {"limits": {keys.GPU_RESOURCE: str(whole_gpus)}}} if whole_gpus else {})
            for c in containers or {"app": {}}
        ]
    }
    if node:
        spec["nodeName"] = node
    return Pod.from_dict(
        {"metadata": {"name": name, "namespace": namespace, "annotations": annotations}, "spec": spec}
    )


def shared(
    devices: str, request: str = "10Gi", mode: str = "time-slicing", portion: str | None = None
) -> dict:
    fields = {"gpu-memory.request": request, "gpu-compute.mode": mode, "gpus.devices": devices}
    if portion is not None:
        fields["gpu-compute.portion"] = portion
    return fields


def problems(*pods: Pod, single_tenant: bool = True) -> list[str]:
    report: AuditReport = audit(nodes=nodes(), pods=pods, sm_sharing_single_tenant=single_tenant)
    return report.problems


def test_a_sound_state_has_no_problems() -> None:
    report = audit(
        nodes=nodes(),
        pods=[
            pod("a", containers={"app": shared(N1_GPU0, "40Gi")}),
            pod("b", containers={"app": shared(N1_GPU0, "39Gi")}),
            pod("c", containers={"app": shared(N1_GPU1, "10Gi", "sm-sharing", "0.5")}),
            pod("d", containers={"app": shared(N1_GPU1, "10Gi", "sm-sharing", "0.5")}),
            pod("e", node="n2", containers={"app": {"gpus.devices": N2_GPU0}}, whole_gpus=1),
            pod("pending", node=None),
        ],
    )
    assert report.problems == []
    assert report.placed_pods == 5
    assert report.gpus[N1_GPU0].request_mib == 79 * 1024


def test_an_over_committed_gpu_is_reported() -> None:
    found = problems(
        pod("a", containers={"app": shared(N1_GPU0, "50Gi")}),
        pod("b", containers={"app": shared(N1_GPU0, "40Gi")}),
    )
    assert found == [f"GPU {N1_GPU0} on n1 is over-committed: {90 * 1024} MiB guaranteed of {CAPACITY}"]


def test_mixed_compute_modes_on_one_gpu_are_reported() -> None:
    found = problems(
        pod("a", containers={"app": shared(N1_GPU0, mode="time-slicing")}),
        pod("b", containers={"app": shared(N1_GPU0, mode="sm-sharing", portion="0.1")}),
    )
    assert found == [f"GPU {N1_GPU0} on n1 mixes ['sm-sharing', 'time-slicing']: ['team-a/a', 'team-a/b']"]


def test_an_exclusive_gpu_shared_with_another_pod_is_reported() -> None:
    found = problems(
        pod("whole", containers={"app": {"gpus.devices": N1_GPU0}}, whole_gpus=1),
        pod("other", containers={"app": {"gpus.devices": N1_GPU0}}, whole_gpus=1),
    )
    assert f"GPU {N1_GPU0} on n1 is exclusive but shared by ['team-a/whole', 'team-a/other']" in found


def test_an_sm_sharing_gpu_promised_more_than_all_its_compute_is_reported() -> None:
    found = problems(
        pod("a", containers={"app": shared(N1_GPU0, mode="sm-sharing", portion="0.6")}),
        pod("b", containers={"app": shared(N1_GPU0, mode="sm-sharing", portion="0.5")}),
    )
    assert found == [f"GPU {N1_GPU0} on n1 has 1.100 of its compute promised"]


@pytest.mark.parametrize("single_tenant", [True, False])
def test_an_sm_sharing_gpu_shared_by_namespaces_is_reported_when_tenancy_is_per_namespace(
    single_tenant: bool,
) -> None:
    found = problems(
        pod("a", namespace="team-a", containers={"app": shared(N1_GPU0, mode="sm-sharing", portion="0.1")}),
        pod("b", namespace="team-b", containers={"app": shared(N1_GPU0, mode="sm-sharing", portion="0.1")}),
        single_tenant=single_tenant,
    )
    expected = [f"GPU {N1_GPU0} on n1 is sm-shared by namespaces ['team-a', 'team-b']"]
    assert found == (expected if single_tenant else [])


def test_a_device_that_is_not_on_the_pods_node_is_reported() -> None:
    found = problems(
        pod("elsewhere", node="n1", containers={"app": shared(N2_GPU0)}),
        pod("unknown", node="n1", containers={"app": shared("GPU-not-anywhere")}),
    )
    assert found == [
        f"pod team-a/elsewhere on n1 holds GPU {N2_GPU0}, which n1 does not have",
        "pod team-a/unknown on n1 holds GPU GPU-not-anywhere, which n1 does not have",
    ]


def test_two_containers_of_one_pod_may_share_a_gpu_as_separate_fractions() -> None:
    report = audit(
        nodes=nodes(),
        pods=[pod("pair", containers={"app": shared(N1_GPU0, "40Gi"), "side": shared(N1_GPU0, "30Gi")})],
    )
    assert report.problems == []
    assert report.gpus[N1_GPU0].request_mib == 70 * 1024


def test_containers_of_one_pod_together_over_a_gpus_capacity_are_reported() -> None:
    found = problems(
        pod("pair", containers={"app": shared(N1_GPU0, "50Gi"), "side": shared(N1_GPU0, "40Gi")})
    )
    assert found == [f"GPU {N1_GPU0} on n1 is over-committed: {90 * 1024} MiB guaranteed of {CAPACITY}"]


def test_one_container_given_one_gpu_twice_is_reported() -> None:
    found = problems(pod("twice", containers={"app": shared(f"{N1_GPU0},{N1_GPU0}")}))
    assert len(found) == 1
    assert found[0].startswith("bound pod team-a/twice has an invalid GPU request: ")
    assert "without blanks or repeats" in found[0]


def test_the_scheduler_places_two_fractions_of_one_pod_on_one_gpu_and_the_audit_agrees() -> None:
    """The engine's rule and the audit's are one: a pod whose two containers fit one GPU together gets
    that GPU for both (the node below has only one), and the written binding passes the audit."""
    one_gpu = sim_node(name="n1", shape=NodeShape(gpus=1, model="H100-80GB"))
    asking = pod(
        "pair",
        node=None,
        containers={"app": {"gpu-memory.request": "40Gi"}, "side": {"gpu-memory.request": "30Gi"}},
    )
    asking.metadata.uid = "uid-pair"
    engine = build_engine(SchedulerConfig())
    engine.add_node(node_spec(one_gpu))
    request = gpu_request(asking)
    pending = pending_pod(
        asking, gpu=request, arrival=0, default_queue="default", mode_policy=ModePolicy.REQUIRED
    )
    placement = engine.place(pending)
    assert isinstance(placement, Placement)
    assert [c.uuids for c in placement.containers] == [(N1_GPU0,), (N1_GPU0,)]

    bound = asking.to_dict()
    bound["metadata"]["annotations"] |= binding_annotations(request, placement, device_style="uuid")
    bound["spec"]["nodeName"] = placement.node
    report = audit(nodes=[one_gpu], pods=[Pod.from_dict(bound)])
    assert report.problems == []
    assert report.gpus[N1_GPU0].request_mib == 70 * 1024


def test_devices_on_a_pod_without_a_node_are_reported() -> None:
    found = problems(pod("half-bound", node=None, containers={"app": shared(N1_GPU0)}))
    assert found == [f"pod team-a/half-bound carries devices ['{N1_GPU0}'] but is not bound to a node"]


def test_a_bound_pod_whose_request_cannot_be_read_is_reported() -> None:
    found = problems(pod("broken", containers={"app": shared(N1_GPU0, request="-1Gi")}))
    assert len(found) == 1 and found[0].startswith("bound pod team-a/broken has an invalid GPU request: ")
