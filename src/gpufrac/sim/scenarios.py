"""Scenarios: the trace as published, or variants that exercise what the trace lacks.

``plain`` replays the trace unchanged (every pod time-slicing, one namespace). ``mixed`` exercises the
two compute modes and fractional multi-GPU requests, which the openb trace does not have: latency-
sensitive (``qos == LS``) GPU-sharing pods run sm-sharing, the rest time-slicing; pods belong to one of
eight teams (namespaces), so single-tenant sm-sharing GPUs are per team; and every second multi-GPU pod
asks for half of each of its GPUs instead of whole ones (``gpu-fraction: 0.5`` with
``gpu-fraction-num-devices: N``). The assignment is a pure function of the pod's row, so all policies
and seeds see the same workload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpufrac.contract.request import ComputeMode

from .trace import TracePod

SCENARIOS = ("plain", "mixed")
TEAMS = 8


def prepare(pods: Sequence[TracePod], scenario: str) -> list[TracePod]:
    if scenario == "plain":
        return list(pods)
    if scenario == "mixed":
        return [_mixed(i, p) for i, p in enumerate(pods)]
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


def _mixed(row: int, pod: TracePod) -> TracePod:
    gpu_milli = pod.gpu_milli
    if pod.num_gpu >= 2 and pod.gpu_milli >= 1000 and row % 2 == 0:
        gpu_milli = 500
    sharing = 0 < gpu_milli < 1000
    mode = ComputeMode.SM_SHARING if sharing and pod.qos == "LS" else ComputeMode.TIME_SLICING
    return replace(pod, gpu_milli=gpu_milli, mode=mode, namespace=f"team-{row % TEAMS}")
