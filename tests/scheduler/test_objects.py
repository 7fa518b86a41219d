"""Kubernetes objects as the engine sees them, and bound pods booked back from their annotations.

These are the conversions a restart depends on: a pod bound with the annotations the binder writes must
be booked with exactly the MiB, devices and compute portion it was placed with.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import parse_pod_manifest
from gpufrac.contract.request import ComputeMode
from gpufrac.local.simnodes import NodeShape, gpu_uuid, sim_node
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.model import ModePolicy, TaintEffect
from gpufrac.scheduler.binder import binding_annotations, stale_binding_keys
from gpufrac.scheduler.objects import (
    InvalidInventory,
    bound_placement,
    gpu_request,
    host_request,
    node_inventory,
    node_spec,
    pending_pod,
)

H100 = 81559


def pod(
    *,
    annotations: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    node: str | None = None,
    **spec: Any,
) -> Pod:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a", "uid": "uid-1", "annotations": annotations or {}},
        "spec": {"containers": containers or [{"name": "app"}], **spec},
    }
    if init:
        body["spec"]["initContainers"] = init
    if node:
        body["spec"]["nodeName"] = node
    return Pod.from_dict(body)


def test_simulated_node_is_a_ready_managed_gpu_node() -> None:
    spec = node_spec(sim_node(name="n1", shape=NodeShape(gpus=4, model="H100-80GB")))
    assert spec.ready and spec.schedulable
    assert [g.memory_mib for g in spec.gpus] == [H100] * 4
    assert [g.uuid for g in spec.gpus] == [gpu_uuid("n1", i) for i in range(4)]
    assert spec.gpu_model == "H100-80GB"
    assert spec.cpu_milli == 128_000 and spec.memory_bytes == 1024 * 2**30 and spec.max_pods == 250
    assert [(t.key, t.effect) for t in spec.taints] == [(keys.MANAGED_TAINT_KEY, TaintEffect.NO_SCHEDULE)]


def test_node_without_a_ready_node_agent_is_not_ready() -> None:
    node = sim_node(name="n1")
    node.status.conditions = [c for c in node.status.conditions if c.type != keys.NODE_READY_CONDITION]
    assert not node_spec(node).ready


def test_unreadable_inventory_is_reported_and_the_node_gets_no_gpus() -> None:
    node = sim_node(name="n1")
    node.metadata.annotations[keys.NODE_GPUS_ANNOTATION] = '[{"uuid": "GPU-1"}]'
    with pytest.raises(InvalidInventory, match=r"gpufrac\.io/gpus of node n1"):
        node_inventory(node)
    assert node_spec(node).gpus == ()


def test_duplicate_gpu_uuids_are_rejected() -> None:
    node = Node.from_dict(
        {
            "metadata": {
                "name": "n1",
                "annotations": {
                    keys.NODE_GPUS_ANNOTATION: json.dumps(
                        [{"uuid": "GPU-1", "index": i, "model": "x", "mib": 100} for i in range(2)]
                    )
                },
            }
        }
    )
    with pytest.raises(InvalidInventory, match="unique"):
        node_inventory(node)


def test_host_request_is_the_larger_of_containers_and_init_plus_overhead() -> None:
    p = pod(
        containers=[
            {"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
            {"name": "b", "resources": {"requests": {"cpu": "1", "memory": "512Mi"}}},
        ],
        init=[{"name": "i", "resources": {"requests": {"cpu": "2", "memory": "1Mi"}}}],
        overhead={"cpu": "100m", "memory": "1Mi"},
    )
    assert host_request(p) == (2100, (1024 + 512 + 1) * 2**20)


def test_pending_pod_carries_constraints_and_queue() -> None:
    p = pod(
        annotations={"gpu-fraction": "0.5"},
        nodeSelector={"zone": "a"},
        tolerations=[{"key": keys.MANAGED_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "gpufrac.io/gpu-model", "operator": "In", "values": ["H100"]}
                            ]
                        }
                    ]
                }
            }
        },
        priority=7,
    )
    p.metadata.labels = {keys.KAI_QUEUE_LABEL: "research"}
    pending = pending_pod(
        p, gpu=gpu_request(p), arrival=3, default_queue="default", mode_policy=ModePolicy.REQUIRED
    )
    assert pending.queue == "research" and pending.priority == 7 and pending.arrival == 3
    assert dict(pending.node_selector) == {"zone": "a"}
    assert [t.key for t in pending.tolerations].count(keys.MANAGED_TAINT_KEY) == 2
    assert pending.affinity[0].match_expressions[0].values == ("H100",)
    assert pending.gpu.containers[0].request.portion == 0.5


def test_a_fractional_gpu_count_is_refused_not_rounded_up_to_a_whole_gpu() -> None:
    # The scheduler used to read nvidia.com/gpu: 0.5 as one exclusive GPU while the webhook refused it.
    p = pod(containers=[{"name": "app", "resources": {"limits": {keys.GPU_RESOURCE: "0.5"}}}])
    with pytest.raises(InvalidPodRequest) as raised:
        gpu_request(p)
    assert raised.value.messages == [
        'spec.containers[app].resources.limits.nvidia.com/gpu="0.5" is invalid: '
        "a GPU count must be a whole number from 1 to 256."
    ]


@pytest.mark.parametrize("count", ["1", "3", "0.5", "1.5", "1k"])
def test_the_scheduler_reads_gpu_counts_as_the_webhook_does(count: str) -> None:
    p = pod(containers=[{"name": "app", "resources": {"requests": {keys.GPU_RESOURCE: count}}}])

    def answer(read: Any) -> Any:
        try:
            return read()
        except InvalidPodRequest as invalid:
            return invalid.messages

    assert answer(lambda: gpu_request(p)) == answer(lambda: parse_pod_manifest(p.to_dict()))


def test_a_request_read_again_follows_every_change_of_what_parsing_reads() -> None:
    """Parsed requests are remembered by annotations and containers: a pod of the same template gets the
    same request, and a change of any annotation, container name or GPU count is parsed anew, valid or
    not, in whichever order the pods come."""
    half = pod(annotations={"gpu-fraction": "0.5"})
    assert gpu_request(half).containers[0].request.portion == 0.5
    assert gpu_request(pod(annotations={"gpu-fraction": "0.5"})) == gpu_request(half)
    assert gpu_request(pod(annotations={"gpu-fraction": "0.25"})).containers[0].request.portion == 0.25
    assert (
        gpu_request(pod(annotations={"gpu-fraction": "0.5"}, containers=[{"name": "other"}]))
        .containers[0]
        .container
        == "other"
    )
    two = pod(annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    assert gpu_request(two).containers[0].device_count == 2
    whole = {"name": "app", "resources": {"limits": {keys.GPU_RESOURCE: "2"}}}
    assert gpu_request(pod(containers=[whole])).containers[0].device_count == 2
    for _ in range(2):  # an invalid one is refused every time, never answered as the valid one before it
        with pytest.raises(InvalidPodRequest):
            gpu_request(pod(annotations={"gpu-fraction": "1.5"}))
    assert gpu_request(pod(annotations={"gpu-fraction": "0.5"})) == gpu_request(half)


def test_host_requests_and_tolerations_read_again_follow_their_values() -> None:
    """Quantities and tolerations are remembered by value: each pod still gets its own."""
    small = pod(containers=[{"name": "a", "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}}}])
    big = pod(containers=[{"name": "a", "resources": {"requests": {"cpu": "1500m", "memory": "1Gi"}}}])
    assert [host_request(p) for p in (small, big, small)] == [(100, 2**30), (1500, 2**30), (100, 2**30)]
    tolerate = [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute"}]
    other = [{"key": "k", "operator": "Equal", "value": "w", "effect": "NoExecute"}]
    unknown = [{"key": "k", "operator": "Exists", "effect": "SomeNewEffect"}]
    read = [
        [
            (t.key, t.value, t.effect)
            for t in pending_pod(
                pod(tolerations=given),
                gpu=gpu_request(pod()),
                arrival=1,
                default_queue="q",
                mode_policy=ModePolicy.REQUIRED,
            ).tolerations[1:]
        ]
        for given in (tolerate, other, unknown, tolerate)
    ]
    assert read == [
        [("k", "v", TaintEffect.NO_EXECUTE)],
        [("k", "w", TaintEffect.NO_EXECUTE)],
        [],
        [("k", "v", TaintEffect.NO_EXECUTE)],
    ]


def test_a_pods_placement_policy_annotation_overrides_the_schedulers_policy() -> None:
    from gpufrac.placement import Engine

    engine = Engine(policy="binpack")
    for name in ("n1", "n2"):
        engine.add_node(node_spec(sim_node(name=name, shape=NodeShape(gpus=1, model="H100-80GB"))))

    def place(name: str, annotations: dict[str, str]) -> str:
        p = pod(annotations={keys.memory_request_key("app"): "10Gi", **annotations})
        p.metadata.name, p.metadata.uid = name, f"uid-{name}"
        pending = pending_pod(
            p, gpu=gpu_request(p), arrival=0, default_queue="default", mode_policy=ModePolicy.REQUIRED
        )
        (decision,) = engine.schedule([pending])
        return decision.node

    first = place("first", {})
    assert place("packed", {}) == first  # binpack: onto the used GPU
    assert place("spread", {keys.PLACEMENT_POLICY_ANNOTATION: "spread"}) != first
    p = pod(annotations={keys.memory_request_key("app"): "1Gi", keys.PLACEMENT_POLICY_ANNOTATION: "nope"})
    pending = pending_pod(
        p, gpu=gpu_request(p), arrival=0, default_queue="d", mode_policy=ModePolicy.REQUIRED
    )
    (refused,) = engine.schedule([pending])
    assert "unknown placement policy 'nope'" in refused.message


@pytest.mark.parametrize(
    "annotations",
    [
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8", "gpu-fraction-num-devices": "2"},
        {
            "nvidia.com/container.app.gpu-memory.request": "40Gi",
            "nvidia.com/container.app.gpu-memory.limit": "60Gi",
            "nvidia.com/container.app.gpu-compute.mode": "sm-sharing",
            "gpu-fraction-num-devices": "4",
        },
        {"gpu-memory": "10240"},
    ],
    ids=["fraction", "sm-sharing", "legacy-mib"],
)
def test_a_bound_pod_is_booked_with_what_it_was_placed_with(annotations: dict[str, str]) -> None:
    pending = pod(annotations=annotations)
    request = gpu_request(pending)
    count = request.containers[0].device_count
    uuids = [gpu_uuid("n1", i) for i in range(count)]
    c = request.containers[0]
    placed = Placement(
        pod_uid="uid-1",
        node="n1",
        containers=(
            ContainerPlacement(
                container="app",
                mode=c.mode,
                exclusive=False,
                devices=tuple(
                    DeviceAssignment(
                        uuid=u,
                        index=i,
                        request_mib=c.request_mib(H100),
                        limit_mib=c.limit_mib(H100),
                        compute_portion=c.compute_portion_on(H100),
                    )
                    for i, u in enumerate(uuids)
                ),
            ),
        ),
    )
    written = binding_annotations(request, placed, device_style="uuid")
    bound = pod(annotations={**annotations, **written}, node="n1")
    inventory = {g.uuid: g for g in node_spec(sim_node(name="n1")).gpus}
    assert bound_placement(bound, gpus_by_uuid=inventory) == placed


def test_cleaning_a_pod_a_dead_binder_annotated_restores_its_request() -> None:
    original = {"gpu-fraction": "0.25", "nvidia.com/container.app.gpu-compute.mode": "sm-sharing"}
    request = gpu_request(pod(annotations=original))
    c = request.containers[0]
    u = gpu_uuid("n1", 0)
    placed = Placement(
        pod_uid="uid-1",
        node="n1",
        containers=(
            ContainerPlacement(
                container="app",
                mode=ComputeMode.SM_SHARING,
                exclusive=False,
                devices=(DeviceAssignment(u, 0, c.request_mib(H100), c.limit_mib(H100), 0.25),),
            ),
        ),
    )
    written = binding_annotations(request, placed, device_style="uuid")
    left_behind = {**original, **written}
    removal = stale_binding_keys(left_behind)
    cleaned = {k: v for k, v in left_behind.items() if k not in removal}
    assert cleaned == original
    assert gpu_request(pod(annotations=cleaned)) == request


def test_a_user_written_explicit_request_survives_cleaning() -> None:
    original = {"nvidia.com/container.app.gpu-memory.request": "10Gi"}
    left_behind = {**original, keys.devices_key("app"): gpu_uuid("n1", 0)}
    assert stale_binding_keys(left_behind) == {keys.devices_key("app"): None}


def test_cdi_device_names_are_booked_by_uuid() -> None:
    annotations = {"gpu-memory": "1024"}
    request = gpu_request(pod(annotations=annotations))
    u = gpu_uuid("n1", 3)
    placed = Placement(
        pod_uid="uid-1",
        node="n1",
        containers=(
            ContainerPlacement(
                container="app",
                mode=ComputeMode.TIME_SLICING,
                exclusive=False,
                devices=(DeviceAssignment(u, 3, 1024, 1024, None),),
            ),
        ),
    )
    written = binding_annotations(request, placed, device_style="cdi")
    assert written[keys.devices_key("app")] == f"nvidia.com/gpu={u}"
    bound = pod(annotations={**annotations, **written}, node="n1")
    inventory = {g.uuid: g for g in node_spec(sim_node(name="n1")).gpus}
    assert bound_placement(bound, gpus_by_uuid=inventory) == placed


def test_a_node_offers_only_the_compute_modes_its_agent_can_enforce() -> None:
    node = sim_node(name="n1")
    assert node_spec(node).compute_modes == {ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING}
    node.metadata.labels["gpufrac.io/compute-mode.time-slicing"] = "false"  # classic MPS: r580 driver
    assert node_spec(node).compute_modes == {ComputeMode.SM_SHARING}
    for mode in ComputeMode:
        del node.metadata.labels[f"gpufrac.io/compute-mode.{mode.value}"]
    assert node_spec(node).compute_modes == {ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING}


def test_our_pods_tolerate_the_managed_taint_even_without_the_webhook() -> None:
    p = pod(annotations={"gpu-fraction": "0.5"})
    pending = pending_pod(
        p, gpu=gpu_request(p), arrival=1, default_queue="default", mode_policy=ModePolicy.REQUIRED
    )
    taint = node_spec(sim_node(name="n1")).taints[0]
    assert any(t.tolerates(taint) for t in pending.tolerations)


def test_a_users_own_conflicting_request_is_not_cleaned_away() -> None:
    # gpu-fraction next to an explicit request, no devices: the user wrote both; the contract must
    # report the conflict instead of the scheduler quietly dropping one of them.
    written = {"gpu-fraction": "0.5", keys.memory_request_key("app"): "10Gi"}
    assert stale_binding_keys(written) == {}


def test_the_binder_writes_the_amounts_the_engine_booked_not_the_request_resolved_again() -> None:
    """A 0.5 portion on two GPUs of 80 and 40 GiB: the engine books 20 GiB on both (one amount per
    container, the smaller); the binder used to resolve 0.5 again on the GPUs it was told about."""
    annotations = {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}
    request = gpu_request(pod(annotations=annotations))
    placed = Placement(
        pod_uid="uid-1",
        node="n1",
        containers=(
            ContainerPlacement(
                "app",
                ComputeMode.TIME_SLICING,
                False,
                (
                    DeviceAssignment("GPU-a", 0, 20480, 20480, None),
                    DeviceAssignment("GPU-b", 1, 20480, 20480, None),
                ),
            ),
        ),
    )
    written = binding_annotations(request, placed, device_style="uuid")
    assert written[keys.memory_request_key("app")] == "20480Mi"
    assert written[keys.memory_limit_key("app")] == "20480Mi"


def test_pods_of_one_template_are_each_written_with_their_own_devices_amounts_and_mode() -> None:
    """Renderings are remembered per template and placed shape: every pod still gets its own devices
    (named per style), its own booked amounts and portion, and the mode it was placed in."""
    request = gpu_request(
        pod(annotations={"gpu-fraction": "0.25", keys.compute_mode_key("app"): "sm-sharing"})
    )

    def placed(mode: ComputeMode, *devices: DeviceAssignment) -> Placement:
        return Placement(
            pod_uid="u", node="n1", containers=(ContainerPlacement("app", mode, False, devices),)
        )

    sm = ComputeMode.SM_SHARING
    ask = [
        (placed(sm, DeviceAssignment("GPU-a", 0, 20480, 20480, 0.25)), "uuid"),
        (placed(sm, DeviceAssignment("GPU-b", 1, 20480, 20480, 0.25)), "uuid"),
        (placed(sm, DeviceAssignment("GPU-b", 1, 20480, 20480, 0.25)), "cdi"),
        (placed(sm, DeviceAssignment("GPU-c", 2, 10240, 10240, 0.125)), "uuid"),
        (placed(ComputeMode.TIME_SLICING, DeviceAssignment("GPU-d", 3, 20480, 20480, None)), "uuid"),
        (placed(sm, DeviceAssignment("GPU-a", 0, 20480, 20480, 0.25)), "uuid"),
    ]
    written = [binding_annotations(request, placement, device_style=style) for placement, style in ask]
    devices, memory = keys.devices_key("app"), keys.memory_request_key("app")
    portion, mode = keys.compute_portion_key("app"), keys.compute_mode_key("app")
    assert [(w[devices], w[memory], w.get(portion), w.get(mode)) for w in written] == [
        ("GPU-a", "20480Mi", "0.25", None),
        ("GPU-b", "20480Mi", "0.25", None),
        (f"{keys.GPU_RESOURCE}=GPU-b", "20480Mi", "0.25", None),
        ("GPU-c", "10240Mi", "0.125", None),
        ("GPU-d", "20480Mi", None, "time-slicing"),
        ("GPU-a", "20480Mi", "0.25", None),
    ]
    written[0][devices] = "changed by a caller"
    assert binding_annotations(request, ask[0][0], device_style="uuid")[devices] == "GPU-a"
    twice = placed(
        sm, DeviceAssignment("GPU-a", 0, 20480, 20480, 0.25), DeviceAssignment("GPU-a", 0, 20480, 20480, 0.25)
    )
    two = gpu_request(pod(annotations={"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}))
    distinct = placed(
        sm, DeviceAssignment("GPU-a", 0, 20480, 20480, 0.25), DeviceAssignment("GPU-b", 1, 20480, 20480, 0.25)
    )
    assert binding_annotations(two, distinct, device_style="uuid")[devices] == "GPU-a,GPU-b"
    for _ in range(2):  # one GPU twice is a bug the rendering refuses, its shape rendered before or not
        with pytest.raises(ValueError):
            binding_annotations(two, twice, device_style="uuid")


def test_a_pod_placed_in_the_other_mode_is_written_and_read_back_in_that_mode() -> None:
    """The Preferred mode policy may place a time-slicing pod on an sm-sharing GPU: the binder writes the
    mode it was placed in (and its compute portion), so the node enforces it and a restart books it."""
    annotations = {keys.memory_request_key("app"): "20Gi"}
    request = gpu_request(pod(annotations=annotations))
    u = gpu_uuid("n1", 0)
    placed = Placement(
        pod_uid="uid-1",
        node="n1",
        containers=(
            ContainerPlacement(
                "app", ComputeMode.SM_SHARING, False, (DeviceAssignment(u, 0, 20480, 20480, 20480 / H100),)
            ),
        ),
    )
    written = binding_annotations(request, placed, device_style="uuid")
    assert written[keys.compute_mode_key("app")] == "sm-sharing"
    bound = pod(annotations={**annotations, **written}, node="n1")
    inventory = {g.uuid: g for g in node_spec(sim_node(name="n1")).gpus}
    assert bound_placement(bound, gpus_by_uuid=inventory) == placed


def test_a_binding_the_node_refuses_books_no_gpu_and_says_why() -> None:
    """Devices next to a ``gpu-fraction`` no binder resolved to MiB: the node never guesses a GPU's size
    and refuses to start the pod, so a restarted scheduler books nothing on that GPU either (it used to
    resolve the fraction again on the GPU it found)."""
    bound = pod(annotations={"gpu-fraction": "0.5", keys.devices_key("app"): gpu_uuid("n1", 0)}, node="n1")
    inventory = {g.uuid: g for g in node_spec(sim_node(name="n1")).gpus}
    with pytest.raises(
        InvalidPodRequest, match=r"nvidia\.com/container\.app\.gpu-memory\.request.*not resolved"
    ):
        bound_placement(bound, gpus_by_uuid=inventory)


def test_a_bound_pod_is_booked_from_its_binding_even_when_its_own_request_cannot_be_read() -> None:
    """What the node runs is the binding: a pod whose user-side keys no longer parse (a typo in the
    compute request, kept by a binder that did not check it) still holds the MiB its binding names."""
    u = gpu_uuid("n1", 2)
    written = {
        keys.devices_key("app"): u,
        keys.memory_request_key("app"): "8192Mi",
        keys.memory_limit_key("app"): "12288Mi",
        keys.compute_mode_key("app"): "sm-sharing",
        keys.compute_portion_key("app"): "0.1",
    }
    bound = pod(annotations={**written, keys.compute_request_key("app"): "lots"}, node="n1")
    with pytest.raises(InvalidPodRequest):
        gpu_request(bound)
    inventory = {g.uuid: g for g in node_spec(sim_node(name="n1")).gpus}
    held = DeviceAssignment(u, 2, 8192, 12288, 0.1)
    assert bound_placement(bound, gpus_by_uuid=inventory) == Placement(
        "uid-1", "n1", (ContainerPlacement("app", ComputeMode.SM_SHARING, False, (held,)),)
    )
