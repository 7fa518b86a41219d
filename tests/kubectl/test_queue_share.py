"""``kubectl gpufrac explain POD`` names the pod's queue, how the pod got there (the scheduler's rule,
``placement.queue_access.chosen_queue``), and that queue's GPU-memory share as its Queue object says."""

from __future__ import annotations

from typing import Any

from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.kubectl.view import BY_DEFAULT, BY_LABEL, BY_NAMESPACE, explain, queue_share
from gpufrac.scheduler.queues import GpufracQueue


def pod(labels: dict[str, str] | None = None) -> Pod:
    return Pod.from_dict(
        {
            "metadata": {"name": "train", "namespace": "team-a", "uid": "u1", "labels": labels or {}},
            "spec": {"containers": [{"name": "app"}], "schedulerName": "gpufrac-scheduler"},
        }
    )


def queue(name: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> Any:
    return GpufracQueue(metadata=ObjectMeta(name=name), spec=spec, status=status)


VISION = {"parentQueue": "research", "resources": {"gpuMemory": {"deserved": 163840, "limit": 409600}}}
WRITTEN = {
    "allocated": {"gpuMemory": 250000, "gpus": 0},
    "fairShare": {"gpuMemory": 300000, "gpus": 0},
    "deserved": {"gpuMemory": 163840, "gpus": 0},
}
QUEUES = [queue("research", {}), queue("vision", VISION, WRITTEN), queue("batch", {})]


def text(share: Any) -> str:
    return "\n".join(f"{label} {line}" for label, line in share.lines())


def test_a_labelled_pod_shows_its_queue_and_the_share_its_spec_and_status_say() -> None:
    share = queue_share(
        pod({keys.QUEUE_LABEL: "vision"}), queues=QUEUES, namespace_labels={}, default_queue="default"
    )
    assert (share.queue, share.how, share.found, share.parent) == ("vision", BY_LABEL, True, "research")
    assert (share.deserved_mib, share.limit_mib) == (163840, 409600)
    assert (share.fair_share_mib, share.allocated_mib) == (300000, 250000)
    assert share.lines() == [
        ("Queue:", "vision (label gpufrac.io/queue), a child of queue research"),
        (
            "Share:",
            "GPU memory deserved 163840 MiB, limit 409600 MiB, fair share 300000 MiB, allocated 250000 MiB",
        ),
    ]


def test_a_queue_whose_status_is_not_written_says_so_and_still_shows_its_deserved() -> None:
    share = queue_share(
        pod({keys.QUEUE_LABEL: "vision"}),
        queues=[queue("vision", {"resources": {"gpuMemory": {"deserved": 163840}}})],
        namespace_labels={},
        default_queue="default",
    )
    assert share.fair_share_mib is None and share.allocated_mib is None
    (_, line) = share.lines()[1]
    assert line == (
        "GPU memory deserved 163840 MiB; fair share and allocated not written yet "
        "(the scheduler writes the Queue's status)"
    )


def test_a_queue_without_a_deserved_amount_deserves_zero_as_the_scheduler_reads_it() -> None:
    share = queue_share(
        pod({keys.QUEUE_LABEL: "batch"}), queues=QUEUES, namespace_labels={}, default_queue="default"
    )
    assert share.deserved_mib == 0 and share.limit_mib is None
    assert "GPU memory deserved 0 MiB; fair share and allocated not written yet" in text(share)


def test_our_label_wins_over_kais_and_kais_counts_alone() -> None:
    both = {keys.QUEUE_LABEL: "vision", keys.KAI_QUEUE_LABEL: "batch"}
    assert queue_share(pod(both), queues=QUEUES, namespace_labels={}, default_queue="d").queue == "vision"
    kai = queue_share(
        pod({keys.KAI_QUEUE_LABEL: "batch"}), queues=QUEUES, namespace_labels={}, default_queue="d"
    )
    assert (kai.queue, kai.how) == ("batch", BY_LABEL)
    assert kai.lines()[0] == ("Queue:", "batch (label kai.scheduler/queue)")


def test_a_pod_without_a_label_is_in_its_namespaces_default_queue() -> None:
    share = queue_share(
        pod(),
        queues=QUEUES,
        namespace_labels={keys.NAMESPACE_DEFAULT_QUEUE_LABEL: "vision"},
        default_queue="default",
    )
    assert (share.queue, share.how) == ("vision", BY_NAMESPACE)
    assert share.lines()[0] == (
        "Queue:",
        "vision (namespace team-a's label gpufrac.io/default-queue), a child of queue research",
    )


def test_otherwise_in_the_schedulers_default_queue_with_the_reason() -> None:
    share = queue_share(pod(), queues=QUEUES, namespace_labels={}, default_queue="batch")
    assert (share.queue, share.how, share.found) == ("batch", BY_DEFAULT, True)
    said = text(share)
    assert "batch (the scheduler's default_queue)" in said
    assert "the pod has no gpufrac.io/queue or kai.scheduler/queue label and namespace team-a has no " in said
    assert "batch is the scheduler's default_queue as --default-queue gives it" in said


def test_unreadable_namespace_labels_are_said_not_guessed() -> None:
    share = queue_share(pod(), queues=QUEUES, namespace_labels=None, default_queue="batch")
    assert share.queue == "batch"
    assert "namespace team-a's labels could not be read: if it names a default queue" in text(share)


def test_a_queue_without_a_queue_object_says_there_is_nothing_to_show() -> None:
    share = queue_share(
        pod({keys.QUEUE_LABEL: "nlp"}),
        queues=QUEUES,
        namespace_labels={},
        default_queue="default",
        notes=["Queues could not be read: forbidden"],
    )
    assert not share.found and share.deserved_mib is None
    said = text(share)
    assert "Share: GPU memory no Queue object named nlp (kubectl get queues.gpufrac.io)" in said
    assert "Queues could not be read: forbidden" in said
    assert "configuration file and KAI Scheduler's Queues" in said


def test_a_parent_queue_holds_its_pods_and_says_why() -> None:
    share = queue_share(
        pod({keys.QUEUE_LABEL: "research"}), queues=QUEUES, namespace_labels={}, default_queue="default"
    )
    assert "queue research has child queues (vision): pods join a queue without children" in text(share)


def test_explain_carries_the_queue_into_its_json() -> None:
    labelled = pod({keys.QUEUE_LABEL: "vision"})
    share = queue_share(labelled, queues=QUEUES, namespace_labels={}, default_queue="default")
    data = explain(labelled, node=None, events=[], queue=share).as_dict()
    assert data["queue"]["queue"] == "vision" and data["queue"]["how"] == BY_LABEL
    assert data["queue"]["deserved_mib"] == 163840 and data["queue"]["fair_share_mib"] == 300000
    assert explain(labelled, node=None, events=[]).as_dict()["queue"] is None
