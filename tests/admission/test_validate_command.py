"""``gpufrac validate``: what a user sees for their manifests, and the exit status CI relies on."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from gpufrac.admission.validate_command import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

app = typer.Typer()
app.command()(validate)
runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_the_reference_examples_are_valid() -> None:
    code, output = run(
        str(EXAMPLES / "inference-sm-sharing.yaml"), str(EXAMPLES / "notebook-time-slicing.yaml")
    )
    assert code == 0
    assert (
        "Pod inference: ok\n  app: 40960 MiB guaranteed, up to 61440 MiB, on each of 4 GPUs, sm-sharing"
        in output
    )
    assert (
        "Pod notebook: ok\n  app: 0.5 of the GPU's memory guaranteed, up to 0.8 of the GPU's memory" in output
    )


WORKLOADS = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    metadata:
      annotations: {gpu-fraction: "0.25"}
    spec:
      containers: [{name: server, image: x}]
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly}
spec:
  jobTemplate:
    spec:
      template:
        metadata:
          annotations:
            nvidia.com/container.train.gpu-memory.request: "40GB"
        spec:
          containers: [{name: trainer, image: x}]
---
apiVersion: v1
kind: Service
metadata: {name: not-a-pod}
---
apiVersion: v1
kind: List
items:
- apiVersion: apps/v1
  kind: StatefulSet
  metadata: {name: db}
  spec:
    template:
      spec:
        containers: [{name: db, image: x, resources: {limits: {nvidia.com/gpu: 1}}}]
- apiVersion: batch/v1
  kind: Job
  metadata: {name: plain}
  spec:
    template:
      spec:
        containers: [{name: c, image: x}]
"""


def test_workloads_multi_document_and_lists(tmp_path: Path) -> None:
    manifest = tmp_path / "workloads.yaml"
    manifest.write_text(WORKLOADS)
    code, output = run(str(manifest))
    assert code == 1
    lines = output.splitlines()
    assert lines[0] == f"{manifest}: Deployment web: ok"
    assert lines[1] == "  server: 0.25 of the GPU's memory guaranteed, time-slicing"
    assert lines[2] == f"{manifest}: CronJob nightly: invalid"
    assert lines[3] == (
        '  - nvidia.com/container.train.gpu-memory.request="40GB" is invalid: the pod has no container of '
        "that name (names match exactly; the pod's containers are trainer)."
    )
    assert lines[4:] == [
        f"{manifest}: StatefulSet db: ok",
        "  db: 1 whole GPU, exclusive",
        f"{manifest}: Job plain: ok, no GPU request",
    ]


def test_json_input_and_output(tmp_path: Path) -> None:
    manifest = tmp_path / "pod.json"
    manifest.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "p",
                    "annotations": {"gpu-memory": "2048", "gpu-fraction-num-devices": "2"},
                },
                "spec": {"containers": [{"name": "app"}]},
            }
        )
    )
    code, output = run("-o", "json", str(manifest))
    assert code == 0
    assert json.loads(output) == [
        {
            "file": str(manifest),
            "kind": "Pod",
            "name": "p",
            "containers": [
                {
                    "container": "app",
                    "request": {"mib": 2048},
                    "limit": {"mib": 2048},
                    "mode": "time-slicing",
                    "deviceCount": 2,
                    "exclusive": False,
                }
            ],
        }
    ]


def test_manifests_may_not_carry_binder_owned_keys(tmp_path: Path) -> None:
    manifest = tmp_path / "forged.yaml"
    manifest.write_text(
        """
kind: Pod
metadata:
  name: forged
  annotations:
    gpu-fraction: "0.5"
    nvidia.com/container.app.gpus.devices: GPU-1
spec: {containers: [{name: app}]}
"""
    )
    code, output = run(str(manifest))
    assert code == 1
    assert "only the scheduler may set or change this key" in output


def test_unreadable_files_fail(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Pod\nmetadata: [unclosed\n")
    code, output = run(str(broken), str(tmp_path / "missing.yaml"))
    assert code == 1
    assert f"cannot read {broken}" in output
    assert f"cannot read {tmp_path / 'missing.yaml'}" in output


def test_a_huge_quantity_and_a_long_container_name_are_reported_not_crashed_on(tmp_path: Path) -> None:
    name = "tokenizer-and-embedding-server-east"
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(
        f"""
apiVersion: v1
kind: Pod
metadata:
  name: huge
  annotations: {{nvidia.com/container.app.gpu-memory.request: "{"9" * 5000}Mi"}}
spec:
  containers: [{{name: app, image: x}}]
---
apiVersion: v1
kind: Pod
metadata:
  name: long
  annotations: {{gpu-fraction: "0.5"}}
spec:
  containers: [{{name: {name}, image: x}}]
"""
    )
    result = runner.invoke(app, [str(manifest)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    assert (
        f'Pod huge: invalid\n  - nvidia.com/container.app.gpu-memory.request="{"9" * 80}..." is invalid: '
        in (result.output)
    )
    assert "a quantity must be at most 64 characters long (it has 5002)" in result.output
    assert f"Pod long: invalid\n  - spec.containers[{name}].name=" in result.output
    assert f"nvidia.com/container.{name}.gpu-memory.request" in result.output
    assert "at most 34 characters" in result.output


def test_a_pod_of_the_wrong_shape_is_reported_not_crashed_on(tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: odd, annotations: {gpu-fraction: '0.5'}}\n"
        "spec: {containers: app}\n"
    )
    result = runner.invoke(app, [str(manifest)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    assert (
        "Pod odd: invalid\n  - the pod is malformed: spec.containers must be an array, got 'app'"
        in result.output
    )


TYPO_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: typo
  annotations: {gpu-fractions: "0.5", gpu-fraction-num-device: "2"}
spec:
  containers: [{name: app, image: x}]
"""


def test_a_misspelled_key_is_a_warning_that_names_the_key_meant(tmp_path: Path) -> None:
    """Before, a pod with ``gpu-fractions`` was "ok, no GPU request" and ran without a GPU, silently."""
    manifest = tmp_path / "typo.yaml"
    manifest.write_text(TYPO_POD)
    code, output = run(str(manifest))
    assert code == 0  # a warning, as the webhook's: someone else's annotation must not fail CI
    assert "Pod typo: ok, no GPU request" in output
    assert 'warning: annotation "gpu-fraction-num-device" is not a key gpufrac reads' in output
    assert 'did you mean "gpu-fraction-num-devices"?' in output
    assert 'did you mean "gpu-fraction"?' in output
    code, output = run("-o", "json", str(manifest))
    (entry,) = json.loads(output)
    assert len(entry["warnings"]) == 2


def test_standard_input_and_directories_are_read_as_kubectl_apply_reads_them(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(TYPO_POD)
    (tmp_path / "notes.txt").write_text("not a manifest: {")
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "b.yml").write_text(TYPO_POD.replace("name: typo", "name: deeper"))

    code, output = run(str(tmp_path))
    assert code == 0
    assert f"{tmp_path / 'a.yaml'}: Pod typo" in output and "deeper" not in output and "notes" not in output
    code, output = run("--recursive", str(tmp_path))
    assert "Pod typo" in output and f"{nested / 'b.yml'}: Pod deeper" in output

    result = runner.invoke(app, ["-"], input=TYPO_POD.replace('gpu-fractions: "0.5"', 'gpu-fraction: "1.5"'))
    assert result.exit_code == 1
    assert "<stdin>: Pod typo: invalid" in result.output
    result = runner.invoke(app, ["-"], input=EXAMPLES.joinpath("notebook-time-slicing.yaml").read_text())
    assert result.exit_code == 0 and "<stdin>: Pod notebook: ok" in result.output


def test_a_directory_without_manifests_is_an_error(tmp_path: Path) -> None:
    code, output = run(str(tmp_path))
    assert code == 1 and "no manifests" in output
