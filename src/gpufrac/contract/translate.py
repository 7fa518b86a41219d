"""Rewrite a valid pod into the per-container form: what the mutating webhook stores.

Two rewrites, both meaning-preserving (the parsed request is the same before and after, a tested
property):

* legacy ``gpu-memory`` (MiB, on the target container) and its ``gpu-memory.limit`` become
  ``nvidia.com/container.<c>.gpu-memory.request|limit``, and the pod-level keys go away. ``gpu-fraction``
  stays as it is: a portion has no per-container key before placement; the binder writes the resolved MiB.
* whole GPUs (``nvidia.com/gpu: N`` on a container) become ``gpufrac.io/container.<c>.gpus: "N"``, and
  the resource is removed, so that the kubelet's device plugin does not also hand out a GPU on a managed
  node. Only for pods of our scheduler: the caller decides. MIG slices likewise: ``nvidia.com/mig-<p>: N``
  becomes ``gpufrac.io/container.<c>.mig.profile: "<p>"`` (and ``.mig.count: "N"`` when N > 1), and the
  resource is removed.

The first rewrite can be switched off (``legacy=False``): where KAI Scheduler schedules, ``gpu-memory``
also drives KAI's own sharing modes, which read it as written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpufrac.contract import keys as k
from gpufrac.contract.parse import ContainerSpec, parse_pod, pod_level_target
from gpufrac.contract.quantities import format_mib
from gpufrac.contract.request import PodGpuRequest


@dataclass(frozen=True, slots=True)
class Translation:
    """Annotation changes (value None = remove the key), containers to strip ``nvidia.com/gpu`` from and
    containers to strip every ``nvidia.com/mig-*`` resource from."""

    annotations: dict[str, str | None] = field(default_factory=dict)
    strip_gpu_resource: tuple[str, ...] = ()
    strip_mig_resource: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.annotations and not self.strip_gpu_resource and not self.strip_mig_resource


def translate(
    annotations: Mapping[str, str],
    containers: Sequence[ContainerSpec],
    *,
    whole_gpus: bool,
    legacy: bool = True,
    parsed: PodGpuRequest | None = None,
) -> Translation:
    """The rewrite of a pod; raises ``InvalidPodRequest`` for an invalid one (nothing to translate).

    ``whole_gpus`` turns ``nvidia.com/gpu`` into the exclusive per-container key, and
    ``nvidia.com/mig-<profile>`` into the MIG keys (pods of our scheduler);
    ``legacy`` turns ``gpu-memory`` into per-container keys. ``parsed`` is ``parse_pod(annotations,
    containers)`` where the caller has it already (the webhook parses a pod once).
    """
    request = parsed if parsed is not None else parse_pod(annotations, containers)
    changes: dict[str, str | None] = {}
    strip: list[str] = []
    strip_mig: list[str] = []

    if legacy and k.GPU_MEMORY in annotations:
        name = pod_level_target(annotations, [c.name for c in containers])
        target = request.container(name) if name is not None else None
        if target is not None and not _has_explicit(annotations, target.container):
            assert target.request is not None and target.request.mib is not None
            changes[k.memory_request_key(target.container)] = format_mib(target.request.mib)
            if (
                k.GPU_MEMORY_LIMIT in annotations
                and target.limit is not None
                and target.limit.mib is not None
            ):
                changes[k.memory_limit_key(target.container)] = format_mib(target.limit.mib)
        for key in (k.GPU_MEMORY, k.GPU_MEMORY_LIMIT):
            if key in annotations:
                changes[key] = None
        if k.GPU_FRACTION_CONTAINER_NAME in annotations and k.GPU_FRACTION not in annotations:
            changes[k.GPU_FRACTION_CONTAINER_NAME] = None

    if whole_gpus:
        for spec in containers:
            if spec.gpus <= 0:
                continue
            key = k.whole_gpus_key(spec.name)
            if key not in annotations:
                changes[key] = str(spec.gpus)
            strip.append(spec.name)
        for spec in containers:
            wanted = request.container(spec.name)
            if not spec.mig or wanted is None or wanted.mig is None:
                continue
            profile, count = spec.mig[0]  # parsing accepts one MIG resource per container
            if k.mig_key(spec.name, k.MIG_PROFILE) not in annotations:
                changes[k.mig_key(spec.name, k.MIG_PROFILE)] = profile
            if count > 1 and k.mig_key(spec.name, k.MIG_COUNT) not in annotations:
                changes[k.mig_key(spec.name, k.MIG_COUNT)] = str(count)
            strip_mig.append(spec.name)

    return Translation(
        annotations=changes, strip_gpu_resource=tuple(strip), strip_mig_resource=tuple(strip_mig)
    )


def _has_explicit(annotations: Mapping[str, str], container: str) -> bool:
    return k.memory_request_key(container) in annotations or k.memory_limit_key(container) in annotations


def apply_translation(
    annotations: Mapping[str, str], containers: Sequence[ContainerSpec], translation: Translation
) -> tuple[dict[str, str], list[ContainerSpec]]:
    """The annotations and containers after ``translation`` (what the API server will store)."""
    result = {
        key: value for key, value in annotations.items() if translation.annotations.get(key, "") is not None
    }
    result.update({key: value for key, value in translation.annotations.items() if value is not None})
    stripped, stripped_mig = set(translation.strip_gpu_resource), set(translation.strip_mig_resource)
    specs = [
        ContainerSpec(
            name=c.name,
            gpus=0 if c.name in stripped else c.gpus,
            mig=() if c.name in stripped_mig else c.mig,
        )
        for c in containers
    ]
    return result, specs
