"""Pure: the scheduler's ``gpufrac.io/gpu-layout`` annotation read and checked, and each GPU's next step.

The annotation (docs/mig.md) is ``{"generation": N, "gpus": {"<GPU uuid>": {"mode": "mig", "slices":
["3g.40gb@0", ...]} | {"mode": "fractions"} | {"mode": "whole"}}}``. Content that breaks a rule is
refused in one sentence naming the key, the value and the rule: for the whole annotation (not JSON, no
generation) nothing is applied; for one GPU (unknown UUID, unknown mode, a slice its model cannot hold)
only that GPU is refused.

``next_step`` is the heart of the executor's crash safety: it compares what the backend says the GPU is
now with what is wanted and returns the one step that brings it closer (destroy a slice the layout drops,
switch MIG off or on, wait for a reset, create a missing slice, mark the GPU whole or not), or None when
it is there. Nothing is remembered between steps, so an agent killed after any step finds, from NVML
alone, where the change stands and carries on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpufrac.contract import keys
from gpufrac.mig.geometry import MigLayoutError, Slice, check_layout
from gpufrac.mig.profiles import mig_model
from gpufrac.node.inventory.backend import GpuInfo, GpuMode

KEY = keys.NODE_GPU_LAYOUT_ANNOTATION


class LayoutState(StrEnum):
    """Where a GPU's requested change stands (``gpufrac.io/gpu-layout-status``)."""

    APPLIED = "Applied"
    PENDING = "Pending"
    NEEDS_RESET = "NeedsReset"
    REFUSED = "Refused"
    FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class WantedGpu:
    mode: GpuMode
    slices: tuple[Slice, ...] = ()

    def describe(self) -> str:
        if self.mode is GpuMode.MIG:
            return "mig: " + (", ".join(str(s) for s in self.slices) or "no slices")
        return self.mode.value


@dataclass(frozen=True, slots=True)
class LayoutRequest:
    """The annotation as read: the GPUs to change, those refused for their content, or why none is read."""

    generation: int | None = None
    gpus: Mapping[str, WantedGpu] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


def _clip(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."


def _shown(value: Any) -> str:
    """A value as JSON writes it (strings quoted), clipped."""
    return _clip(json.dumps(value))


def parse_layout(text: str | None, *, gpus: Mapping[str, GpuInfo]) -> LayoutRequest:
    """The layout annotation's content against this node's GPUs (``gpus`` by UUID); never raises."""
    if text is None:
        return LayoutRequest()
    try:
        data = json.loads(text)
    except ValueError:
        return LayoutRequest(error=f'{KEY}="{_clip(text)}" is invalid: it must be a JSON object')
    if not isinstance(data, dict):
        return LayoutRequest(error=f'{KEY}="{_clip(text)}" is invalid: it must be a JSON object')
    generation = data.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        return LayoutRequest(
            error=f"{KEY} generation={_shown(generation)} is invalid: it must be a whole number of at least 0"
        )
    entries = data.get("gpus", {})
    if not isinstance(entries, dict):
        return LayoutRequest(
            generation=generation,
            error=f"{KEY} gpus={_shown(entries)} is invalid: it must map GPU UUIDs to their wanted mode",
        )
    wanted: dict[str, WantedGpu] = {}
    refused: dict[str, str] = {}
    for uuid, entry in entries.items():
        try:
            wanted[uuid] = _wanted(uuid, entry, gpus.get(uuid))
        except ValueError as exc:
            refused[uuid] = str(exc)
    return LayoutRequest(generation=generation, gpus=wanted, refused=refused)


def _wanted(uuid: str, entry: Any, gpu: GpuInfo | None) -> WantedGpu:
    where = f'{KEY} gpus["{uuid}"]'
    if gpu is None:
        raise ValueError(f"{where} is invalid: this node has no GPU {uuid} (its GPUs are named by UUID)")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}={_shown(entry)} is invalid: it must be an object with a mode")
    mode_text = entry.get("mode")
    try:
        mode = GpuMode(mode_text)
    except ValueError:
        raise ValueError(
            f"{where}.mode={_shown(mode_text)} is invalid: a GPU's mode is fractions, mig or whole"
        ) from None
    slices_value = entry.get("slices", [])
    if mode is not GpuMode.MIG:
        if slices_value:
            raise ValueError(
                f"{where}.slices={_shown(slices_value)} is invalid: only a GPU in mode mig has slices"
            )
        return WantedGpu(mode=mode)
    model = mig_model(gpu.model)
    if model is None:
        raise ValueError(
            f"{where}.mode=mig is invalid: GPU {uuid} is a {gpu.model}, which has no MIG profiles gpufrac "
            "knows (A100 40/80 GB, H100 80 GB, H200 141 GB)"
        )
    if not isinstance(slices_value, list) or not all(isinstance(t, str) for t in slices_value):
        raise ValueError(
            f'{where}.slices={_shown(slices_value)} is invalid: it must be a list of "<profile>@<start>"'
        )
    try:
        slices = tuple(Slice.parse(t) for t in slices_value)
        if len(set(slices)) != len(slices):
            raise MigLayoutError("a slice is listed twice")
        check_layout(model, slices)
    except MigLayoutError as exc:
        raise ValueError(f"{where}.slices={_shown(slices_value)} is invalid: {exc}") from None
    return WantedGpu(mode=mode, slices=tuple(sorted(slices, key=lambda s: (s.start, s.profile))))


# -- the next step ------------------------------------------------------------------------------------


class StepKind(StrEnum):
    DESTROY = "destroy"  # a slice the layout does not want
    CREATE = "create"  # a slice the layout wants
    ENABLE_MIG = "enable-mig"
    DISABLE_MIG = "disable-mig"
    RESET = "reset"  # the MIG mode is pending until the GPU is reset
    MARK_WHOLE = "mark-whole"
    UNMARK_WHOLE = "unmark-whole"


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    slice: Slice | None = None

    def __str__(self) -> str:
        return f"{self.kind.value} {self.slice}" if self.slice is not None else self.kind.value


def current_slices(gpu: GpuInfo) -> tuple[Slice, ...]:
    return tuple(
        sorted((Slice(s.profile, s.start) for s in gpu.mig_slices), key=lambda s: (s.start, s.profile))
    )


def next_step(gpu: GpuInfo, wanted: WantedGpu) -> Step | None:
    """The one step that brings ``gpu`` (as the backend says it is) closer to ``wanted``; None: it is."""
    have = current_slices(gpu)
    if wanted.mode is GpuMode.MIG:
        if not gpu.mig:
            return Step(StepKind.RESET) if gpu.mig_pending_mode else Step(StepKind.ENABLE_MIG)
        if not gpu.mig_pending_mode:  # MIG on but off after the next reset: cancel that first
            return Step(StepKind.ENABLE_MIG)
        for s in have:
            if s not in wanted.slices:
                return Step(StepKind.DESTROY, s)
        for s in wanted.slices:
            if s not in have:
                return Step(StepKind.CREATE, s)
        return Step(StepKind.UNMARK_WHOLE) if gpu.whole else None
    if gpu.mig:
        if have:
            return Step(StepKind.DESTROY, have[0])
        return Step(StepKind.DISABLE_MIG) if gpu.mig_pending_mode else Step(StepKind.RESET)
    if gpu.mig_pending_mode:  # MIG off, but on after the next reset: cancel that
        return Step(StepKind.DISABLE_MIG)
    whole = wanted.mode is GpuMode.WHOLE
    if gpu.whole != whole:
        return Step(StepKind.MARK_WHOLE if whole else StepKind.UNMARK_WHOLE)
    return None
