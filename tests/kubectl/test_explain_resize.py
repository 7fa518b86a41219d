"""``kubectl gpufrac explain POD`` on a pod with a resize not finished: the request still on it, the
scheduler's ``GpuResizePending`` (why it waits, or was refused) and the node agent's ``GpuResizeInProgress``,
in the text and in ``-o json``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.kubectl.command import _print_explanation
from gpufrac.kubectl.view import explain
from gpufrac.node.resize import REASON_WAITING_FOR_USAGE, RESIZE_CONDITION

ASK = keys.resize_key("app", keys.RESIZE_MEMORY_REQUEST)
DEFERRED = (
    "GPU GPU-a (index 0) on node gpu-1 has 8192 MiB beside its other bookings; held there: team-a/b 8192 MiB"
)


def _pod(annotations: dict[str, str], *conditions: tuple[str, str, str]) -> Pod:
    written: list[dict[str, Any]] = [{"type": "PodScheduled", "status": "True"}]
    for kind, reason, message in conditions:
        written.append(
            {
                "type": kind,
                "status": "True",
                "reason": reason,
                "message": message,
                "lastTransitionTime": "2026-12-06T03:00:00Z",
            }
        )
    return Pod.from_dict(
        {
            "metadata": {"name": "infer", "namespace": "team-a", "uid": "u1", "annotations": annotations},
            "spec": {"schedulerName": "gpufrac-scheduler", "containers": [{"name": "app", "image": "x"}]},
            "status": {"phase": "Running", "conditions": written},
        }
    )


def test_the_node_agents_condition_is_the_one_explain_reads() -> None:
    assert keys.POD_RESIZE_IN_PROGRESS_CONDITION == RESIZE_CONDITION


def test_a_deferred_request_and_a_resize_the_node_applies_are_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pod = _pod(
        {keys.memory_request_key("app"): "8Gi", ASK: "12Gi"},
        (keys.POD_RESIZE_PENDING_CONDITION, keys.POD_REASON_RESIZE_DEFERRED, DEFERRED),
        (RESIZE_CONDITION, REASON_WAITING_FOR_USAGE, "app: hard limit 8192 MiB kept, 9000 MiB in use"),
    )
    result = explain(pod, node=None, events=[])
    shown = json.loads(json.dumps(result.as_dict()))["resize"]
    assert shown["requested"] == {ASK: "12Gi"}
    assert shown["pending"] == {
        "type": keys.POD_RESIZE_PENDING_CONDITION,
        "status": "True",
        "reason": "Deferred",
        "message": DEFERRED,
        "since": "2026-12-06T03:00:00+00:00",
    }
    assert shown["in_progress"]["reason"] == REASON_WAITING_FOR_USAGE
    _print_explanation(result, wide=False)
    out = capsys.readouterr().out
    assert f"Resize:     {ASK}=12Gi" in out
    assert f"gpufrac.io/GpuResizePending: True (Deferred) since 2026-12-06T03:00:00+00:00: {DEFERRED}" in out
    assert "gpufrac.io/GpuResizeInProgress: True (WaitingForUsage)" in out


def test_a_refused_request_withdrawn_leaves_the_condition_until_the_scheduler_takes_it() -> None:
    refused = _pod({}, (keys.POD_RESIZE_PENDING_CONDITION, keys.POD_REASON_RESIZE_INFEASIBLE, "too big"))
    state = explain(refused, node=None, events=[]).resize
    assert state is not None and state.requested == {} and state.pending is not None
    assert state.pending["reason"] == "Infeasible" and state.in_progress is None
    assert explain(_pod({}), node=None, events=[]).resize is None
