"""Label selection as Kubernetes defines it for nodes: a requirement (key, operator, values) and a term
(requirements ANDed). Plain values with no dependency in the package: the cluster model (``model``: node
affinity, queue namespace selectors) and the rules between pods (``pod_constraints``: label selectors of
affinity terms and spread constraints) both build on them, so neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


@dataclass(frozen=True, slots=True)
class NodeSelectorRequirement:
    key: str
    operator: SelectorOperator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        op = self.operator
        if op is SelectorOperator.IN:
            return value is not None and value in self.values
        if op is SelectorOperator.NOT_IN:
            return value is None or value not in self.values
        if op is SelectorOperator.EXISTS:
            return value is not None
        if op is SelectorOperator.DOES_NOT_EXIST:
            return value is None
        # Gt/Lt compare integers; a label or operand that is not an integer never matches (Kubernetes).
        if value is None or len(self.values) != 1:
            return False
        try:
            have, bound = int(value), int(self.values[0])
        except ValueError:
            return False
        return have > bound if op is SelectorOperator.GT else have < bound


@dataclass(frozen=True, slots=True)
class NodeSelectorTerm:
    """Expressions ANDed; an empty term matches nothing (Kubernetes)."""

    match_expressions: tuple[NodeSelectorRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return bool(self.match_expressions) and all(r.matches(labels) for r in self.match_expressions)
