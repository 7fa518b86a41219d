"""The MIG layout executor over the SIMULATED inventory and MIG control (no GPU here): the scheduler's
layout applied step by step to idle GPUs only, reset gating, refusals that name what is wrong, and an
agent killed between any two steps whose successor publishes what the GPU really is and finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufrac.mig.geometry import Slice
from gpufrac.node.inventory.publish import desired_state
from gpufrac.node.inventory.simulated import SimulatedCrash, SimulatedInventory, parse_yaml
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.mig.executor import LayoutApplier
from gpufrac.node.mig.layout import LayoutState, parse_layout
from gpufrac.node.mig.modes import WholeGpus

LAYOUT = ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]


def backend(**kwargs) -> SimulatedInventory:  # type: ignore[no-untyped-def]
    return SimulatedInventory(
        node_name="n", spec=parse_yaml("gpus: [{count: 2, model: A100-80GB}, {model: L4-24GB}]"), **kwargs
    )


def applier(
    sim: SimulatedInventory,
    tmp_path: Path,
    *,
    records: list[AllocationRecord] | None = None,
    allow_gpu_reset: bool = True,
) -> LayoutApplier:
    return LayoutApplier(
        backend=sim,
        control=sim,
        whole=WholeGpus(path=tmp_path / "gpu-modes.json"),
        containers=lambda: records or [],
        allow_gpu_reset=allow_gpu_reset,
    )


def request(gpus: dict[str, object], sim: SimulatedInventory, generation: int = 1):  # type: ignore[no-untyped-def]
    text = json.dumps({"generation": generation, "gpus": gpus})
    return parse_layout(text, gpus={g.uuid: g for g in sim.read().gpus})


def published(sim: SimulatedInventory, whole: WholeGpus | None = None) -> list[dict[str, object]]:
    from gpufrac.node.inventory.publish import with_whole

    inventory = sim.read() if whole is None else with_whole(sim.read(), whole())
    return list(desired_state(inventory=inventory).gpus)


def test_a_layout_turns_an_idle_gpu_into_mig_slices_and_back_into_fractions(tmp_path: Path) -> None:
    sim = backend()
    gpu = sim.read().gpus[0].uuid
    apply = applier(sim, tmp_path)
    mig = request({gpu: {"mode": "mig", "slices": LAYOUT}}, sim)
    outcome = apply.apply(gpu, mig.gpus[gpu])
    assert (outcome.state, outcome.changed) == (LayoutState.APPLIED, True)
    assert outcome.message == "mig: 3g.40gb@0, 2g.20gb@4, 1g.10gb@6"
    (entry, other, _) = published(sim)
    assert entry["mode"] == "mig" and other["mode"] == "fractions"
    assert [(s["profile"], s["start"], s["mib"]) for s in entry["mig"]] == [  # type: ignore[union-attr]
        ("3g.40gb", 0, 40192),
        ("2g.20gb", 4, 19968),
        ("1g.10gb", 6, 9728),
    ]
    assert all(str(s["uuid"]).startswith("MIG-") for s in entry["mig"])  # type: ignore[union-attr]
    # The NVML steps, in the order the GPU saw them: MIG on, the reset it waits for, then each slice.
    assert [op for op, _, _ in sim.mig_operations] == ["mode", "reset", "create", "create", "create"]

    again = apply.apply(gpu, mig.gpus[gpu])  # idempotent: nothing left to do
    assert (again.state, again.changed) == (LayoutState.APPLIED, False)

    # A different layout destroys only what it drops and creates only what it adds.
    sim.mig_operations.clear()
    other_layout = request({gpu: {"mode": "mig", "slices": ["3g.40gb@0", "3g.40gb@4"]}}, sim, 2)
    assert apply.apply(gpu, other_layout.gpus[gpu]).state is LayoutState.APPLIED
    assert sim.mig_operations == [
        ("destroy", gpu, "2g.20gb@4"),
        ("destroy", gpu, "1g.10gb@6"),
        ("create", gpu, "3g.40gb@4"),
    ]

    back = request({gpu: {"mode": "fractions"}}, sim, 3)
    assert apply.apply(gpu, back.gpus[gpu]).state is LayoutState.APPLIED
    assert published(sim)[0]["mode"] == "fractions" and "mig" not in published(sim)[0]


def test_a_mode_change_that_waits_for_a_reset_is_reported_and_not_reset_unless_allowed(
    tmp_path: Path,
) -> None:
    sim = backend()
    gpu = sim.read().gpus[0].uuid
    apply = applier(sim, tmp_path, allow_gpu_reset=False)
    mig = request({gpu: {"mode": "mig", "slices": LAYOUT}}, sim)
    outcome = apply.apply(gpu, mig.gpus[gpu])
    assert outcome.state is LayoutState.NEEDS_RESET
    assert (
        "mig.allow_gpu_reset is false" in outcome.message
        and f"nvidia-smi --gpu-reset -i {gpu}" in outcome.message
    )
    info = sim.read().gpus[0]
    assert (info.mig, info.mig_pending, published(sim)[0]["mode"]) == (False, True, "fractions")
    assert ("reset", gpu, "mig") not in sim.mig_operations

    sim.reset_gpu(gpu)  # the operator resets it; the next pass carries on
    assert apply.apply(gpu, mig.gpus[gpu]).state is LayoutState.APPLIED
    assert len(sim.read().gpus[0].mig_slices) == 3


def test_a_driver_that_resets_the_idle_gpu_itself_needs_no_reset_step(tmp_path: Path) -> None:
    sim = backend(resetless=True)
    gpu = sim.read().gpus[1].uuid
    mig = request({gpu: {"mode": "mig", "slices": ["7g.80gb@0"]}}, sim)
    assert (
        applier(sim, tmp_path, allow_gpu_reset=False).apply(gpu, mig.gpus[gpu]).state is LayoutState.APPLIED
    )
    assert [op for op, _, _ in sim.mig_operations] == ["mode", "create"]


def test_a_gpu_with_a_container_is_refused_naming_the_pod_and_container(tmp_path: Path) -> None:
    sim = SimulatedInventory(
        node_name="n", spec=parse_yaml('gpus: [{model: H100-80GB, mig: true, layout: ["3g.40gb@0"]}]')
    )
    gpu = sim.read().gpus[0]
    record = AllocationRecord(
        container_id="c" * 64,
        pod_namespace="team-a",
        pod_name="trainer-0",
        pod_uid="uid-1",
        container_name="cuda",
        devices=(f"nvidia.com/gpu={gpu.mig_slices[0].uuid}",),  # on one of its slices, by CDI name
        request_mib=40448,
        limit_mib=40448,
        mode="mig",
        portion=None,
    )
    apply = applier(sim, tmp_path, records=[record])
    wanted = request({gpu.uuid: {"mode": "fractions"}}, sim)
    outcome = apply.apply(gpu.uuid, wanted.gpus[gpu.uuid])
    assert outcome.state is LayoutState.REFUSED and not outcome.changed
    assert "team-a/trainer-0/cuda" in outcome.message and "not idle" in outcome.message
    assert sim.mig_operations == [] and len(sim.read().gpus[0].mig_slices) == 1
    # A layout the GPU already has is Applied whatever runs on it.
    same = request({gpu.uuid: {"mode": "mig", "slices": ["3g.40gb@0"]}}, sim)
    assert apply.apply(gpu.uuid, same.gpus[gpu.uuid]).state is LayoutState.APPLIED


@pytest.mark.parametrize("killed_before", range(1, 6))
def test_an_agent_killed_between_steps_leaves_a_published_truth_and_the_next_one_finishes(
    tmp_path: Path, killed_before: int
) -> None:
    machine = tmp_path / "sim-mig.json"  # the GPUs' MIG state, which outlives the agent as the hardware's
    sim = backend(mig_state=machine)
    gpu = sim.read().gpus[0].uuid
    mig = request({gpu: {"mode": "mig", "slices": LAYOUT}}, sim)
    sim.crash_before(killed_before)  # the agent dies before its n-th MIG step: mode, reset, 3 creates
    with pytest.raises(SimulatedCrash):
        applier(sim, tmp_path).apply(gpu, mig.gpus[gpu])

    # A new agent (a new backend on the same machine) publishes what the GPU is: half-way, consistent.
    after = backend(mig_state=machine)
    entry = published(after)[0]
    assert entry["mode"] == ("mig" if killed_before > 2 else "fractions")  # MIG is on once the reset ran
    assert after.read().gpus[0].mig_pending is (killed_before > 1)  # the switch, made before the kill
    made = LAYOUT[: max(0, killed_before - 3)]
    assert [f"{s['profile']}@{s['start']}" for s in entry.get("mig", [])] == made  # type: ignore[union-attr]

    outcome = applier(after, tmp_path).apply(gpu, mig.gpus[gpu])
    assert outcome.state is LayoutState.APPLIED
    assert [f"{s['profile']}@{s['start']}" for s in published(after)[0]["mig"]] == LAYOUT  # type: ignore[union-attr]
    creates = [s for op, _, s in sim.mig_operations + after.mig_operations if op == "create"]
    assert sorted(creates) == sorted(LAYOUT)  # each slice made once: nothing redone, nothing doubled
    modes = [op for op, _, _ in sim.mig_operations + after.mig_operations if op in ("mode", "reset")]
    assert modes == ["mode", "reset"]  # MIG switched on once, reset once


def test_an_agent_killed_while_leaving_mig_finishes_the_way_back(tmp_path: Path) -> None:
    sim = SimulatedInventory(
        node_name="n",
        spec=parse_yaml(
            f"gpus: [{{model: H200-141GB, mig: true, layout: {json.dumps(['3g.71gb@0', '3g.71gb@4'])}}}]"
        ),
    )
    gpu = sim.read().gpus[0].uuid
    back = request({gpu: {"mode": "whole"}}, sim)
    sim.crash_before(2)  # after the first slice is destroyed
    with pytest.raises(SimulatedCrash):
        applier(sim, tmp_path).apply(gpu, back.gpus[gpu])
    assert [s["start"] for s in published(sim)[0]["mig"]] == [4]  # type: ignore[index]
    assert applier(sim, tmp_path).apply(gpu, back.gpus[gpu]).state is LayoutState.APPLIED
    # The record outlives the agent: a new one publishes the GPU whole before it reads the layout again.
    assert published(sim, WholeGpus(path=tmp_path / "gpu-modes.json"))[0]["mode"] == "whole"
    assert "mig" not in published(sim)[0] and not sim.read().gpus[0].mig


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json", 'gpufrac.io/gpu-layout="not json" is invalid: it must be a JSON object'),
        ('{"gpus": {}}', "gpufrac.io/gpu-layout generation=null is invalid: it must be a whole number"),
        ('{"generation": 1, "gpus": []}', "gpufrac.io/gpu-layout gpus=[] is invalid: it must map GPU UUIDs"),
    ],
)
def test_an_unreadable_layout_is_refused_as_a_whole_naming_key_value_and_rule(
    content: str, says: str
) -> None:
    request = parse_layout(content, gpus={})
    assert request.error is not None and request.error.startswith(says)
    assert not request.gpus


def test_a_gpu_entry_that_breaks_a_rule_is_refused_alone(tmp_path: Path) -> None:
    sim = backend()
    a100, other, l4 = (g.uuid for g in sim.read().gpus)
    layout = request(
        {
            a100: {"mode": "mig", "slices": ["3g.40gb@1"]},
            other: {"mode": "mig", "slices": ["3g.40gb@0", "4g.40gb@0"]},
            l4: {"mode": "mig", "slices": []},
            "GPU-nope": {"mode": "whole"},
        },
        sim,
    )
    assert not layout.gpus
    assert layout.refused[a100] == (
        f'gpufrac.io/gpu-layout gpus["{a100}"].slices=["3g.40gb@1"] is invalid: slice 3g.40gb@1: 1 is not a '
        "valid start for 3g.40gb on A100-80GB (valid starts: 0, 4)"
    )
    assert "overlaps 3g.40gb@0" in layout.refused[other]
    assert "L4-24GB, which has no MIG profiles" in layout.refused[l4]
    assert "this node has no GPU GPU-nope" in layout.refused["GPU-nope"]
    mode = request({a100: {"mode": "half"}}, sim)
    assert mode.refused[a100].endswith('.mode="half" is invalid: a GPU\'s mode is fractions, mig or whole')


def test_a_slice_overlapping_another_fails_as_nvml_does(tmp_path: Path) -> None:
    sim = SimulatedInventory(
        node_name="n", spec=parse_yaml('gpus: [{model: A100-40GB, mig: true, layout: ["4g.20gb@0"]}]')
    )
    gpu = sim.read().gpus[0].uuid
    from gpufrac.node.mig.control import MigControlError

    with pytest.raises(MigControlError) as caught:
        sim.create_slice(gpu, "1g.5gb", 2)
    assert caught.value.code == "NVML_ERROR_INSUFFICIENT_RESOURCES"
    with pytest.raises(MigControlError, match="NVML_ERROR_IN_USE"):
        sim.set_mig_mode(gpu, False)  # slices first
    sim.destroy_slice(gpu, Slice("4g.20gb", 0))
    created = sim.create_slice(gpu, "1g.5gb", 2)
    sim.destroy_slice(gpu, Slice("1g.5gb", 2))
    assert sim.create_slice(gpu, "1g.5gb", 2) == created  # derived from the GPU and the slice: stable
