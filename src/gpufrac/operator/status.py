"""A config's status from what the cluster says: the DaemonSet's numbers and the selected Nodes.

Pure, like the rendering: the reconciler hands in the objects its informers hold and writes the result
only when it differs from the status already on the config.

Three conditions, each answering one question a person asks:

- Ready: does every selected node enforce GPU-memory limits now? True only when the DaemonSet has rolled
  out the current template, every desired agent is ready, and every selected Node reports the agent's
  ``gpu-fractioning.nvidia.com/Ready`` condition True. No selected node at all is not Ready
  (``NoMatchingNodes``): a config that runs nowhere enforces nothing.
- Progressing: is a rollout under way (template not yet observed or not on every node, agents starting)?
- Degraded: is something wrong that waiting will not fix? Nodes whose driver is below
  ``spec.minDriverMajor``, nodes whose agent reports Ready=False (with the agent's reason), or a DaemonSet
  the operator could not write. Agents still starting are Progressing, not Degraded.

Messages count and then name the first few nodes, so a status stays readable on a thousand-node cluster.
A condition's ``lastTransitionTime`` moves only when its status changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpufrac.contract.keys import DRIVER_MAJOR_LABEL, NODE_READY_CONDITION
from gpufrac.operator.resource import ConfigSpec

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)

# Reasons (CamelCase, as the API's conventions ask).
REASON_ALL_READY = "AllNodesReady"
REASON_NO_MATCHING_NODES = "NoMatchingNodes"
REASON_ROLLING_OUT = "RollingOut"
REASON_ROLLOUT_COMPLETE = "RolloutComplete"
REASON_AGENTS_NOT_READY = "AgentsNotReady"
REASON_NODES_NOT_READY = "NodesNotReady"
REASON_BELOW_MIN_DRIVER = "NodesBelowMinDriver"
REASON_APPLY_FAILED = "DaemonSetApplyFailed"
REASON_NO_DAEMONSET = "DaemonSetMissing"
REASON_AS_EXPECTED = "AsExpected"

NAMES_SHOWN = 5


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the status needs of a Node: labels, and the agent's condition (None: not reported)."""

    name: str
    labels: Mapping[str, str]
    ready: str | None = None
    reason: str = ""

    @classmethod
    def of(cls, node: Any) -> NodeView:
        meta = node.metadata
        ready, reason = None, ""
        for condition in (node.status.conditions if node.status else None) or []:
            if condition.type == NODE_READY_CONDITION:
                ready, reason = condition.status, condition.reason or ""
        return cls(name=meta.name, labels=dict(meta.labels or {}), ready=ready, reason=reason)


@dataclass(frozen=True, slots=True)
class DaemonSetView:
    """The DaemonSet controller's numbers (``status``) and the generation they describe."""

    generation: int
    observed_generation: int
    desired: int
    ready: int
    updated: int

    @classmethod
    def of(cls, daemonset: Any) -> DaemonSetView:
        status = daemonset.status
        return cls(
            generation=daemonset.metadata.generation or 0,
            observed_generation=(status.observedGeneration or 0) if status else 0,
            desired=(status.desiredNumberScheduled or 0) if status else 0,
            ready=(status.numberReady or 0) if status else 0,
            updated=(status.updatedNumberScheduled or 0) if status else 0,
        )


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def driver_major(node: NodeView) -> int | None:
    value = node.labels.get(DRIVER_MAJOR_LABEL)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _below(major: int | None, gate: int | None) -> bool:
    """Below the gate; a node that has not published its driver yet is not counted (it is not reporting)."""
    return major is not None and gate is not None and major < gate


def _names(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def compute_status(
    *,
    config: ConfigSpec,
    daemonset: DaemonSetView | None,
    nodes: Iterable[NodeView],
    apply_error: str | None = None,
    previous: Mapping[str, Any] | None = None,
    now: datetime,
) -> dict[str, Any]:
    """The config's ``status`` object (``previous`` keeps the transition times of unchanged conditions)."""
    selected = [n for n in nodes if selects(config.agent.node_selector, n.labels)]
    gate = config.min_driver_major
    below = [n.name for n in selected if _below(driver_major(n), gate)]
    failing = [n for n in selected if n.ready == "False"]
    unreported = [n.name for n in selected if n.ready is None]

    rolled_out = daemonset is not None and daemonset.observed_generation >= daemonset.generation
    desired = daemonset.desired if daemonset else 0
    agents_ready = daemonset.ready if daemonset else 0
    updated = daemonset.updated if daemonset else 0

    # Progressing
    if daemonset is None:
        progressing = ("True" if apply_error is None else "False", REASON_NO_DAEMONSET, "no DaemonSet yet")
    elif not rolled_out or updated < desired or agents_ready < desired:
        progressing = (
            "True",
            REASON_ROLLING_OUT,
            f"{updated}/{desired} agents updated, {agents_ready}/{desired} ready"
            + ("" if rolled_out else "; the DaemonSet controller has not observed the current template"),
        )
    else:
        progressing = ("False", REASON_ROLLOUT_COMPLETE, f"{desired} agents on the current template")

    # Degraded
    problems: list[str] = []
    if apply_error is not None:
        problems.append(f"DaemonSet not written: {apply_error}")
    if below:
        problems.append(f"{len(below)} nodes below driver major {gate}: {_names(below)}")
    if failing:
        reasons = Counter(n.reason or "NoReason" for n in failing)
        counted = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        problems.append(f"{len(failing)} nodes not ready ({counted}): {_names([n.name for n in failing])}")
    if apply_error is not None:
        degraded_reason = REASON_APPLY_FAILED
    elif below:
        degraded_reason = REASON_BELOW_MIN_DRIVER
    elif failing:
        degraded_reason = REASON_NODES_NOT_READY
    else:
        degraded_reason = REASON_AS_EXPECTED
    degraded = ("True" if problems else "False", degraded_reason, "; ".join(problems) or "no problems found")

    # Ready
    if not selected and desired == 0:
        ready = ("False", REASON_NO_MATCHING_NODES, f"no node matches {config.agent.node_selector}")
    elif daemonset is None or not rolled_out or agents_ready < desired:
        ready = ("False", REASON_AGENTS_NOT_READY, f"{agents_ready}/{desired} agents ready")
    elif failing or unreported:
        parts = []
        if failing:
            parts.append(f"{len(failing)} nodes report not ready: {_names([n.name for n in failing])}")
        if unreported:
            parts.append(f"{len(unreported)} nodes not reporting yet: {_names(unreported)}")
        ready = ("False", REASON_NODES_NOT_READY, "; ".join(parts))
    else:
        ready = ("True", REASON_ALL_READY, f"{len(selected)} nodes enforce GPU-memory limits")

    old = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = []
    for kind, (status, reason, message) in zip(CONDITION_TYPES, (ready, progressing, degraded), strict=True):
        before = old.get(kind)
        changed = before is None or before.get("status") != status
        conditions.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": config.generation,
                "lastTransitionTime": stamp if changed else (before or {}).get("lastTransitionTime", stamp),
            }
        )
    return {
        "observedGeneration": config.generation,
        "desiredNodes": desired,
        "readyNodes": agents_ready,
        "nodesBelowMinDriver": len(below),
        "conditions": conditions,
    }
