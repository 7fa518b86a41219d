"""``report --what-if-whole-gpu``: the window's pods placed again with whole GPUs, through the engine.

The pods are those the history saw, in the order they were first seen; each becomes a trace pod (the
simulator's unit): its share of one GPU in thousandths (its request over the GPU's memory, the largest
seen) on as many GPUs as it was seen on at once. Each is placed once, in that order, on the cluster's GPU
nodes (``kubectl gpufrac whatif``'s snapshot), first as booked and then asking one whole GPU per device,
with the product's placement engine under each policy (``gpufrac.placement.Engine``, as the simulator
and the scheduler run it). What fractions bought is then the pods that fit and the GPUs they took.

What the metrics do not say is left out and said: pods' host CPU and memory (placed as if they asked for
none), node selectors and affinity, and containers beyond the first of a pod (its GPUs are the first
container's). Nothing here does I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpufrac.contract.request import ComputeMode
from gpufrac.kubectl.report import History
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.sim.trace import TraceNode, TracePod
from gpufrac.sim.workload import PodFactory, node_spec, shape_counts

WHOLE = 1000
FRACTIONS = "fractions"
WHOLE_GPUS = "whole-gpus"
UNSAID = (
    "what-if: pods replayed from the usage metrics without their host CPU and memory, node selectors or "
    "affinity; a pod's GPUs are its first container's"
)


def window_pods(history: History) -> tuple[list[TracePod], list[str]]:
    """Each pod seen in the window once, in the order first seen; and the pods that could not be."""
    first: dict[tuple[str, str], float] = {}
    containers: dict[tuple[str, str], set[str]] = defaultdict(set)
    milli: dict[tuple[str, str, str], int] = defaultdict(int)
    devices: dict[tuple[str, str, str], int] = defaultdict(int)
    modes: dict[tuple[str, str], str] = {}
    unknown: set[tuple[str, str]] = set()
    for at, samples in history.instants:
        gpus_now: dict[tuple[str, str, str], set[tuple[str, str]]] = defaultdict(set)
        for s in samples:
            pod = (s.namespace, s.pod)
            first.setdefault(pod, at)
            containers[pod].add(s.container)
            modes.setdefault(pod, s.mode)
            if s.gpu_memory_bytes <= 0:
                unknown.add(pod)
                continue
            share = WHOLE if not s.fractional else max(1, round(WHOLE * s.request_bytes / s.gpu_memory_bytes))
            key = (*pod, s.container)
            milli[key] = max(milli[key], share)
            gpus_now[key].add(s.gpu)
        for key, gpus in gpus_now.items():
            devices[key] = max(devices[key], len(gpus))
    pods = []
    for pod in sorted(first, key=lambda p: (first[p], p)):
        if pod in unknown:
            continue
        container = min(containers[pod])
        key = (*pod, container)
        mode = ComputeMode.SM_SHARING if modes[pod] == ComputeMode.SM_SHARING else ComputeMode.TIME_SLICING
        pods.append(
            TracePod(
                name=f"{pod[0]}/{pod[1]}",
                cpu_milli=0,
                memory_mib=0,
                num_gpu=devices[key],
                gpu_milli=milli[key],
                mode=mode,
                namespace=pod[0],
            )
        )
    left_out = [f"{ns}/{name}: its GPU's memory was not exported" for ns, name in sorted(unknown)]
    return pods, left_out


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    policy: str
    allocation: str  # FRACTIONS or WHOLE_GPUS
    pods: int
    placed: int
    gpus_used: int
    gpus: int

    @property
    def left_out(self) -> int:
        return self.pods - self.placed

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "allocation": self.allocation,
            "pods": self.pods,
            "placed": self.placed,
            "leftOut": self.left_out,
            "gpusUsed": self.gpus_used,
            "gpus": self.gpus,
        }


def what_if(
    *, nodes: Sequence[TraceNode], pods: Sequence[TracePod], policies: Sequence[str], seed: int = 42
) -> list[WhatIfRow]:
    """Per policy, the pods placed and the GPUs they took, as booked and with a whole GPU per device."""
    rows = []
    gpus = sum(n.gpus for n in nodes)
    for policy in policies:
        for allocation, shaped in (
            (FRACTIONS, list(pods)),
            (WHOLE_GPUS, [replace(p, gpu_milli=WHOLE) for p in pods]),
        ):
            engine = Engine(policy=policy, seed=seed, typical=shape_counts(shaped))
            for node in nodes:
                engine.add_node(node_spec(node))
            make = PodFactory()
            placed, used = 0, set()
            for i, pod in enumerate(shaped):
                decision = engine.place(make(pod, i))
                if isinstance(decision, Placement):
                    placed += 1
                    used |= {uuid for c in decision.containers for uuid in c.uuids}
            rows.append(WhatIfRow(policy, allocation, len(shaped), placed, len(used), gpus))
    return rows
