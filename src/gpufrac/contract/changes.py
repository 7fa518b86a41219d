"""Which changes to a pod's GPU annotations someone other than the scheduler may make: resize requests.

Pod resources are immutable once a pod exists; annotations are not, so without this rule an annotation
edit would be a back door that changes what a running pod is entitled to, or forges a device assignment.
The binder-owned keys (devices, compute portion) are the scheduler's alone, at creation too; every other
contract key is fixed once the pod exists, with one exception: on a pod already placed (``bound``), the
resize request keys ``gpufrac.io/container.<c>.resize.*`` may be added, changed or removed. They are a
request the scheduler decides on (``gpufrac.contract.resize``); the resolved ``nvidia.com/`` memory keys
the node reads stay the scheduler's to rewrite. Who counts as the scheduler is the webhook's
configuration, not the contract's.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpufrac.contract import keys as k
from gpufrac.contract.errors import BinderOwnedKey, ImmutableRequest, ResizeNotAllowed, RuleViolation


def changed_contract_keys(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """Contract keys that were added, removed or changed from ``old`` to ``new``, sorted."""
    touched = {key for key in set(old) | set(new) if k.is_contract_key(key)}
    return sorted(key for key in touched if old.get(key) != new.get(key))


def _immutable_detail(key: str, removed: bool) -> str:
    """What to add to a refused change of a placed pod: what can never change, and how to resize."""
    split = k.split_container_key(key)
    done = "it was removed; " if removed else ""
    if split is not None and split.suffix in (k.MEMORY_REQUEST, k.MEMORY_LIMIT, k.PORTION_LIMIT):
        return (
            f"{done}to resize, set {k.resize_key(split.container, k.RESIZE_MEMORY_REQUEST)}"
            f" (or .{k.RESIZE_MEMORY_LIMIT}, .{k.RESIZE_FRACTION}) and the scheduler decides"
        )
    if split is not None and split.suffix == k.COMPUTE_REQUEST:
        key_to_set = k.resize_key(split.container, k.RESIZE_COMPUTE_REQUEST)
        return f"{done}to resize an sm-sharing compute share, set {key_to_set} and the scheduler decides"
    if key in (k.GPU_FRACTION, k.GPU_FRACTION_LIMIT, k.GPU_MEMORY, k.GPU_MEMORY_LIMIT):
        return f"{done}to resize, set gpufrac.io/container.<c>.{k.RESIZE_FRACTION} and the scheduler decides"
    return f"{done}the device list, compute mode and device count of a placed pod never change"


def forbidden_changes(
    old: Mapping[str, str], new: Mapping[str, str], *, creating: bool, bound: bool = False
) -> list[RuleViolation]:
    """The violations in a change made by anyone but the scheduler (``old`` is empty when ``creating``).

    Creating a pod may set any contract key except the binder-owned ones and the resize keys (there is
    nothing placed to resize yet); an update may change none, except the resize keys of a ``bound`` pod.
    """
    violations: list[RuleViolation] = []
    for key in changed_contract_keys(old, new):
        shown = new.get(key, "")
        detail = "" if key in new else "it was removed"
        if k.is_binder_owned(key):
            violations.append(BinderOwnedKey(key=key, value=shown, detail=detail))
        elif k.is_resize_key(key):
            if bound or (not creating and key not in new):
                continue  # a placed pod's resize request; removing one is always allowed
            violations.append(
                ResizeNotAllowed(
                    key=key, value=shown, detail="the pod is not placed yet; set it once it runs"
                )
            )
        elif not creating:
            violations.append(
                ImmutableRequest(key=key, value=shown, detail=_immutable_detail(key, key not in new))
                if bound
                else ImmutableRequest(key=key, value=shown, detail=detail)
            )
    return violations
