"""What a GPU holds at prepare: annotation pods bound to the node and prepared claims, against its usable
MiB (the node's last word on over-commit; the plugin's tests drive it with a real API server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufrac.contract import keys
from gpufrac.node.dra.ledger import (
    NodeGpu,
    claim_holdings,
    pod_holdings,
    pod_modes,
    pod_shares,
    refuse_overcommit,
)
from gpufrac.node.dra.prepare import AllocationError, cdi_spec, prepare_claim, read_prepared, write_spec

A = NodeGpu(uuid="GPU-aaaaaaaa-0000-4000-8000-000000000000", index=0, usable_mib=81920)
B = NodeGpu(uuid="GPU-bbbbbbbb-0000-4000-8000-000000000001", index=1, usable_mib=40960)
GPUS = (A, B)


def pod(
    name: str, *, devices: str, memory: str | None = "10Gi", phase: str = "Running", **extra: str
) -> dict[str, Any]:
    prefix = "nvidia.com/container.app."
    annotations = {prefix + "gpus.devices": devices, **extra}
    if memory is not None:
        annotations[prefix + "gpu-memory.request"] = memory
    return {
        "metadata": {"namespace": "team-a", "name": name, "annotations": annotations},
        "status": {"phase": phase},
    }


def test_annotation_pods_hold_their_request_on_the_gpu_they_name_by_uuid_index_or_cdi_name() -> None:
    pods = [
        pod("by-uuid", devices=A.uuid, memory="10Gi"),
        pod("by-index", devices="0", memory="5Gi"),
        pod("by-cdi", devices=f"{keys.CDI_GPU_KIND}=1", memory="1Gi"),
        pod("whole", devices=B.uuid, memory=None, **{"gpufrac.io/container.app.gpus": "1"}),
        pod("done", devices=A.uuid, phase="Succeeded"),  # finished: holds nothing
        pod("elsewhere", devices="GPU-cccccccc-0000-4000-8000-000000000002"),  # not this node's GPU
        pod("broken", devices=A.uuid, memory="lots"),  # refused at creation: holds nothing
        {"metadata": {"namespace": "team-a", "name": "plain"}},  # no GPU at all
    ]
    held = pod_holdings(pod_shares(pods, gpus=GPUS))
    assert sorted((h.holder, h.mib) for h in held[A.uuid]) == [
        ("pod team-a/by-index", 5120),
        ("pod team-a/by-uuid", 10240),
    ]
    assert sorted((h.holder, h.mib) for h in held[B.uuid]) == [
        ("pod team-a/by-cdi", 1024),
        ("pod team-a/whole", B.usable_mib),  # a whole GPU holds all its usable memory
    ]


def test_annotation_pods_say_which_mode_they_hold_a_gpu_in() -> None:
    pods = [pod("sm", devices=A.uuid, **{"nvidia.com/container.app.gpu-compute.mode": "sm-sharing"})]
    assert pod_modes(pod_shares(pods, gpus=GPUS)) == {A.uuid: {"sm-sharing": {"pod team-a/sm"}}}


def allocated(uid: str, *requests: tuple[str, str]) -> dict[str, Any]:
    """A claim allocated on GPU A, one result per ``(request, consumed memory)``."""
    return {
        "metadata": {"name": uid, "namespace": "team-a", "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": request,
                            "driver": keys.DRA_DRIVER_NAME,
                            "pool": "n",
                            "device": "a",
                            "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: memory},
                        }
                        for request, memory in requests
                    ],
                }
            }
        },
    }


def test_a_claim_fits_up_to_the_usable_memory_and_not_a_mib_more(tmp_path: Path) -> None:
    held_shares = prepare_claim(allocated("held", ("gpu", "40Gi")), uuids={"a": A.uuid}, pipe_root="/p")
    write_spec(tmp_path, "held", cdi_spec("held", held_shares, claim="team-a/held"))
    held = claim_holdings(read_prepared(tmp_path), gpus=GPUS)
    for uuid, holdings in pod_holdings(
        pod_shares([pod("p", devices=A.uuid, memory="20Gi")], gpus=GPUS)
    ).items():
        held.setdefault(uuid, []).extend(holdings)

    exactly = prepare_claim(allocated("new", ("gpu", "20Gi")), uuids={"a": A.uuid}, pipe_root="/p")
    refuse_overcommit(exactly, gpus=GPUS, held=held, claim="team-a/new")  # 40 + 20 + 20 = 80Gi: fits

    # Two requests of one claim on the same GPU count together.
    two = prepare_claim(
        allocated("two", ("a", "10Gi"), ("b", "10241Mi")), uuids={"a": A.uuid}, pipe_root="/p"
    )
    with pytest.raises(AllocationError) as caught:
        refuse_overcommit(two, gpus=GPUS, held=held, claim="team-a/two")
    assert str(caught.value).startswith(
        f"claim team-a/two (request a, b) asks for 20481 MiB on GPU {A.uuid}, which has 81920 usable MiB "
        "of which 61440 are held (40960 MiB by claim team-a/held; 20480 MiB by pod team-a/p): "
        "61440 + 20481 = 81921 MiB is over 81920"
    )
