"""Min-runtime's resolution over a queue tree (KAI Scheduler's minruntime resolver), the duration format
of the Queue fields (ours and KAI's), and the preemption delay's config key; no API server."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from lightkube.models.core_v1 import PodStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from pydantic import ValidationError

from gpufrac.placement.model import Queue
from gpufrac.placement.preemption import Kind
from gpufrac.placement.queue_access import parse_duration, queue_from_spec
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.preemption_gates import (
    GateSettings,
    MinRuntime,
    PreemptionDelay,
    Wakeups,
    format_duration,
    min_runtime,
)
from gpufrac.scheduler.queues import KaiQueue, config_queues, queue_from_kai


def _tree(**settings: tuple[str | None, float | None, float | None]) -> dict[str, Queue]:
    """name=(parent, preempt, reclaim)."""
    return {
        n: Queue(n, parent=p, preempt_min_runtime_s=pre, reclaim_min_runtime_s=rec)
        for n, (p, pre, rec) in settings.items()
    }


def test_preempt_min_runtime_is_the_victims_queue_or_its_nearest_ancestors() -> None:
    tree = _tree(A=(None, None, None), B=("A", 600, None), leaf1=("B", 300, None), leaf2=("B", None, None))
    assert min_runtime(Kind.PREEMPT, "leaf1", "leaf1", tree) == (300, "queue leaf1's preemptMinRuntime")
    assert min_runtime(Kind.PREEMPT, "leaf2", "leaf2", tree) == (600, "queue B's preemptMinRuntime")
    assert min_runtime(Kind.PREEMPT, "A", "A", tree) == (0, "")
    assert min_runtime(Kind.CONSOLIDATE, "leaf1", "leaf1", tree) == (0, "")  # moves are not bound


def test_reclaim_min_runtime_is_resolved_below_the_lowest_common_ancestor_as_kai_does() -> None:
    """KAI's design example (docs/developer/designs/min-runtime): A > B (600s) > C (300s), D; leaves under
    C and D. C's value protects C's pods from D's, not from each other."""
    tree = _tree(
        A=(None, None, None),
        B=("A", None, 600),
        C=("B", None, 300),
        D=("B", None, None),
        c1=("C", None, None),
        c2=("C", None, None),
        d1=("D", None, None),
        other=(None, None, None),
        guarded=(None, None, 60),
    )
    # Preemptor under C, victim under D: one step below the LCA B is D (unset), then up: B's 600.
    assert min_runtime(Kind.RECLAIM, "c1", "d1", tree) == (600, "queue B's reclaimMinRuntime")
    # Preemptor under D, victim under C: C's 300.
    assert min_runtime(Kind.RECLAIM, "d1", "c1", tree) == (300, "queue C's reclaimMinRuntime")
    # Siblings inside C: one step below C is c2 (unset), then up: C's 300.
    assert min_runtime(Kind.RECLAIM, "c1", "c2", tree) == (300, "queue C's reclaimMinRuntime")
    # Different top-level trees: the victim's top-level queue alone.
    assert min_runtime(Kind.RECLAIM, "other", "c1", tree) == (0, "")
    assert min_runtime(Kind.RECLAIM, "c1", "guarded", tree) == (60, "queue guarded's reclaimMinRuntime")


def _pod(uid: str, started: datetime | None) -> Pod:
    return Pod(metadata=ObjectMeta(name=uid, namespace="ns", uid=uid), status=PodStatus(startTime=started))


def test_only_pods_started_less_than_their_minimum_ago_are_protected_and_the_pod_is_woken_then() -> None:
    now = 1_000_000.0
    tree = _tree(a=(None, None, None), b=(None, None, 300))
    woken: list[float] = []

    def spawn(coro: object) -> None:
        coro.close()  # type: ignore[attr-defined]

    wake = Wakeups(wall=lambda: now, retry=lambda: None, spawn=spawn)
    gate = MinRuntime(queues=lambda: tree.values(), wall=lambda: now, wake=wake)
    at = lambda s: datetime.fromtimestamp(now - s, UTC)  # noqa: E731
    gate.begin("p")
    victims = [
        ("young", "b", _pod("young", at(100))),
        ("old", "b", _pod("old", at(400))),
        ("unstarted", "b", _pod("unstarted", None)),
        ("gone", "b", None),
    ]
    assert gate.protected("p", Kind.RECLAIM, "a", victims) == {"young"}
    assert gate.protected("p", Kind.PREEMPT, "b", victims) == set()  # no preemptMinRuntime
    note = gate.note("p")
    assert "1 more have not run their queue's minimum of 5m (queue b's reclaimMinRuntime) yet" in note
    assert wake.armed == {now + 200}
    gate.begin("q")
    assert gate.protected("q", Kind.RECLAIM, "a", victims[:1]) == {"young"}
    assert gate.note("q").startswith(
        " No pod is evicted for it: no victim has run its queue's minimum of 5m "
        "(queue b's reclaimMinRuntime) yet; tried again at "
    )
    woken.extend(wake.armed)
    assert woken == [now + 200]  # one timer for both
    assert gate.note("q") == ""


def test_the_preemption_delay_counts_from_creation_and_says_until_when() -> None:
    created = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    pod = Pod(metadata=ObjectMeta(name="p", namespace="ns", uid="p", creationTimestamp=created))
    clock = [created.timestamp() + 10]
    wake = Wakeups(wall=lambda: clock[0], retry=lambda: None, spawn=lambda c: c.close())
    assert PreemptionDelay(0, wall=lambda: clock[0], wake=wake).note([pod]) == ""
    delay = PreemptionDelay(300, wall=lambda: clock[0], wake=wake)
    assert delay.note([pod]) == (
        " Waiting until 2030-01-01T12:05:00Z before evicting anybody for it (preemption_delay_s=300 "
        "after its creation), so a node autoscaler can add room first."
    )
    assert wake.armed == {created.timestamp() + 300}
    clock[0] = created.timestamp() + 300
    assert delay.note([pod]) == ""
    assert SchedulerConfig().preemption_delay_s == 0
    with pytest.raises(ValidationError):
        SchedulerConfig(preemption_delay_s=-1)


def test_the_schedulers_default_min_runtime_holds_where_no_queue_on_the_path_sets_one() -> None:
    tree = _tree(A=(None, None, None), B=(None, 60, 600), leaf=("A", None, None))
    config = SchedulerConfig(min_runtime={"preempt_s": 120, "reclaim_s": 30})
    defaults = GateSettings.of(config)
    assert min_runtime(Kind.PREEMPT, "leaf", "leaf", tree, defaults) == (
        120,
        "the scheduler's min_runtime.preempt_s",
    )
    assert min_runtime(Kind.RECLAIM, "B", "leaf", tree, defaults) == (
        30,
        "the scheduler's min_runtime.reclaim_s",
    )
    # A queue's own setting wins over the default, and moves are never bound.
    assert min_runtime(Kind.PREEMPT, "B", "B", tree, defaults) == (60, "queue B's preemptMinRuntime")
    assert min_runtime(Kind.RECLAIM, "leaf", "B", tree, defaults) == (600, "queue B's reclaimMinRuntime")
    assert min_runtime(Kind.CONSOLIDATE, "leaf", "leaf", tree, defaults) == (0, "")
    assert GateSettings.of(SchedulerConfig()) == GateSettings()  # nothing unless configured
    with pytest.raises(ValidationError):
        SchedulerConfig(min_runtime={"reclaim_s": -1})


def test_the_configuration_files_queues_take_min_runtimes_too() -> None:
    config = SchedulerConfig(
        queues=[
            {"name": "default"},
            {"name": "batch", "reclaim_min_runtime_s": 600, "preempt_min_runtime_s": 60},
        ]
    )
    queues = {q.name: q for q in config_queues(config)}
    assert (queues["batch"].preempt_min_runtime_s, queues["batch"].reclaim_min_runtime_s) == (60, 600)
    assert queues["default"].reclaim_min_runtime_s is None
    assert min_runtime(Kind.RECLAIM, "default", "batch", queues) == (600, "queue batch's reclaimMinRuntime")


def test_min_runtimes_are_go_durations_in_our_queue_and_in_kais() -> None:
    assert [parse_duration(t, where="x") for t in ("5m", "1h30m", "90s", "0", "1.5h", "250ms")] == [
        300,
        5400,
        90,
        0,
        5400,
        0.25,
    ]
    assert [format_duration(s) for s in (300, 5400, 90, 0, 0.25, 3)] == [
        "5m",
        "1h30m",
        "1m30s",
        "0s",
        "0.25s",
        "3s",
    ]
    q = queue_from_spec("q", {"preemptMinRuntime": "5m", "reclaimMinRuntime": "1h"})
    assert (q.preempt_min_runtime_s, q.reclaim_min_runtime_s) == (300, 3600)
    assert queue_from_spec("q", {}).reclaim_min_runtime_s is None  # unset: the ancestors' value applies
    with pytest.raises(ValueError, match=r"spec.reclaimMinRuntime: '5' is not a duration"):
        queue_from_spec("q", {"reclaimMinRuntime": "5"})
    with pytest.raises(ValueError, match="negative"):
        queue_from_spec("q", {"preemptMinRuntime": "-1s"})
    kai = queue_from_kai(
        KaiQueue(
            metadata=ObjectMeta(name="k"),
            spec={"preemptMinRuntime": "10m", "reclaimMinRuntime": "-1s"},
        )
    )
    assert (kai.preempt_min_runtime_s, kai.reclaim_min_runtime_s) == (600, 0)
    bad = queue_from_kai(KaiQueue(metadata=ObjectMeta(name="k"), spec={"reclaimMinRuntime": "soon"}))
    assert bad.reclaim_min_runtime_s is None
