"""``gpufrac validate FILE...``: the webhook's verdict on manifests, before they reach a cluster.

Reads YAML (multi-document) or JSON files, finds every pod in them (Pods, the pod templates of
Deployments, StatefulSets, DaemonSets, ReplicaSets, ReplicationControllers, Jobs, CronJobs and
PodTemplates, and the items of List kinds), and prints each pod's normalized GPU request or every
violation. Exit status 1 when anything is invalid or unreadable, so it fits in CI. The rules are the
contract's own (``parse_pod_manifest`` with ``user_written=True``), after the webhook's own shape check
(``review.check_object``): what passes here passes the webhook, and a malformed pod is reported, not a
traceback. A key one slip away from a contract key (``gpu-fractions``) is a warning, as the webhook's
(``contract.near_miss``): it does not change the exit status.

As ``kubectl apply -f``: ``-`` reads standard input, a directory means its ``.yaml``, ``.yml`` and
``.json`` files (``--recursive`` / ``-R``: its subdirectories' too), in name order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from gpufrac.admission.review import MalformedReview, check_object
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.near_miss import near_miss_warnings
from gpufrac.contract.parse import parse_pod_manifest
from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, PodGpuRequest

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController", "Job"}


@dataclass(frozen=True, slots=True)
class FoundPod:
    """A pod found in a manifest: where it came from and the pod (or pod template) itself."""

    source: str
    kind: str
    name: str
    pod: Mapping[str, Any]


def find_pods(document: Any, *, source: str) -> Iterator[FoundPod]:
    """Every pod or pod template in one parsed document (recursing into List items)."""
    if not isinstance(document, Mapping):
        return
    kind = str(document.get("kind", ""))
    name = str((document.get("metadata") or {}).get("name", "")) or "<unnamed>"
    spec = document.get("spec") or {}
    if isinstance(document.get("items"), list) and kind.endswith("List"):
        for item in document["items"]:
            yield from find_pods(item, source=source)
    elif kind == "Pod":
        yield FoundPod(source, kind, name, document)
    elif kind in _TEMPLATE_KINDS and isinstance(spec, Mapping):
        yield FoundPod(source, kind, name, spec.get("template") or {})
    elif kind == "CronJob" and isinstance(spec, Mapping):
        job_spec = (spec.get("jobTemplate") or {}).get("spec") or {}
        yield FoundPod(source, kind, name, job_spec.get("template") or {})
    elif kind == "PodTemplate":
        yield FoundPod(source, kind, name, document.get("template") or {})


def _memory(memory: GpuMemory) -> str:
    return f"{memory.mib} MiB" if memory.mib is not None else f"{memory.portion:g} of the GPU's memory"


def describe_container(container: ContainerGpuRequest) -> str:
    """One line a person reads: what the container is guaranteed, on how many GPUs, how shared."""
    if container.exclusive:
        plural = "s" if container.device_count > 1 else ""
        return f"{container.container}: {container.device_count} whole GPU{plural}, exclusive"
    assert container.request is not None
    text = f"{container.container}: {_memory(container.request)} guaranteed"
    if container.limit is not None and container.limit != container.request:
        text += f", up to {_memory(container.limit)}"
    if container.device_count > 1:
        text += f", on each of {container.device_count} GPUs"
    return f"{text}, {container.mode.value}"


def _as_json(request: PodGpuRequest) -> list[dict[str, Any]]:
    def memory(m: GpuMemory | None) -> dict[str, Any] | None:
        return None if m is None else ({"mib": m.mib} if m.mib is not None else {"portion": m.portion})

    return [
        {
            "container": c.container,
            "request": memory(c.request),
            "limit": memory(c.limit),
            "mode": c.mode.value,
            "deviceCount": c.device_count,
            "exclusive": c.exclusive,
        }
        for c in request.containers
    ]


def manifest_files(path: Path, *, recursive: bool) -> list[Path]:
    """The files ``path`` names: itself, or a directory's manifests (``recursive``: and its subfolders')."""
    if not path.is_dir():
        return [path]
    found = path.rglob("*") if recursive else path.iterdir()
    return sorted(p for p in found if p.is_file() and p.suffix in MANIFEST_SUFFIXES)


def _read(source: str) -> str:
    return sys.stdin.read() if source == "-" else Path(source).read_text()


def validate(
    files: Annotated[
        list[str],
        typer.Argument(help="YAML or JSON manifests to check: files, directories, or - for standard input."),
    ],
    output: Annotated[str, typer.Option("--output", "-o", help="text or json.")] = "text",
    recursive: Annotated[
        bool, typer.Option("--recursive", "-R", help="Also read the subdirectories of directories given.")
    ] = False,
) -> None:
    """Check pod manifests against the GPU annotation contract; exit 1 on any error."""
    results: list[dict[str, Any]] = []
    failed = False
    sources = [
        str(p)
        for source in files
        for p in ([source] if source == "-" else manifest_files(Path(source), recursive=recursive))
    ]
    if not sources:
        typer.echo(f"no manifests ({', '.join(MANIFEST_SUFFIXES)}) in {', '.join(files)}", err=True)
        raise typer.Exit(code=1)
    for source in sources:
        shown = "<stdin>" if source == "-" else source
        try:
            documents = list(yaml.safe_load_all(_read(source)))
        except (OSError, yaml.YAMLError) as error:
            failed = True
            results.append({"file": shown, "errors": [f"cannot read {shown}: {error}"]})
            continue
        for document in documents:
            for found in find_pods(document, source=shown):
                entry: dict[str, Any] = {"file": found.source, "kind": found.kind, "name": found.name}
                try:
                    check_object(found.pod)
                    request = parse_pod_manifest(found.pod, user_written=True)
                except MalformedReview as malformed:
                    failed = True
                    entry["errors"] = [f"the pod is malformed: {malformed}"]
                except InvalidPodRequest as invalid:
                    failed = True
                    entry["errors"] = invalid.messages
                else:
                    entry["request"] = request
                annotations = (found.pod.get("metadata") or {}).get("annotations") or {}
                warnings = near_miss_warnings(annotations) if isinstance(annotations, Mapping) else []
                if warnings:
                    entry["warnings"] = warnings
                results.append(entry)

    if output == "json":
        for entry in results:
            if "request" in entry:
                entry["containers"] = _as_json(entry.pop("request"))
        typer.echo(json.dumps(results, indent=2))
    else:
        for entry in results:
            where = f"{entry['file']}: {entry['kind']} {entry['name']}" if "kind" in entry else entry["file"]
            if "errors" in entry:
                typer.echo(f"{where}: invalid")
                for message in entry["errors"]:
                    typer.echo(f"  - {message}")
            elif not entry["request"].wants_gpu:
                typer.echo(f"{where}: ok, no GPU request")
            else:
                typer.echo(f"{where}: ok")
                for container in entry["request"].containers:
                    typer.echo(f"  {describe_container(container)}")
            for warning in entry.get("warnings", ()):
                typer.echo(f"  warning: {warning}")
    if failed:
        raise typer.Exit(code=1)
