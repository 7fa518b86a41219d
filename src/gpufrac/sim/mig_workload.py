"""Scenario ``mig``: the openb trace on MIG-capable GPUs, with a share of its sharing pods asking for
hardware isolation (issue #40, docs/mig.md).

The openb nodes (P100, T4, V100, G2, G3, A10) have no MIG, so every GPU node is SIMULATED as an
H100-80GB with the simulated inventory's memory (``MIG_GPU_MIB``, ``MODEL_MIB["H100-80GB"]`` of
``gpufrac.node.inventory.simulated``; the simulator may not import the node agent, a test checks the two
agree), keeping its GPU count, CPU and memory. With one GPU model the trace's ``gpu_spec`` constraints
would name models the cluster no longer has, so they are dropped.

Which pods ask for isolation: a GPU-sharing pod (``0 < gpu_milli < 1000``) is isolated when a hash of its
row (its name and ``MIG_SEED``) falls below ``share`` (default ``DEFAULT_MIG_SHARE``): a pure function of
the row, the same for every variant, policy and replay seed. Such a pod asks, per GPU, for the smallest
slice with at least its share of the GPU's memory (``MigRequest(min_mib=floor(gpu_milli/1000 x MiB))``),
so a pod that asks for more than a 3g.40gb slice holds (40,448 MiB, 49.6 % of the GPU) gets the 7g.80gb
slice, and one that asks for more than 7g.80gb's 81,152 MiB (over 99.5 %) fits no slice at all.
``fractions-only`` replays the same pods asking for the same memory as fractions.

The static layout is mig-parted's ``all-balanced`` for 80 GB GPUs (NVIDIA mig-parted,
``examples/config.yaml``: 2 x 1g.10gb, 1 x 2g.20gb, 1 x 3g.40gb), laid out by ``gpufrac.mig.geometry``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from gpufrac.mig.geometry import Slice, pack
from gpufrac.mig.profiles import MIG_MODELS
from gpufrac.placement.model import GpuDevice, GpuMode, MigSlice, NodeSpec

from .trace import TraceNode, TracePod

MIG_MODEL = "H100-80GB"
MIG_GPU_MIB = 81559
"""``MODEL_MIB["H100-80GB"]`` of the simulated inventory (what NVML reports for an H100 80 GB)."""
DEFAULT_MIG_SHARE = 0.25
"""Share of the GPU-sharing pods that ask for hardware isolation by default (about as many as the
trace's latency-sensitive sharing pods: 759 of 3,078 in ``default``)."""
MIG_SEED = 2023
BALANCED = ("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb")
"""mig-parted's all-balanced for 80 GB GPUs: the static variant's layout."""


def mig_nodes(nodes: Sequence[TraceNode]) -> list[TraceNode]:
    """Every GPU node as an H100-80GB (CPU-only nodes unchanged)."""
    return [replace(n, model=MIG_MODEL) if n.gpus else n for n in nodes]


def isolated(pod: TracePod, share: float, *, seed: int = MIG_SEED) -> bool:
    """Whether the row asks for hardware isolation: a sharing pod whose row hash falls below ``share``."""
    if not 0 < pod.gpu_milli < 1000 or pod.num_gpu == 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{pod.name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def isolation_mib(pod: TracePod) -> int:
    """The MiB a pod's share of an H100-80GB is (its fraction's memory, its slice's minimum)."""
    return pod.gpu_milli * MIG_GPU_MIB // 1000


def mig_workload(pods: Sequence[TracePod], share: float, *, as_mig: bool = True) -> list[TracePod]:
    """The pods of scenario ``mig``: model constraints dropped, isolated pods asking for a MIG slice
    (``as_mig``) or, for ``fractions-only``, for the same memory as a fraction."""
    if not 0 <= share <= 1:
        raise ValueError(f"--mig-share {share}: the share of sharing pods must be between 0 and 1")
    out = []
    for p in pods:
        wanted = isolation_mib(p) if as_mig and isolated(p, share) else 0
        out.append(replace(p, gpu_spec=(), isolation_mib=wanted))
    return out


def isolation_share_of_demand(pods: Sequence[TracePod], share: float) -> float:
    """The isolated pods' share of the list's requested GPU (the static variant's default MIG share)."""
    total = sum(p.gpu_total_milli for p in pods)
    mine = sum(p.gpu_total_milli for p in pods if isolated(p, share))
    return mine / total if total else 0.0


def static_nodes(nodes: Sequence[TraceNode], share: float) -> set[str]:
    """The GPU nodes the static variant partitions: ``share`` of them (rounded, at least one when
    ``share`` > 0), spread evenly over the nodes in name order (mig-parted configures a node at a time,
    so whole nodes)."""
    gpu_nodes = sorted(n.name for n in nodes if n.gpus)
    count = min(len(gpu_nodes), max(1 if share > 0 else 0, round(share * len(gpu_nodes))))
    return {gpu_nodes[int((k + 0.5) * len(gpu_nodes) / count)] for k in range(count)}


def slice_uuid(gpu_uuid: str, s: Slice) -> str:
    """A SIMULATED MIG device UUID, one per (GPU, profile, start)."""
    return f"MIG-{gpu_uuid}-{s.profile}-{s.start}"


def mig_gpu(gpu: GpuDevice, slices: Sequence[Slice]) -> GpuDevice:
    """``gpu`` in mode mig with ``slices`` (each with its profile's memory)."""
    model = MIG_MODELS[MIG_MODEL]
    mig = []
    for s in slices:
        profile = model.profile(s.profile)
        assert profile is not None
        mig.append(MigSlice(s.profile, s.start, slice_uuid(gpu.uuid, s), profile.memory_mib))
    return replace(gpu, mode=GpuMode.MIG, mig=tuple(mig))


def fractions_gpu(gpu: GpuDevice) -> GpuDevice:
    return replace(gpu, mode=GpuMode.FRACTIONS, mig=())


def balanced(spec: NodeSpec) -> NodeSpec:
    """``spec`` with every GPU in the all-balanced layout."""
    layout, left = pack(MIG_MODELS[MIG_MODEL], BALANCED)
    assert not left
    return replace(spec, gpus=tuple(mig_gpu(g, layout) for g in spec.gpus))
