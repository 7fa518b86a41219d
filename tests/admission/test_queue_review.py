"""The webhook's half of queues bound to namespaces (issue 34): a tenant's pod that names another team's
queue, in our label or KAI's, or that is relabelled into one, or that carries a priority above its
queue's bound, is refused with one sentence; pods of other schedulers and updates that leave the queue
alone are not judged."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from admission_reviews import pod, review

from gpufrac.admission.review import AdmissionPolicy, QueueBookNotReady, validate_review
from gpufrac.contract import keys
from gpufrac.placement.model import Queue
from gpufrac.placement.queue_access import queue_from_spec

SYSTEM_CLUSTER_CRITICAL = 2_000_000_000


@dataclass
class Book:
    """The cluster as the webhook's book would have read it."""

    queues_by_name: dict[str, Queue] = field(default_factory=dict)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    ready: bool = True

    def queues(self) -> Mapping[str, Queue]:
        if not self.ready:
            raise QueueBookNotReady
        return self.queues_by_name

    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        if not self.ready:
            raise QueueBookNotReady
        return self.labels.get(namespace)


BOOK = Book(
    queues_by_name={
        "q-a": queue_from_spec("q-a", {"namespaces": ["ns"], "maxPriority": 1000}),
        "q-b": queue_from_spec("q-b", {"namespaces": ["team-b"]}),
        "default": Queue("default"),
    },
    labels={"ns": {keys.NAMESPACE_DEFAULT_QUEUE_LABEL: "q-a"}},
)
POLICY = AdmissionPolicy(queues=BOOK)
FRACTION = {"gpu-fraction": "0.5"}


def tenant_pod(labels: dict[str, str] | None = None, *, priority: int | None = None, **kw: str) -> dict:
    manifest = pod(FRACTION, **kw)
    if labels is not None:
        manifest["metadata"]["labels"] = labels
    if priority is not None:
        manifest["spec"]["priority"] = priority
    return manifest


def answer(obj: dict, *, policy: AdmissionPolicy = POLICY, **kw: object) -> dict:
    return validate_review(review(obj, **kw), policy)["response"]  # type: ignore[arg-type]


@pytest.mark.parametrize("label", [keys.QUEUE_LABEL, keys.KAI_QUEUE_LABEL])
def test_a_pod_naming_another_teams_queue_is_refused_with_the_label_value_and_rule(label: str) -> None:
    response = answer(tenant_pod({label: "q-b"}))
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["message"] == (
        f'label {label}="q-b" is refused: queue q-b admits only namespace team-b, not namespace ns'
    )
    assert answer(tenant_pod({label: "q-a"}))["allowed"] is True


def test_a_priority_above_the_queues_bound_is_refused_with_or_without_the_label() -> None:
    for labels in ({keys.QUEUE_LABEL: "q-a"}, None):
        response = answer(tenant_pod(labels, priority=SYSTEM_CLUSTER_CRITICAL))
        assert response["allowed"] is False
        assert "allows pod priorities up to 1000 (spec.maxPriority)" in response["status"]["message"]
    assert answer(tenant_pod(None, priority=1000))["allowed"] is True


def test_relabelling_a_pod_across_queues_is_judged_as_creating_it_there() -> None:
    before = tenant_pod({keys.QUEUE_LABEL: "q-a"})
    after = copy.deepcopy(before)
    after["metadata"]["labels"] = {keys.QUEUE_LABEL: "q-b"}
    response = answer(after, operation="UPDATE", old=before)
    assert response["allowed"] is False
    assert 'label gpufrac.io/queue="q-b" is refused' in response["status"]["message"]
    # Dropping the label is a move to the namespace's default queue, judged there (allowed here).
    dropped = copy.deepcopy(before)
    del dropped["metadata"]["labels"]
    assert answer(dropped, operation="UPDATE", old=before)["allowed"] is True
    # An update that leaves the queue labels alone does not judge the queue (a pod that predates a
    # binding can still have its finalizers removed).
    stale = tenant_pod({keys.QUEUE_LABEL: "q-b"})
    touched = copy.deepcopy(stale)
    touched["metadata"]["labels"]["app"] = "x"
    assert answer(touched, operation="UPDATE", old=stale)["allowed"] is True


def test_pods_of_other_schedulers_and_a_webhook_without_a_book_do_not_judge_queues() -> None:
    assert answer(tenant_pod({keys.QUEUE_LABEL: "q-b"}, scheduler="default-scheduler"))["allowed"] is True
    assert answer(tenant_pod({keys.QUEUE_LABEL: "q-b"}), policy=AdmissionPolicy())["allowed"] is True


def test_until_the_book_has_read_the_cluster_a_judged_pod_is_refused() -> None:
    response = answer(tenant_pod({keys.QUEUE_LABEL: "q-a"}), policy=AdmissionPolicy(queues=Book(ready=False)))
    assert response["allowed"] is False
    assert response["status"]["code"] == 503
