"""Scenarios: the trace as published, or variants that exercise what the trace lacks.

``plain`` replays the trace unchanged (every pod time-slicing, one namespace). ``mixed`` exercises the
two compute modes and fractional multi-GPU requests, which the openb trace does not have: latency-
sensitive (``qos == LS``) GPU-sharing pods run sm-sharing, the rest time-slicing; pods belong to one of
eight teams (namespaces), so single-tenant sm-sharing GPUs are per team; and every second multi-GPU pod
asks for half of each of its GPUs instead of whole ones (``gpu-fraction: 0.5`` with
``gpu-fraction-num-devices: N``). The assignment is a pure function of the pod's row, so all policies
and seeds see the same workload.

``claims`` replays the trace as DRA ResourceClaims on gpufrac's ResourceSlice (docs/dra.md, "Ours
against the stock allocator"): each GPU pod's claim asks, per device, for its share of the GPU's memory
(``gpu_milli`` x the GPU's MiB), which the slice's ``requestPolicy`` rounds up to whole MiB; a whole-GPU
pod's claim names no amount and so consumes the whole device (the policy's default), exclusively; a
multi-GPU pod asks for ``num_gpu`` devices. The only difference from the annotation pods of ``plain`` is
that rounding: ``ceil(p x MiB)`` instead of ``floor``, so two claims for half of a 15,109 MiB T4
(7,555 MiB each) do not fit on it where two annotation pods (7,554 MiB) do. The claims are time-slicing
(the default DeviceClass); FGD's prior keeps the trace's shapes.

``mig`` (``gpufrac.sim.mig_workload``) moves the GPU nodes to a MIG-capable model and has a seeded share
of the sharing pods ask for hardware isolation (a MIG slice); ``gpufrac simulate --scenario mig`` replays
it three ways side by side (static layouts, dynamic layouts, fractions only: ``gpufrac.sim.mig_replay``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpufrac.contract.request import ComputeMode

from .mig_workload import DEFAULT_MIG_SHARE, mig_workload
from .trace import TracePod

SCENARIOS = ("plain", "mixed", "claims", "mig")
TEAMS = 8


def prepare(pods: Sequence[TracePod], scenario: str) -> list[TracePod]:
    if scenario == "plain":
        return list(pods)
    if scenario == "mixed":
        return [_mixed(i, p) for i, p in enumerate(pods)]
    if scenario == "claims":
        return [replace(p, claim=True) for p in pods]
    if scenario == "mig":
        return mig_workload(pods, DEFAULT_MIG_SHARE)
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


def _mixed(row: int, pod: TracePod) -> TracePod:
    gpu_milli = pod.gpu_milli
    if pod.num_gpu >= 2 and pod.gpu_milli >= 1000 and row % 2 == 0:
        gpu_milli = 500
    sharing = 0 < gpu_milli < 1000
    mode = ComputeMode.SM_SHARING if sharing and pod.qos == "LS" else ComputeMode.TIME_SLICING
    return replace(pod, gpu_milli=gpu_milli, mode=mode, namespace=f"team-{row % TEAMS}")
