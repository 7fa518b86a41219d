"""MIG in the node's inventory, before any API call: the SIMULATED backend's MIG GPUs (file and flag), what
``gpufrac.io/gpus`` says of them, and the consumers that must keep fractions off a MIG GPU (the DRA slice)."""

from __future__ import annotations

import json

import pytest

from gpufrac.node.dra.slices import desired_devices
from gpufrac.node.inventory.publish import desired_state, with_whole
from gpufrac.node.inventory.reserve import MemoryReserveSettings
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, parse_yaml, simulated_uuid
from gpufrac.node.mps.mode import DriverVersion, capability_for

YAML = """
gpus:
  - {model: H100-80GB, mig: true, layout: ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"], reserved_mib: 500}
  - {model: H100-80GB, reserved_mib: 500}
  - {model: H100-80GB, reserved_mib: 500}
"""


def test_a_mig_gpu_is_published_in_mode_mig_with_its_slices_and_the_others_as_before() -> None:
    backend = SimulatedInventory(node_name="n", spec=parse_yaml(YAML))
    inventory = with_whole(backend.read(), {simulated_uuid("n", 2)})
    capability = capability_for(driver=DriverVersion.parse(inventory.driver_version), mps_running=True)
    state = desired_state(inventory=inventory, capability=capability, reserve=MemoryReserveSettings())
    mig, fractions, whole = json.loads(state.gpus_annotation)
    assert [g["mode"] for g in (mig, fractions, whole)] == ["mig", "fractions", "whole"]
    assert "mig" not in fractions and "mig" not in whole
    assert fractions == {
        "uuid": simulated_uuid("n", 1),
        "index": 1,
        "model": "H100-80GB",
        "mib": 81559 - 500,
        "total_mib": 81559,
        "reserved_mib": 500,
        "mode": "fractions",
    }
    assert [(s["profile"], s["start"], s["mib"]) for s in mig["mig"]] == [
        ("3g.40gb", 0, 40448),
        ("2g.20gb", 4, 20096),
        ("1g.10gb", 6, 9984),
    ]
    assert len({s["uuid"] for s in mig["mig"]}) == 3 and all(s["uuid"].startswith("MIG-") for s in mig["mig"])
    assert state.ready and state.labels["gpufrac.io/gpu-count"] == "3"
    # The DRA slice offers shares of the fraction GPU only: MIG slices and whole GPUs are not shares.
    devices = desired_devices(inventory=inventory, capability=capability)
    assert [d["attributes"]["uuid"]["string"] for d in devices] == [simulated_uuid("n", 1)]


def test_a_node_of_mig_gpus_only_is_ready_to_serve_its_slices() -> None:
    backend = SimulatedInventory(node_name="n", spec=parse_flag("2xA100-80GB:mig"))
    state = desired_state(inventory=backend.read())
    assert state.ready and [g["mode"] for g in state.gpus] == ["mig", "mig"]
    assert all(g["mig"] == [] for g in state.gpus)  # MIG on, no slices made yet


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "gpus: [{model: L4-24GB, mig: true}]",
            "mig=true on model 'L4-24GB' is invalid: MIG is simulated for",
        ),
        ('gpus: [{model: A100-40GB, layout: ["7g.40gb@0"]}]', "a MIG layout needs mig: true"),
        (
            'gpus: [{model: A100-40GB, mig: true, layout: ["3g.20gb@0", "4g.20gb@0"]}]',
            "slice 4g.20gb@0: it overlaps 3g.20gb@0 at memory slice 0",
        ),
        (
            'gpus: [{model: A100-40GB, mig: true, layout: ["3g.40gb@0"]}]',
            "A100-40GB has no MIG profile '3g.40gb'",
        ),
    ],
)
def test_a_simulated_mig_gpu_that_breaks_a_rule_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="invalid") as caught:
        parse_yaml(text)
    assert says in str(caught.value)
    with pytest.raises(ValueError, match="MIG is simulated for"):
        parse_flag("1xT4-16GB:mig")
