"""Queues bound to namespaces (issue 34): which queue a pod is in, and whether its namespace may use it.

The webhook and the scheduler both call ``gpufrac.placement.queue_access``; these tests pin the rule and
the sentences a refused tenant reads.
"""

from __future__ import annotations

import pytest

from gpufrac.contract import keys
from gpufrac.placement.model import LabelSelector, NodeSelectorRequirement, Queue, SelectorOperator
from gpufrac.placement.queue_access import access_refusal, chosen_queue, queue_from_spec

#: The value of Kubernetes' built-in PriorityClass system-cluster-critical.
SYSTEM_CLUSTER_CRITICAL = 2_000_000_000

QUEUES = {
    "default": Queue("default"),
    "q-a": queue_from_spec("q-a", {"namespaces": ["team-a"], "maxPriority": 1000}),
    "q-b": queue_from_spec("q-b", {"namespaceSelector": {"matchLabels": {"team": "b"}}}),
}
A_LABELS = {"kubernetes.io/metadata.name": "team-a", "team": "a"}


def refusal(
    pod_labels: dict[str, str],
    *,
    namespace: str = "team-a",
    namespace_labels: dict[str, str] | None = None,
    priority: int = 0,
    queues: dict[str, Queue] | None = None,
) -> str | None:
    return access_refusal(
        pod_labels=pod_labels,
        namespace=namespace,
        namespace_labels=A_LABELS if namespace_labels is None else namespace_labels,
        priority=priority,
        queues=QUEUES if queues is None else queues,
        fallback="default",
    )


def test_a_tenant_may_not_name_another_teams_queue_in_either_label() -> None:
    assert refusal({keys.QUEUE_LABEL: "q-b"}) == (
        'label gpufrac.io/queue="q-b" is refused: queue q-b admits only namespaces labelled team=b, '
        "not namespace team-a"
    )
    assert refusal({keys.KAI_QUEUE_LABEL: "q-b"}) == (
        'label kai.scheduler/queue="q-b" is refused: queue q-b admits only namespaces labelled team=b, '
        "not namespace team-a"
    )
    # KAI's label is judged even when ours is in force: a pod carries no foreign queue at all.
    assert refusal({keys.QUEUE_LABEL: "q-a", keys.KAI_QUEUE_LABEL: "q-b"}) is not None
    assert refusal({keys.QUEUE_LABEL: "q-a"}) is None
    # Team b's own namespace may use its queue, whatever it is called.
    assert refusal({keys.QUEUE_LABEL: "q-b"}, namespace="b-prod", namespace_labels={"team": "b"}) is None


def test_a_priority_above_the_queues_bound_is_refused() -> None:
    assert refusal({keys.QUEUE_LABEL: "q-a"}, priority=SYSTEM_CLUSTER_CRITICAL) == (
        'label gpufrac.io/queue="q-a" is refused: queue q-a allows pod priorities up to 1000 '
        "(spec.maxPriority), and this pod's priority is 2000000000"
    )
    assert refusal({keys.QUEUE_LABEL: "q-a"}, priority=1000) is None


def test_an_unlabelled_pod_is_in_its_namespaces_default_queue_and_judged_there() -> None:
    labelled = {**A_LABELS, keys.NAMESPACE_DEFAULT_QUEUE_LABEL: "q-a"}
    choice = chosen_queue(pod_labels={}, namespace="team-a", namespace_labels=labelled, fallback="default")
    assert choice.queue == "q-a"
    # Dropping the label keeps a tenant in its own queue, with its bounds.
    assert refusal({}, namespace_labels=labelled, priority=SYSTEM_CLUSTER_CRITICAL) == (
        'the default queue of namespace team-a (label gpufrac.io/default-queue="q-a") is refused: '
        "queue q-a allows pod priorities up to 1000 (spec.maxPriority), and this pod's priority is 2000000000"
    )
    # A namespace default that names a queue the namespace may not use is no way in either.
    foreign = {**A_LABELS, keys.NAMESPACE_DEFAULT_QUEUE_LABEL: "q-b"}
    assert "queue q-b admits only" in (refusal({}, namespace_labels=foreign) or "")
    # Without a namespace default, the scheduler's default queue, judged the same way.
    assert (
        chosen_queue(pod_labels={}, namespace="x", namespace_labels={}, fallback="default").queue == "default"
    )
    closed = {**QUEUES, "default": Queue("default", namespaces=frozenset({"ops"}))}
    assert refusal({}, queues=closed) == (
        "the default queue default (the pod has no gpufrac.io/queue label) is refused: "
        "queue default admits only namespace ops, not namespace team-a"
    )


def test_binding_a_parent_binds_its_subtree_and_the_lowest_priority_bound_applies() -> None:
    queues = {
        "research": Queue("research", namespaces=frozenset({"team-r"}), max_priority=500),
        "vision": Queue("vision", parent="research", max_priority=2000),
    }
    assert refusal({keys.QUEUE_LABEL: "vision"}, queues=queues) == (
        'label gpufrac.io/queue="vision" is refused: queue research (an ancestor of vision) admits only '
        "namespace team-r, not namespace team-a"
    )
    assert refusal({keys.QUEUE_LABEL: "vision"}, namespace="team-r", priority=501, queues=queues) == (
        'label gpufrac.io/queue="vision" is refused: queue research (an ancestor of vision) allows pod '
        "priorities up to 500 (spec.maxPriority), and this pod's priority is 501"
    )


def test_an_open_or_unknown_queue_is_not_judged_here() -> None:
    assert refusal({keys.QUEUE_LABEL: "default"}, priority=SYSTEM_CLUSTER_CRITICAL) is None
    assert refusal({keys.QUEUE_LABEL: "created-later"}) is None  # the scheduler waits for it


@pytest.mark.parametrize(
    ("spec", "admitted"),
    [
        ({}, {"team-a", "team-b"}),  # open
        ({"namespaces": []}, set()),  # bound to nothing
        ({"namespaceSelector": {}}, {"team-a", "team-b"}),  # the empty selector matches all, as in Kueue
        ({"namespaces": ["team-a"]}, {"team-a"}),
        (
            {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["b"]}]}},
            {"team-b"},
        ),
        (
            {"namespaces": ["team-a"], "namespaceSelector": {"matchLabels": {"team": "b"}}},
            {"team-a", "team-b"},
        ),
        ({"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}}, set()),
    ],
)
def test_which_namespaces_a_queue_admits(spec: dict, admitted: set[str]) -> None:
    queue = queue_from_spec("q", spec)
    labels = {"team-a": {"team": "a"}, "team-b": {"team": "b"}}
    assert {ns for ns, lab in labels.items() if queue.admits(ns, lab)} == admitted
    assert queue.bound == bool(spec)


def test_queue_from_spec_reads_the_binding_and_refuses_what_the_crd_would() -> None:
    queue = queue_from_spec(
        "q",
        {
            "namespaces": ["a"],
            "namespaceSelector": {"matchExpressions": [{"key": "t", "operator": "NotIn", "values": ["x"]}]},
            "maxPriority": 7,
        },
    )
    assert queue.namespaces == frozenset({"a"})
    assert queue.namespace_selector == LabelSelector(
        {}, (NodeSelectorRequirement("t", SelectorOperator.NOT_IN, ("x",)),)
    )
    assert queue.max_priority == 7
    for bad, field in [
        ({"namespaces": "a"}, "spec.namespaces"),
        ({"maxPriority": "high"}, "spec.maxPriority"),
        (
            {"namespaceSelector": {"matchExpressions": [{"key": "t", "operator": "Gt", "values": ["1"]}]}},
            "matchExpressions[0]",
        ),
    ]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            queue_from_spec("q", bad)
