"""The chart's side of queues bound to namespaces (issue 34, docs/queues.md): with admission.queueBindings
the webhook runs with --queue-bindings and the scheduler's default queue, and its ServiceAccount gets a
token and read-only rights on exactly Namespaces and Queues; without it, no token and no rights."""

from __future__ import annotations

from pathlib import Path

import typer
from helm_chart import kinds, one, render

from gpufrac.admission.command import admission


def _admission_pod(objects: list[dict]) -> dict:
    return one(objects, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"]


def _flags() -> set[str]:
    """Every long option ``gpufrac admission`` accepts."""
    cli = typer.Typer()
    cli.command()(admission)
    command = typer.main.get_command(cli)
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts) if name.startswith("--")}


def test_with_queue_bindings_the_webhook_reads_only_namespaces_and_queues(tmp_path: Path) -> None:
    objects = render({"scheduler": {"config": {"default_queue": "shared"}}}, tmp_path=tmp_path)
    pod = _admission_pod(objects)
    args = pod["containers"][0]["args"]
    assert "--queue-bindings" in args and "--default-queue=shared" in args
    assert {a.split("=")[0] for a in args if a.startswith("--")} <= _flags()
    assert pod["automountServiceAccountToken"] is True
    role = one(objects, "ClusterRole", "gpufrac-gpufrac-admission")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["gpufrac.io"], "resources": ["queues"], "verbs": ["list", "watch"]},
    ]
    binding = one(objects, "ClusterRoleBinding", "gpufrac-gpufrac-admission")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpufrac-admission", "namespace": "gpufrac-system"}
    ]


def test_without_queue_bindings_the_webhook_has_no_token_and_no_rights(tmp_path: Path) -> None:
    objects = render({"admission": {"queueBindings": False}}, tmp_path=tmp_path)
    pod = _admission_pod(objects)
    assert "--queue-bindings" not in pod["containers"][0]["args"]
    assert pod["automountServiceAccountToken"] is False
    assert one(objects, "ServiceAccount", "gpufrac-admission")["automountServiceAccountToken"] is False
    assert not {
        ("ClusterRole", "gpufrac-gpufrac-admission"),
        ("ClusterRoleBinding", "gpufrac-gpufrac-admission"),
    } & kinds(objects)
