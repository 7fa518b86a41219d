"""The soak's judges on hand-made inputs: they must be able to say "failed", or the soak proves nothing.

No cluster: exits, pods and RSS samples are built here, so each check is fed the case it must catch.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from lightkube.models.core_v1 import Container, PodCondition, PodSpec, PodStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.local.soak import Outcome, RssSeries, judge_exits, outcome
from gpufrac.local.supervisor import Component, Exit


def _component(name: str, codes: list[int]) -> Component:
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    exits = [Exit(code=c, ran_s=10.0, restart_in_s=1.0, crash_loop=False) for c in codes]
    return Component(
        name=name, argv=[], log=Path("/dev/null"), env={}, popen=popen, started_at=0.0, exits=exits
    )


def test_only_the_injected_kills_are_expected_exits() -> None:
    kill = -signal.SIGKILL
    components = {
        "scheduler": _component("scheduler", [1, kill]),  # crashed on its own, then killed once
        "admission": _component("admission", [kill, kill]),  # killed once, died a second time
        "node-agent-a": _component("node-agent-a", []),  # killed but never exited
        "node-agent-b": _component("node-agent-b", [kill]),
    }
    unexpected, missing = judge_exits(
        components, {"scheduler": 1, "admission": 1, "node-agent-a": 1, "node-agent-b": 1}
    )
    assert unexpected == {"scheduler": ["exited with code 1"], "admission": ["killed by SIGKILL"]}
    assert missing == ["node-agent-a was killed 1 times but exited only 0 times"]
    assert judge_exits({"node-agent-b": components["node-agent-b"]}, {"node-agent-b": 1}) == ({}, [])


def _pod(*, node: str | None = None, conditions: list[PodCondition] | None = None) -> Pod:
    return Pod(
        metadata=ObjectMeta(name="p", namespace="soak"),
        spec=PodSpec(containers=[Container(name="app")], nodeName=node),
        status=PodStatus(conditions=conditions),
    )


def test_a_pod_is_placed_explained_or_undecided() -> None:
    assert outcome(_pod(node="gpu-node-000")) is Outcome.PLACED
    unschedulable = PodCondition(type="PodScheduled", status="False", reason="Unschedulable", message="0/2")
    assert outcome(_pod(conditions=[unschedulable])) is Outcome.EXPLAINED
    assert outcome(_pod()) is Outcome.UNDECIDED
    # A False condition that says nothing explains nothing.
    silent = PodCondition(type="PodScheduled", status="False")
    assert outcome(_pod(conditions=[silent])) is Outcome.UNDECIDED
    other = PodCondition(type="Ready", status="False", reason="ContainersNotReady")
    assert outcome(_pod(conditions=[other])) is Outcome.UNDECIDED


def _life(series: RssSeries, *, pid: int, start: float, base_kib: int) -> None:
    """A start-up jump in the first minute, then 1 MiB more every minute for half an hour."""
    series.add(pid=pid, at=start, kib=0)
    for i in range(1, 31):
        series.add(pid=pid, at=start + 60.0 * i, kib=base_kib + (i - 1) * 1024)


def test_rss_growth_is_the_slope_after_the_warm_up_pooled_over_restarts() -> None:
    series = RssSeries()
    _life(series, pid=1, start=0.0, base_kib=100 * 1024)
    growth = series.growth_mib_per_hour(skip_s=60)
    assert growth is not None and abs(growth - 60.0) < 1e-6
    # A restart starts lower (a new process): the drop is not negative growth, the slopes pool.
    _life(series, pid=2, start=2000.0, base_kib=50 * 1024)
    assert len(series.lives) == 2 and series.last_kib == 50 * 1024 + 29 * 1024
    growth = series.growth_mib_per_hour(skip_s=60)
    assert growth is not None and abs(growth - 60.0) < 1e-6
    flat = RssSeries()
    for i in range(20):
        flat.add(pid=7, at=10.0 * i, kib=5000)
    assert flat.growth_mib_per_hour(skip_s=0) == 0.0
    short = RssSeries()
    short.add(pid=1, at=0.0, kib=1)
    short.add(pid=1, at=1.0, kib=2)
    assert short.growth_mib_per_hour(skip_s=0) is None
