"""Whether the keys a binder writes for a request can be written at all: the API server's annotation-key
rule applied to the binder-owned keys.

A Binding's annotations are merged into the pod without the API server's key validation, and a pod that
holds an invalid key fails every later update (finalizer removal included). So the parser refuses such a
request up front and ``render_binding`` never returns such a key; both ask this module, which sits below
them (``parse`` and ``render`` import each other's value grammar, so the rule cannot live in either).
"""

from __future__ import annotations

from gpufrac.contract import keys as k
from gpufrac.contract.errors import RuleViolation, UnwritableKey
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, PodGpuRequest


def binder_keys(container: ContainerGpuRequest) -> tuple[str, ...]:
    """The keys ``render_binding`` writes for ``container``: devices (alone for MIG slices); the whole-GPU
    marker when exclusive, else request and limit; the compute portion for sm-sharing."""
    name = container.container
    written = [k.devices_key(name)]
    if container.mig is not None:
        return tuple(written)
    if container.exclusive:
        written.append(k.whole_gpus_key(name))
    else:
        written += [k.memory_request_key(name), k.memory_limit_key(name)]
    if container.mode is ComputeMode.SM_SHARING:
        written.append(k.compute_portion_key(name))
    return tuple(written)


def unwritable_key(container: str, key: str, problem: str) -> UnwritableKey:
    detail = f"the scheduler must write {key}, and {problem}"
    name_part = key.split("/", 1)[-1]
    most = k.QUALIFIED_NAME_MAX_CHARS - (len(name_part) - len(container))
    if len(name_part) > k.QUALIFIED_NAME_MAX_CHARS and most > 0:
        detail += f"; this GPU request allows container names of at most {most} characters"
    return UnwritableKey(key=f"spec.containers[{container}].name", value=container, detail=detail)


def unwritable_keys(request: PodGpuRequest) -> list[RuleViolation]:
    """One ``UnwritableKey`` per container of ``request`` whose binder keys the API server would refuse
    (the first such key of each container)."""
    found: list[RuleViolation] = []
    for container in request.containers:
        for key in binder_keys(container):
            problem = k.annotation_key_problem(key)
            if problem is not None:
                found.append(unwritable_key(container.container, key, problem))
                break
    return found
