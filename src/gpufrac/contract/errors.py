"""Why a GPU request is rejected: one exception class per rule, every message one sentence.

A user meets these messages in three places (``kubectl apply`` through the webhook, ``gpufrac validate``,
and the scheduler's Events), so each names the key, the value and the rule:

    gpu-fraction="1.5" is invalid: a GPU fraction must be a number greater than 0 and less than 1.

Each rule is a class with a fixed ``summary`` (the user guide lists every summary, and a test keeps the
two in sync) and an optional per-instance ``detail`` with the specifics. Parsing collects every violation
of a pod and raises them together as ``InvalidPodRequest``, so a user fixes a manifest in one round trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import ClassVar

_SHOWN_VALUE_CHARS = 80


class ContractError(ValueError):
    """Base of everything the contract raises about user input; nothing else escapes a parse."""


class RuleViolation(ContractError):
    """One broken rule: ``key``, its ``value`` and the rule, in one sentence."""

    summary: ClassVar[str] = "the value breaks a rule of the GPU annotation contract"

    def __init__(self, *, key: str, value: str, detail: str = "") -> None:
        self.key = key
        self.value = value
        self.detail = detail
        super().__init__(self.message)

    @property
    def message(self) -> str:
        shown = (
            self.value if len(self.value) <= _SHOWN_VALUE_CHARS else self.value[:_SHOWN_VALUE_CHARS] + "..."
        )
        rule = self.summary + (f" ({self.detail})" if self.detail else "")
        return f"{self.key}={json.dumps(shown)} is invalid: {rule}."

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and isinstance(other, RuleViolation)
            and (other.key, other.value, other.detail) == (self.key, self.value, self.detail)
        )

    def __hash__(self) -> int:
        return hash((type(self), self.key, self.value, self.detail))


class InvalidPodRequest(ContractError):
    """All the rule violations found in one pod, in a stable order."""

    def __init__(self, errors: Iterable[RuleViolation]) -> None:
        self.errors: tuple[RuleViolation, ...] = tuple(errors)
        if not self.errors:
            raise ValueError("InvalidPodRequest needs at least one violation")
        super().__init__(" ".join(e.message for e in self.errors))

    @property
    def messages(self) -> list[str]:
        return [e.message for e in self.errors]


# -- quantities ------------------------------------------------------------------------------------------


class NotAQuantity(RuleViolation):
    summary = "the value must be a Kubernetes quantity such as 40Gi or 4096Mi"


class UnknownQuantitySuffix(RuleViolation):
    summary = "the quantity suffix must be one of Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E"


class NotPositive(RuleViolation):
    summary = "the amount must be greater than zero"


class BelowMinimum(RuleViolation):
    summary = "the amount must be at least 1 MiB (a bare number is bytes: write 4096Mi for 4096 MiB)"


class TooLarge(RuleViolation):
    summary = "the amount must be less than 8Ei (a Kubernetes quantity holds at most 2^63 - 1 bytes)"


#: The longest quantity text the contract reads: an int64 has 19 digits, so 64 characters leave room for
#: any real amount with its fraction, exponent and suffix, and keep arbitrary-precision arithmetic (and
#: Python's 4,300-digit limit on int conversion) away from hostile input.
MAX_QUANTITY_CHARS = 64


class QuantityTooLong(RuleViolation):
    summary = f"a quantity must be at most {MAX_QUANTITY_CHARS} characters long"


class QuantityNeedsUnit(RuleViolation):
    summary = "a limit next to gpu-memory must carry a unit such as Mi or Gi"


# -- memory request and limit ----------------------------------------------------------------------------


class LimitBelowRequest(RuleViolation):
    summary = "the limit must be at least the request"


class InvalidFraction(RuleViolation):
    summary = "a GPU fraction must be a number greater than 0 and less than 1"


class InvalidFractionLimit(RuleViolation):
    summary = "a fraction limit must be a number greater than gpu-fraction and less than 1"


class InvalidLegacyMemory(RuleViolation):
    summary = "gpu-memory must be a whole number of MiB greater than 0"


class ConflictingRequests(RuleViolation):
    summary = "a container's GPU request must be given in one form only"


# -- devices, compute ------------------------------------------------------------------------------------


class InvalidDeviceCount(RuleViolation):
    summary = "a GPU count must be a whole number from 1 to 256"


class InvalidComputeMode(RuleViolation):
    summary = "the compute mode must be time-slicing or sm-sharing"


class InvalidComputePortion(RuleViolation):
    summary = "a compute portion must be a number greater than 0 and at most 1"


class InvalidDeviceList(RuleViolation):
    summary = "a device list must be comma-separated GPU UUIDs or CDI names, without blanks or repeats"


class DeviceCountMismatch(RuleViolation):
    summary = "the number of assigned devices must equal the number of GPUs requested"


class FractionWithWholeGpu(RuleViolation):
    summary = "a pod asks for fractions of GPUs or for whole GPUs (nvidia.com/gpu), not both"


# -- MIG slices ------------------------------------------------------------------------------------------


class UnknownMigProfile(RuleViolation):
    summary = "a MIG profile must be one that a supported GPU model has"


class MigMemoryTooLarge(RuleViolation):
    summary = "the memory must fit in the largest MIG slice of a supported GPU model"


class InvalidMigCount(RuleViolation):
    summary = "a MIG slice count must be a whole number from 1 to 256"


class MigWithOtherRequest(RuleViolation):
    summary = (
        "a container asks for MIG slices or for other GPU keys (fractions, compute, whole GPUs), not both"
    )


# -- keys and containers ---------------------------------------------------------------------------------


class UnknownKey(RuleViolation):
    summary = "the key is not part of the GPU annotation contract"


class UnknownContainer(RuleViolation):
    summary = "the pod has no container of that name"


class KeyWithoutRequest(RuleViolation):
    summary = "the key only applies together with a GPU request"


class NotTheFractionTarget(RuleViolation):
    summary = "a portion limit must name the container that gpu-fraction applies to"


class NotTheRequestingContainer(RuleViolation):
    summary = "gpu-fraction-container-name must name the container that holds the GPU request"


class InvalidMps(RuleViolation):
    summary = 'mps must be "true" or "false"'


class UnwritableKey(RuleViolation):
    """The scheduler would have to write a key the API server refuses (its ``detail`` names the key and
    the API server's rule); raised at admission, by ``gpufrac validate``, and by ``render_binding``."""

    summary = (
        "the container name is too long or malformed for the annotation keys the scheduler writes when it"
        " places the pod"
    )


# -- who may write what ----------------------------------------------------------------------------------


class BinderOwnedKey(RuleViolation):
    summary = "only the scheduler may set or change this key"


class ImmutableRequest(RuleViolation):
    summary = "the GPU request of an existing pod cannot be changed; create a new pod instead"


class ResizeNotAllowed(RuleViolation):
    summary = "a resize applies only to a fractional GPU container of a pod that is already placed"


# -- node side -------------------------------------------------------------------------------------------


class NotPlaced(RuleViolation):
    summary = "the container has no GPU assignment the node can enforce yet"


def rule_classes() -> list[type[RuleViolation]]:
    """Every concrete rule, for the user guide and its test."""
    return sorted(RuleViolation.__subclasses__(), key=lambda cls: cls.__name__)
