"""``kubectl gpufrac resize POD``: write a resize request and say what the scheduler made of it.

The command writes the container's resize keys (``gpufrac.io/container.<c>.resize.*``; the other form's
keys of an earlier request are removed in the same merge patch, so the two never conflict) and, with
``--wait`` (the default), watches the pod until the scheduler answered: the request gone and the binding
showing the new amounts (done), or the ``gpufrac.io/GpuResizePending`` condition written for this request
(``Deferred``: it stays and is resized when room frees; ``Infeasible``: refused). What is read and how it
is told are pure functions here; the command in ``gpufrac.kubectl.command`` does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError
from gpufrac.contract.render import read_binding
from gpufrac.contract.resize import resize_keys


def request_annotations(
    container: str,
    *,
    memory_request: str | None = None,
    memory_limit: str | None = None,
    fraction: str | None = None,
    fraction_limit: str | None = None,
    compute: str | None = None,
) -> dict[str, str | None]:
    """The merge patch of one resize request: the given keys set, every other resize key of the container
    removed. ``compute`` (an sm-sharing container's compute share) goes alone or with either memory form.
    Raises ``ValueError`` when the flags mix memory forms or give none."""
    memory = {keys.RESIZE_MEMORY_REQUEST: memory_request, keys.RESIZE_MEMORY_LIMIT: memory_limit}
    portion = {keys.RESIZE_FRACTION: fraction, keys.RESIZE_FRACTION_LIMIT: fraction_limit}
    given_memory = any(v is not None for v in memory.values())
    given_portion = any(v is not None for v in portion.values())
    if given_memory and given_portion:
        raise ValueError("give --memory-request/--memory-limit or --fraction/--fraction-limit, not both")
    if not (given_memory or given_portion or compute is not None):
        raise ValueError("give --memory-request, --memory-limit, --fraction or --compute")
    asked = {**memory, **portion, keys.RESIZE_COMPUTE_REQUEST: compute}
    return {keys.resize_key(container, suffix): value for suffix, value in asked.items()}


def fractional_containers(pod: Pod) -> list[str]:
    """The containers of a bound pod whose binding holds a GPU fraction (what can be resized)."""
    try:
        bound = read_binding(pod.metadata.annotations or {})
    except ContractError:
        return []
    return [c.container for c in bound if not c.exclusive]


def pending_condition(pod: Pod) -> tuple[str, str] | None:
    """(reason, message) of the pod's ``GpuResizePending`` condition, when it is True."""
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == keys.POD_RESIZE_PENDING_CONDITION and c.status == "True":
            return c.reason or "", c.message or ""
    return None


@dataclass(frozen=True, slots=True)
class Answer:
    """What the scheduler made of a request: ``state`` ``Resized``, ``Deferred`` or ``Infeasible``."""

    state: str
    message: str

    @property
    def exit_code(self) -> int:
        return 1 if self.state == keys.POD_REASON_RESIZE_INFEASIBLE else 0


def answer(pod: Pod, container: str, *, before: tuple[str, str] | None) -> Answer | None:
    """The scheduler's answer as the pod shows it, or None while it has not answered. ``before`` is the
    pending condition as it was before the request was written (a condition still saying that is an
    earlier request's)."""
    annotations: Mapping[str, str] = pod.metadata.annotations or {}
    mine = [k for k in resize_keys(annotations) if k.startswith(keys.resize_key(container, ""))]
    if not mine:
        request = annotations.get(keys.memory_request_key(container), "?")
        limit = annotations.get(keys.memory_limit_key(container), request)
        message = f"container {container}: request {request}, limit {limit}"
        portion = annotations.get(keys.compute_portion_key(container))
        return Answer("Resized", message + (f", compute portion {portion}" if portion else ""))
    pending = pending_condition(pod)
    if pending is not None and pending != before:
        return Answer(pending[0], pending[1])
    return None
