"""Annotation keys one slip away from the contract's: warnings that say which key was meant.

A misspelled key is not a contract key, so nothing reads it: ``gpu-fractions: "0.5"`` or
``gpu-fraction-num-device: "2"`` passes every rule and the pod runs with no GPU, or with one where it
asked for two. A key under a contract prefix with an unknown suffix is already an error (the parser
refuses it); these are the keys the parser cannot know are meant for it. They stay warnings, not errors:
an annotation of someone else's that merely looks like ours must not stop a pod. ``gpufrac validate``
prints them and the mutating webhook returns them as admission warnings (``kubectl`` prints those).

Which keys are near misses: a key without a prefix, or under ``nvidia.com/``, ``kai.scheduler/`` or
``gpufrac.io/``, that is not a contract key and either reads like one of the pod-level keys
(``difflib``'s ratio at least 0.8, case ignored), carries a per-container suffix under another shape than
``<prefix>container.<c>.<suffix>``, or reads like one of gpufrac's pod annotations.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from gpufrac.contract import keys as k

#: How alike two keys must be (``difflib.SequenceMatcher.ratio``) for one to be taken for the other.
CLOSE_RATIO = 0.8

#: The keys a pod writes without a prefix (KAI Scheduler's pod-level forms and its MPS switch).
BARE_KEYS = (*k.POD_LEVEL_KEYS, k.KAI_MPS)
#: The namespaces whose keys are the contract's or gpufrac's own.
OWN_NAMESPACES = ("nvidia.com", "kai.scheduler", "gpufrac.io")
#: gpufrac's pod annotations outside the per-container keys.
GPUFRAC_POD_ANNOTATIONS = (
    k.PLACEMENT_POLICY_ANNOTATION,
    k.MOVABLE_ANNOTATION,
    k.KEEP_SCHEDULER_NAME_ANNOTATION,
)
#: Every per-container suffix with the prefix it belongs under.
_SUFFIX_PREFIX = {
    **{suffix: k.NVIDIA_CONTAINER_PREFIX for suffix in k.NVIDIA_CONTAINER_SUFFIXES},
    k.PORTION_LIMIT: k.KAI_CONTAINER_PREFIX,
    **{suffix: k.GPUFRAC_CONTAINER_PREFIX for suffix in k.GPUFRAC_CONTAINER_SUFFIXES},
}


def _closest(word: str, candidates: tuple[str, ...]) -> str | None:
    found = difflib.get_close_matches(word.lower(), candidates, n=1, cutoff=CLOSE_RATIO)
    return found[0] if found else None


def closest_suffix(prefix: str, suffix: str) -> str | None:
    """The per-container suffix under ``prefix`` that ``suffix`` was most likely meant to be, or None."""
    known = tuple(s for s, p in _SUFFIX_PREFIX.items() if p == prefix)
    return _closest(suffix, known)


def _misshapen_container_key(name: str) -> str | None:
    """``name`` (the part after the namespace) ends in a per-container suffix but is not shaped
    ``container.<c>.<suffix>``: the key it was meant to be, with the container guessed when it can be."""
    for suffix, prefix in sorted(_SUFFIX_PREFIX.items(), key=lambda item: -len(item[0])):
        if name != suffix and not name.endswith("." + suffix):
            continue
        head = name[: -len(suffix)].rstrip(".")
        container = head.rpartition(".")[2]
        for spelled in ("containers-", "container-", "containers", "container"):
            if container.startswith(spelled) and len(container) > len(spelled):
                container = container[len(spelled) :]
                break
        if not container or _closest(container, ("container", "containers")):
            container = "<container>"
        return f"{prefix}{container}.{suffix}"
    return None


def meant_key(key: str) -> str | None:
    """The contract or gpufrac key ``key`` was most likely meant to be; None when it is one, or when it
    resembles none."""
    if k.is_contract_key(key) or key in GPUFRAC_POD_ANNOTATIONS:
        return None
    namespace, slash, name = key.rpartition("/")
    if not slash:
        return _closest(name, BARE_KEYS)
    if namespace.lower() not in OWN_NAMESPACES:
        return None
    if namespace.lower() == "gpufrac.io":
        own = _closest(key, GPUFRAC_POD_ANNOTATIONS)
        if own is not None:
            return own
    return _misshapen_container_key(name) or _closest(name, BARE_KEYS)


def near_miss_warnings(annotations: Mapping[Any, Any]) -> list[str]:
    """One sentence per annotation that is one slip away from a key gpufrac reads, in key order (keys of
    any type are read as text: a manifest's YAML may hold a number there)."""
    warnings = []
    for key in sorted(str(key) for key in annotations):
        meant = meant_key(key)
        if meant is not None:
            warnings.append(
                f'annotation "{key}" is not a key gpufrac reads (it is ignored): did you mean "{meant}"?'
            )
    return warnings
