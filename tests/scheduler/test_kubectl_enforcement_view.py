"""``kubectl gpufrac nodes`` / ``explain`` read the node agent's ``GpuMemoryEnforced`` condition right.

The conditions here are the node agent's own: the real ``LimitEnforcer`` sets limits through the
simulated driver and ``pod_condition`` words them, exactly what ``PodConditionWriter`` writes on
pods/status. The plugin's view must split that message per container (a container on two GPUs, and a
container whose name starts with another's), say Unknown for what the condition does not name, and
count a node's fractions once however many GPUs they span.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.kubectl.view import explain, gpu_rows, memory_enforcement, node_enforcement
from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.memlimit.condition import PodCondition, pod_condition
from gpufrac.node.memlimit.driver import NVML_ERROR_NOT_SUPPORTED
from gpufrac.node.memlimit.enforcer import LimitEnforcer
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits

GPUS = (
    GpuInfo(uuid="GPU-a", index=0, minor=0, model="H100", mib=81559),
    GpuInfo(uuid="GPU-b", index=1, minor=1, model="H100", mib=81559),
    GpuInfo(uuid="GPU-c", index=2, minor=2, model="H100", mib=81559),
)
#: Container → (devices, request MiB, limit MiB) of the fractional pods (gpu-fraction-num-devices: 2).
FRACTIONS = {"app": (("GPU-a", "GPU-b"), 4096, 6144), "app-sidecar": (("GPU-b", "GPU-a"), 1024, 1024)}


def node(name: str = "gpu-1") -> Node:
    ready = {"status": "True", "lastTransitionTime": "2026-12-05T08:00:00Z"}
    return Node.from_dict(
        {
            "metadata": {
                "name": name,
                "annotations": {
                    keys.NODE_GPUS_ANNOTATION: json.dumps(
                        [{"uuid": g.uuid, "index": g.index, "model": g.model, "mib": g.mib} for g in GPUS]
                    )
                },
            },
            "status": {
                "conditions": [{"type": "Ready", **ready}, {"type": keys.NODE_READY_CONDITION, **ready}],
                "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            },
        }
    )


def pod(name: str, condition: PodCondition | None, *, node_name: str = "gpu-1") -> Pod:
    annotations = {keys.GPU_FRACTION_NUM_DEVICES: "2"}
    for container, (devices, request, limit) in FRACTIONS.items():
        annotations |= {
            keys.memory_request_key(container): f"{request}Mi",
            keys.memory_limit_key(container): f"{limit}Mi",
            keys.devices_key(container): ",".join(devices),
        }
    conditions: list[dict[str, Any]] = [{"type": "PodScheduled", "status": "True"}]
    if condition is not None:
        conditions.append(
            {
                "type": keys.POD_MEMORY_ENFORCED_CONDITION,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastTransitionTime": "2026-12-05T08:01:00Z",
            }
        )
    return Pod.from_dict(
        {
            "metadata": {
                "name": name,
                "namespace": "team-a",
                "uid": f"uid-{name}",
                "annotations": annotations,
            },
            "spec": {
                "nodeName": node_name,
                "schedulerName": "gpufrac-scheduler",
                "containers": [{"name": c, "image": "x"} for c in FRACTIONS],
            },
            "status": {"phase": "Running", "conditions": conditions},
        }
    )


def whole_gpu_pod() -> Pod:
    """``trainer`` holds GPU-c whole: no memory limit to enforce."""
    return Pod.from_dict(
        {
            "metadata": {
                "name": "trainer",
                "namespace": "team-a",
                "uid": "uid-t",
                "annotations": {keys.whole_gpus_key("trainer"): "1", keys.devices_key("trainer"): "GPU-c"},
            },
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "trainer", "image": "x"}]},
            "status": {"phase": "Running"},
        }
    )


def agent_condition(
    tmp_path: Path, *, refuse: str | None = None, start: tuple[str, ...] = ()
) -> tuple[PodCondition, dict[str, str]]:
    """What the node agent writes for the pod's fractions once ``start`` containers started (all if empty),
    with the driver refusing every limit on GPU ``refuse``; and what it says of each started container
    alone (the agent's words for a pod of that one container, its name taken off)."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    root = work / "cgroupfs"
    root.mkdir()
    (root / "cgroup.controllers").touch()
    driver = SimulatedMemoryLimits(
        path=work / "limits.json", gpus=lambda: GPUS, driver_version=lambda: "615.20.01", cgroup_root=root
    )
    if refuse is not None:
        driver.refuse(gpu=refuse, code=NVML_ERROR_NOT_SUPPORTED)
    enforcer = LimitEnforcer(
        driver=driver,
        gpu_uuid={g.uuid: g.uuid for g in GPUS}.get,
        cgroup_root=root,
        on_change=lambda uid: None,
    )
    records = []
    for cid, (container, (devices, request, limit)) in enumerate(FRACTIONS.items()):
        record = AllocationRecord(
            container_id=f"c{cid}",
            pod_namespace="team-a",
            pod_name="infer",
            pod_uid="uid-infer",
            container_name=container,
            devices=devices,
            request_mib=request,
            limit_mib=limit,
            mode="time-slicing",
            portion=None,
        )
        records.append(record)
        if container in (start or FRACTIONS):
            (root / "kubepods" / f"c{cid}").mkdir(parents=True)
            enforcer.enforce(record=record, pid=0, cgroups_path=f"/kubepods/c{cid}")
    booked = {b.record.container_id: b for b in enforcer.booked()}
    condition = pod_condition(records, booked)
    assert condition is not None
    alone = {}
    for record in records:
        if record.container_id in booked:
            said = pod_condition([record], booked)
            assert said is not None
            alone[record.container_name] = said.message.removeprefix(f"{record.container_name}: ")
    return condition, alone


def test_a_true_condition_is_split_per_container_with_each_gpus_values(tmp_path: Path) -> None:
    condition, alone = agent_condition(tmp_path)
    assert condition.status == "True"
    read = memory_enforcement(pod("infer", condition), ["app", "app-sidecar"])
    assert (read.status, read.reason, read.since) == ("True", "LimitsReadBack", "2026-12-05T08:01:00+00:00")
    app, sidecar = read.containers
    assert (app.container, app.status, app.reason, app.message) == (
        "app",
        "True",
        "LimitsReadBack",
        alone["app"],
    )
    assert (sidecar.container, sidecar.status, sidecar.message) == (
        "app-sidecar",
        "True",
        alone["app-sidecar"],
    )
    assert "soft 4096 MiB, hard 6144 MiB" in app.message and "kubepods/c0" in app.message
    assert "soft 1024 MiB, hard 1024 MiB" in sidecar.message and "kubepods/c1" in sidecar.message


def test_a_refused_limit_names_its_container_and_leaves_the_other_unknown(tmp_path: Path) -> None:
    # app-sidecar started and its limit on GPU-b was refused (GPU-a's held: one part per GPU); app has
    # not started yet.
    condition, alone = agent_condition(tmp_path, refuse="GPU-b", start=("app-sidecar",))
    assert (condition.status, condition.reason) == ("False", keys.POD_REASON_LIMITS_NOT_IN_FORCE)
    app, sidecar = memory_enforcement(pod("infer", condition), ["app", "app-sidecar"]).containers
    assert (sidecar.status, sidecar.reason) == ("False", keys.POD_REASON_LIMITS_NOT_IN_FORCE)
    assert sidecar.message == alone["app-sidecar"]
    assert "GPU-b: soft 1024 MiB, hard 1024 MiB not set" in sidecar.message
    assert "NVML_ERROR_NOT_SUPPORTED" in sidecar.message and "GPU-a: " in sidecar.message
    assert (app.status, app.reason) == ("Unknown", None)
    assert app.message == "not named in the pod's condition (read back, or not started yet)"

    waiting, _ = agent_condition(tmp_path, start=("app",))
    app, sidecar = memory_enforcement(pod("infer", waiting), ["app", "app-sidecar"]).containers
    assert (app.status, sidecar.status) == ("Unknown", "False")
    assert sidecar.reason == keys.POD_REASON_LIMITS_NOT_VERIFIED
    assert sidecar.message == "not verified yet (the container has not started)"


def test_nodes_counts_each_fraction_once_and_lists_the_unverified(tmp_path: Path) -> None:
    pods = [
        pod("enforced", agent_condition(tmp_path)[0]),
        pod("refused", agent_condition(tmp_path, refuse="GPU-b", start=("app-sidecar",))[0]),
        pod("new", None),
        pod("elsewhere", agent_condition(tmp_path)[0], node_name="gpu-2"),
        whole_gpu_pod(),
    ]
    rows, warnings = gpu_rows([node("gpu-1"), node("gpu-2")], pods)
    assert warnings == []
    on_1 = {r.index: r for r in rows if r.node == "gpu-1"}
    assert on_1[0].enforced == on_1[1].enforced == "2/6"  # two containers of three pods; "enforced"'s hold
    assert [(t.pod, t.container, t.enforced) for t in on_1[0].tenants if t.pod != "enforced"] == [
        ("refused", "app", "Unknown"),
        ("refused", "app-sidecar", "False"),
        ("new", "app", "Unknown"),
        ("new", "app-sidecar", "Unknown"),
    ]
    assert on_1[2].enforced == "-"  # the trainer's whole GPU: nothing to enforce
    assert [(t.pod, t.enforced) for t in on_1[2].tenants] == [("trainer", "-")]
    assert on_1[1].as_dict()["enforced"] == "2/6"

    per_node = {n.node: n.as_dict() for n in node_enforcement(rows)}
    assert per_node["gpu-1"] == {
        "node": "gpu-1",
        "fractions": 6,  # each container spans two GPUs and counts once; the trainer is a whole GPU
        "verified": 2,
        "unverified": [
            "team-a/new/app",
            "team-a/new/app-sidecar",
            "team-a/refused/app",
            "team-a/refused/app-sidecar",
        ],
    }
    assert per_node["gpu-2"] == {"node": "gpu-2", "fractions": 2, "verified": 2, "unverified": []}


@pytest.mark.parametrize("written", [True, False])
def test_explain_says_it_per_fractional_container_only(tmp_path: Path, written: bool) -> None:
    condition = agent_condition(tmp_path)[0] if written else None
    result = explain(pod("infer", condition), node=node(), events=[])
    assert result.enforced is not None
    assert [c.container for c in result.enforced.containers] == ["app", "app-sidecar"]
    shown = result.as_dict()["enforced"]
    if written:
        assert shown["status"] == "True" and shown["message"] == condition.message
        assert [c["status"] for c in shown["containers"]] == ["True", "True"]
    else:
        assert shown["status"] is None
        assert [c["status"] for c in shown["containers"]] == ["Unknown", "Unknown"]
        assert "has not written GpuMemoryEnforced" in shown["containers"][0]["message"]


def test_explain_of_a_whole_gpu_pod_has_no_enforcement_to_show() -> None:
    result = explain(whole_gpu_pod(), node=node(), events=[])
    assert [g["mode"] for g in result.gpus] == ["exclusive"]
    assert result.enforced is None
