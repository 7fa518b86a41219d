"""The chart's "KAI schedules" mode (`kai.enabled`): KAI Scheduler places and binds the GPU pods, gpufrac is
the node side and the webhook. Rendered with `helm template`, checked object by object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helm_chart import kinds, one, render

from gpufrac.operator.render import agent_args
from gpufrac.operator.resource import GpuFractioningConfig, read_config

KAI_BINDER = "system:serviceaccount:kai-scheduler:binder"


def admission_args(objects: list[dict[str, Any]]) -> list[str]:
    deployment = one(objects, "Deployment", "gpufrac-admission")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def scheduler_users(objects: list[dict[str, Any]]) -> list[str]:
    return [
        a.removeprefix("--scheduler-user=")
        for a in admission_args(objects)
        if a.startswith("--scheduler-user=")
    ]


def node_agent_args(objects: list[dict[str, Any]]) -> list[str]:
    """The node agent's arguments as the operator renders them from the chart's GpuFractioningConfig."""
    config = one(objects, "GpuFractioningConfig")
    return agent_args(read_config(GpuFractioningConfig(metadata=config["metadata"], spec=config["spec"])))


def test_kai_mode_runs_no_gpufrac_scheduler(tmp_path: Path) -> None:
    objects = render({"kai": {"enabled": True}}, tmp_path=tmp_path)
    names = {name for _, name in kinds(objects)}
    assert not any("gpufrac-scheduler" in name for name in names), sorted(names)
    assert ("Deployment", "gpufrac-admission") in kinds(objects)
    assert ("Deployment", "gpufrac-operator") in kinds(objects)


def test_kai_mode_trusts_kais_binder_and_leaves_legacy_forms_alone(tmp_path: Path) -> None:
    objects = render(
        {"kai": {"enabled": True}, "admission": {"extraSchedulerUsers": ["ops"]}}, tmp_path=tmp_path
    )
    assert scheduler_users(objects) == [KAI_BINDER, "ops"]
    assert "--no-translate-legacy" in admission_args(objects)


def test_kais_binder_user_is_configurable(tmp_path: Path) -> None:
    user = "system:serviceaccount:kai:kai-binder"
    objects = render({"kai": {"enabled": True, "binderUser": user}}, tmp_path=tmp_path)
    assert scheduler_users(objects) == [user]


def test_kai_mode_leaves_gpu_nodes_untainted(tmp_path: Path) -> None:
    objects = render({"kai": {"enabled": True}}, tmp_path=tmp_path)
    assert one(objects, "GpuFractioningConfig")["spec"]["nodeAgent"]["taint"] is False
    assert "--no-taint" in node_agent_args(objects)


def test_the_default_is_gpufrac_scheduling(tmp_path: Path) -> None:
    objects = render(tmp_path=tmp_path)
    assert ("Deployment", "gpufrac-scheduler") in kinds(objects)
    assert scheduler_users(objects) == ["system:serviceaccount:gpufrac-system:gpufrac-scheduler"]
    assert "--no-translate-legacy" not in admission_args(objects)
    assert "taint" not in one(objects, "GpuFractioningConfig")["spec"]["nodeAgent"]
    assert "--no-taint" not in node_agent_args(objects)
