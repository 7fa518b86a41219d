"""Which changes to a pod's GPU annotations someone other than the scheduler may make: none.

Pod resources are immutable once a pod exists; annotations are not, so without this rule an annotation
edit would be a back door that changes what a running pod is entitled to, or forges a device assignment.
The binder-owned keys (devices, compute portion) are the scheduler's alone, at creation too; every other
contract key is fixed once the pod exists. Who counts as the scheduler is the webhook's configuration,
not the contract's.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpufrac.contract import keys as k
from gpufrac.contract.errors import BinderOwnedKey, ImmutableRequest, RuleViolation


def changed_contract_keys(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """Contract keys that were added, removed or changed from ``old`` to ``new``, sorted."""
    touched = {key for key in set(old) | set(new) if k.is_contract_key(key)}
    return sorted(key for key in touched if old.get(key) != new.get(key))


def forbidden_changes(
    old: Mapping[str, str], new: Mapping[str, str], *, creating: bool
) -> list[RuleViolation]:
    """The violations in a change made by anyone but the scheduler (``old`` is empty when ``creating``).

    Creating a pod may set any contract key except the binder-owned ones; an update may change none.
    """
    violations: list[RuleViolation] = []
    for key in changed_contract_keys(old, new):
        shown = new.get(key, "")
        detail = "" if key in new else "it was removed"
        if k.is_binder_owned(key):
            violations.append(BinderOwnedKey(key=key, value=shown, detail=detail))
        elif not creating:
            violations.append(ImmutableRequest(key=key, value=shown, detail=detail))
    return violations
