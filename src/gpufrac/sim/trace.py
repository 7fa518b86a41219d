"""Trace files: the openb node and pod lists (Alibaba, ATC'23), and where to find them.

A trace is a list of nodes and a list of pods in the openb CSV format (see shared/data/openb/README.md):
nodes ``sn,cpu_milli,memory_mib,gpu,model``; pods ``name,cpu_milli,memory_mib,num_gpu,gpu_milli`` and
optionally ``gpu_spec,qos,...``. ``gpu_milli`` is thousandths of ONE GPU; a pod with ``gpu_milli`` 1000
takes ``num_gpu`` whole GPUs. Three fields the trace does not have but our scenarios need (compute mode,
namespace, whether the share is asked for with a DRA claim) default to an annotation pod, time-slicing,
in one namespace.

Named traces resolve against a data directory: ``--data-dir``, else ``$GPUFRAC_DATA_DIR``, else (only
when running from a source checkout, for the repository's tests and benchmarks) ``shared/data/openb``
beside the checkout, else the download cache of ``gpufrac.sim.openb``, filled on first use from the
published trace and checked against pinned checksums. An installed package never looks outside itself
and its cache.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from gpufrac.contract.request import ComputeMode

from . import openb

TRACES = (
    "default",
    "gpushare20",
    "gpushare60",
    "gpushare100",
    "multigpu20",
    "multigpu30",
    "gpuspec10",
    "gpuspec20",
    "cpu050",
    "cpu100",
)
GPU_NODE_FILE = "openb_node_list_gpu_node.csv"

GPU_MIB = {
    "T4": 15109,
    "P100": 16280,
    "V100M16": 16160,
    "V100M32": 32510,
    "A10": 22731,
    "G1": 32768,
    "G2": 32768,
    "G3": 32768,
}
"""MiB per GPU model. Known models: the sizes the paper's own simulator uses (driver-reported totals).
G1/G2/G3 are undisclosed: 32 GiB placeholders. Every trace request is a portion of one GPU, so the size
changes nothing but the rounding of MiB (``floor(portion x MiB)``)."""
DEFAULT_GPU_MIB = 16384


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()
    qos: str = ""
    mode: ComputeMode = ComputeMode.TIME_SLICING
    namespace: str = "openb"
    claim: bool = False
    """The share is asked for with a DRA ResourceClaim (scenario ``claims``): it consumes its portion of
    the GPU rounded up to whole MiB, where an annotation pod's is rounded down (``GpuMemory.round_up``)."""
    created: int | None = None
    """Seconds into the trace when the pod was created (``creation_time``), when the trace has it."""
    deleted: int | None = None
    """Seconds into the trace when it was deleted (``deletion_time``); the churn replay's departures."""
    isolation_mib: int = 0
    """Hardware isolation asked for (scenario ``mig``): a MIG slice of at least this many MiB per GPU
    (``MigRequest(min_mib=...)``) instead of a fraction; 0 for a fraction or whole-GPU pod."""

    @property
    def gpu_total_milli(self) -> int:
        """GPU demand in thousandths of a GPU (the paper's unit for arrival and allocation)."""
        return self.num_gpu * self.gpu_milli


def checkout_data_dir() -> Path | None:
    """``shared/data/openb`` beside a source checkout (``<checkout>/src/gpufrac``), if there is one.

    Only a checkout qualifies (``src/`` with a pyproject.toml above it): a package installed into
    site-packages has no such neighbour, and must not guess one.
    """
    package = Path(__file__).resolve().parents[1]
    root = package.parents[1]
    if package.parent.name != "src" or not (root / "pyproject.toml").is_file():
        return None
    for base in (root.parent, root.parent.parent):  # a clone beside shared/, or a worktree one level down
        candidate = base / "shared" / "data" / "openb"
        if candidate.is_dir():
            return candidate
    return None


def default_data_dir() -> Path:
    """``$GPUFRAC_DATA_DIR``, else a checkout's ``shared/data/openb``, else the download cache."""
    env = os.environ.get("GPUFRAC_DATA_DIR")
    if env:
        return Path(env)
    return checkout_data_dir() or openb.cache_dir()


def resolve(trace: str, nodes: str | None, data_dir: Path | None) -> tuple[Path, Path]:
    """The pod and node CSV paths of a simulation; named files missing from the cache are fetched first.

    Raises ``openb.TraceUnavailable`` when a download fails or does not match its pinned checksum.
    Files in ``--data-dir``, ``$GPUFRAC_DATA_DIR`` or a checkout are used as they are.
    """
    pods_path, nodes_path = pod_file(trace, data_dir), node_file(nodes, data_dir)
    cache = openb.cache_dir()
    if data_dir is None and default_data_dir() == cache:
        wanted = [path.name for path in (pods_path, nodes_path) if path.parent == cache]
        openb.fetch(wanted, into=cache, base_url=openb.source())
    return pods_path, nodes_path


def pod_file(trace: str, data_dir: Path | None = None) -> Path:
    """A trace name (``default``, ``gpushare60`` ...) or a path to a pod CSV."""
    path = Path(trace)
    if path.suffix == ".csv" or path.exists():
        return path
    return (data_dir or default_data_dir()) / f"openb_pod_list_{trace}.csv"


def node_file(nodes: str | None = None, data_dir: Path | None = None) -> Path:
    return Path(nodes) if nodes else (data_dir or default_data_dir()) / GPU_NODE_FILE


def load_nodes(path: Path) -> list[TraceNode]:
    with path.open(newline="") as f:
        return [
            TraceNode(
                name=row["sn"],
                cpu_milli=int(row["cpu_milli"]),
                memory_mib=int(row["memory_mib"]),
                gpus=int(row["gpu"]),
                model=row.get("model") or "",
            )
            for row in csv.DictReader(f)
        ]


def load_pods(path: Path) -> list[TracePod]:
    with path.open(newline="") as f:
        return [
            TracePod(
                name=row["name"],
                cpu_milli=int(row["cpu_milli"]),
                memory_mib=int(row["memory_mib"]),
                num_gpu=int(row["num_gpu"]),
                gpu_milli=int(row["gpu_milli"]),
                gpu_spec=tuple(m for m in (row.get("gpu_spec") or "").split("|") if m),
                qos=row.get("qos") or "",
                created=_seconds(row.get("creation_time")),
                deleted=_seconds(row.get("deletion_time")),
            )
            for row in csv.DictReader(f)
        ]


def _seconds(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos")


def save_nodes(path: Path, nodes: list[TraceNode]) -> None:
    """Write nodes in the openb format (e.g. a synthetic cluster for ``--nodes``)."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(NODE_COLUMNS)
        out.writerows((n.name, n.cpu_milli, n.memory_mib, n.gpus, n.model) for n in nodes)


def save_pods(path: Path, pods: list[TracePod]) -> None:
    """Write pods in the openb format (mode and namespace are not part of it)."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(POD_COLUMNS)
        out.writerows(
            (p.name, p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, "|".join(p.gpu_spec), p.qos)
            for p in pods
        )


#: The file names of an exported cluster snapshot; replay it with ``gpufrac simulate --trace
#: DIR/cluster_pods.csv --nodes DIR/cluster_nodes.csv``.
EXPORT_NODES, EXPORT_PODS = "cluster_nodes.csv", "cluster_pods.csv"


def export_snapshot(directory: Path, nodes: list[TraceNode], pods: list[TracePod]) -> tuple[Path, Path]:
    """Write a snapshot (``gpufrac simulate --from-cluster --export``, ``kubectl gpufrac whatif
    --export``) as openb CSVs in ``directory``; returns the two paths."""
    directory.mkdir(parents=True, exist_ok=True)
    save_nodes(directory / EXPORT_NODES, nodes)
    save_pods(directory / EXPORT_PODS, pods)
    return directory / EXPORT_NODES, directory / EXPORT_PODS
