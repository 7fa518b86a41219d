"""The figures of ``kubectl gpufrac report``: pure functions of a usage history (no I/O here).

A history is what the node agents exported, instant by instant: one ``FractionSample`` per tenant
(container) per GPU per instant, each instant standing for ``step_s`` seconds. It comes from Prometheus
range queries over a window or from one live scrape (``report_sources``); the figures do not care
which, so the same numbers come out of a test's hand-written history and a cluster's.

Every figure is defined in docs/metrics.md ("The report's figures"); in short:

- density: a *fraction* is a tenant on a GPU whose request is below the GPU's memory (a whole-GPU
  tenant is exported with request = capacity and is left out). Whole-GPU allocation would give each
  fraction its own GPU (one GPU per device asked), so GPUs needed = fractions; GPUs saved = fractions -
  GPUs holding fractions. Window figures are means over the instants (fractions per GPU: ratio of the
  means).
- memory: booked (request), limit, used and idle booked (max(0, request - used)) bytes, summed per
  group (namespace or queue) at each instant, then averaged over the window.
- interference: for each tenant on each GPU, over the instants it was busy (SM utilization > 0) with n
  busy tenants on that GPU: its share of the GPU's SM time (received) against 1/n; shortfall = mean(1/n)
  - mean(received). Contended time is the busy time with n ≥ 2. Under time-slicing NVML says who ran,
  not who waited with work queued: the time a tenant *waited* cannot be measured, so the report gives
  the contended time (exposure) and the shortfall, never a wait.
- cost: fractional GPU-hours booked (sum of request / GPU memory x step) against whole-GPU hours (sum of one
  per fraction x step), times a price per GPU-hour, per queue.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: The group of a pod nobody could name a queue for (gone from the cluster, or no API server to ask).
UNKNOWN_QUEUE = "<unknown>"


@dataclass(frozen=True, slots=True)
class FractionSample:
    """One tenant on one GPU at one instant, as the node agent exported it."""

    node: str
    namespace: str
    pod: str
    container: str
    gpu_uuid: str
    mode: str
    request_bytes: float
    limit_bytes: float
    used_bytes: float
    sm_ratio: float
    received_ratio: float
    #: The GPU's memory (``gpufrac_gpu_memory_total_bytes``); 0 when it was not exported.
    gpu_memory_bytes: float = 0.0

    @property
    def gpu(self) -> tuple[str, str]:
        return (self.node, self.gpu_uuid)

    @property
    def tenant(self) -> tuple[str, str, str]:
        return (self.namespace, self.pod, self.container)

    @property
    def fractional(self) -> bool:
        """Below the GPU's memory (an exclusive tenant is exported with request = capacity)."""
        return self.gpu_memory_bytes <= 0 or self.request_bytes < self.gpu_memory_bytes


@dataclass(frozen=True, slots=True)
class History:
    """Instants in time order, each with its samples; every instant stands for ``step_s`` seconds."""

    instants: Sequence[tuple[float, Sequence[FractionSample]]]
    step_s: float

    @property
    def seconds(self) -> float:
        return len(self.instants) * self.step_s


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


@dataclass(frozen=True, slots=True)
class Density:
    fractions: float
    gpus_holding_fractions: float
    whole_gpus_needed: float
    gpus_saved: float
    saved_share: float
    fractions_per_gpu: float
    #: (time, GPUs holding fractions, whole GPUs the same fractions would need), for the plot.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


def density(history: History) -> Density:
    timeline = []
    for at, samples in history.instants:
        fractions = [s for s in samples if s.fractional]
        timeline.append((at, len({s.gpu for s in fractions}), len(fractions)))
    holding = _mean([h for _, h, _ in timeline])
    needed = _mean([n for _, _, n in timeline])
    return Density(
        fractions=needed,
        gpus_holding_fractions=holding,
        whole_gpus_needed=needed,
        gpus_saved=needed - holding,
        saved_share=_ratio(needed - holding, needed),
        fractions_per_gpu=_ratio(needed, holding),
        timeline=timeline,
    )


@dataclass(frozen=True, slots=True)
class MemoryRow:
    group: str
    booked_bytes: float
    limit_bytes: float
    used_bytes: float
    idle_booked_bytes: float

    @property
    def idle_share(self) -> float:
        return _ratio(self.idle_booked_bytes, self.booked_bytes)


def memory(history: History, group_of: Callable[[FractionSample], str]) -> list[MemoryRow]:
    """Per group, the window's mean of each instant's sums; the most idle booked memory first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for _, samples in history.instants:
        for s in samples:
            row = totals[group_of(s)]
            row[0] += s.request_bytes
            row[1] += s.limit_bytes
            row[2] += s.used_bytes
            row[3] += max(0.0, s.request_bytes - s.used_bytes)
    n = len(history.instants) or 1
    rows = [MemoryRow(group, *(v / n for v in values)) for group, values in totals.items()]
    return sorted(rows, key=lambda r: (-r.idle_booked_bytes, r.group))


@dataclass(frozen=True, slots=True)
class TenantInterference:
    namespace: str
    pod: str
    container: str
    node: str
    gpu_uuid: str
    mode: str
    busy_s: float
    contended_s: float
    #: Mean share of the GPU's SM time it received while busy.
    received_share: float
    #: Mean 1/n of the n busy tenants while it was busy: an even split.
    fair_share: float

    @property
    def shortfall(self) -> float:
        """How much less than an even split it got while busy (negative: more)."""
        return self.fair_share - self.received_share


@dataclass(frozen=True, slots=True)
class GpuInterference:
    node: str
    gpu_uuid: str
    mode: str
    contended_s: float
    worst_shortfall: float
    worst_tenant: str


def interference(history: History) -> tuple[list[TenantInterference], list[GpuInterference]]:
    """Tenants and GPUs ranked by interference: the largest shortfall first, then the longest contention.

    Whole-GPU tenants are left out (nobody shares their GPU)."""
    busy: dict[tuple, list[tuple[float, float]]] = defaultdict(list)  # key → [(received, 1/n)]
    contended_gpu: dict[tuple[str, str], int] = defaultdict(int)
    modes: dict[tuple[str, str], str] = {}
    for _, samples in history.instants:
        on_gpu: dict[tuple[str, str], list[FractionSample]] = defaultdict(list)
        for s in samples:
            if s.fractional and s.sm_ratio > 0:
                on_gpu[s.gpu].append(s)
        for gpu, running in on_gpu.items():
            n = len(running)
            contended_gpu[gpu] += n >= 2
            for s in running:
                modes[gpu] = s.mode
                busy[(s.tenant, gpu, s.mode)].append((s.received_ratio, 1.0 / n))
    tenants = []
    for ((namespace, pod, container), (node, uuid), mode), seen in busy.items():
        tenants.append(
            TenantInterference(
                namespace=namespace,
                pod=pod,
                container=container,
                node=node,
                gpu_uuid=uuid,
                mode=mode,
                busy_s=len(seen) * history.step_s,
                contended_s=sum(fair < 1 for _, fair in seen) * history.step_s,
                received_share=_mean([r for r, _ in seen]),
                fair_share=_mean([f for _, f in seen]),
            )
        )
    tenants.sort(key=lambda t: (-round(t.shortfall, 9), -t.contended_s, t.namespace, t.pod, t.container))
    gpus = []
    for gpu, mode in modes.items():
        mine = [t for t in tenants if (t.node, t.gpu_uuid) == gpu]
        worst = mine[0]  # tenants are ranked: the first of the GPU's is its worst
        gpus.append(
            GpuInterference(
                node=gpu[0],
                gpu_uuid=gpu[1],
                mode=mode,
                contended_s=contended_gpu[gpu] * history.step_s,
                worst_shortfall=worst.shortfall,
                worst_tenant=f"{worst.namespace}/{worst.pod}/{worst.container}",
            )
        )
    gpus.sort(key=lambda g: (-round(g.worst_shortfall, 9), -g.contended_s, g.node, g.gpu_uuid))
    return tenants, gpus


@dataclass(frozen=True, slots=True)
class CostRow:
    queue: str
    booked_gpu_hours: float
    whole_gpu_hours: float
    booked_cost: float | None
    whole_gpu_cost: float | None

    @property
    def saved_gpu_hours(self) -> float:
        return self.whole_gpu_hours - self.booked_gpu_hours


def cost(
    history: History, queue_of: Callable[[FractionSample], str], *, gpu_hour_price: float | None
) -> tuple[list[CostRow], int]:
    """Per queue: GPU-hours booked by fractions against one whole GPU per fraction, and their price.

    Also the number of samples left out because their GPU's memory was not exported (no share to
    book)."""
    hours: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    unpriced = 0
    each = history.step_s / 3600
    for _, samples in history.instants:
        for s in samples:
            if not s.fractional:
                continue
            if s.gpu_memory_bytes <= 0:
                unpriced += 1
                continue
            row = hours[queue_of(s)]
            row[0] += s.request_bytes / s.gpu_memory_bytes * each
            row[1] += each
    rows = [
        CostRow(
            queue,
            booked,
            whole,
            None if gpu_hour_price is None else booked * gpu_hour_price,
            None if gpu_hour_price is None else whole * gpu_hour_price,
        )
        for queue, (booked, whole) in hours.items()
    ]
    return sorted(rows, key=lambda r: (-r.saved_gpu_hours, r.queue)), unpriced


def queue_lookup(queues: Mapping[tuple[str, str], str]) -> Callable[[FractionSample], str]:
    """A sample's queue from ``(namespace, pod) → queue``; pods not in it: ``UNKNOWN_QUEUE``."""
    return lambda s: queues.get((s.namespace, s.pod), UNKNOWN_QUEUE)


def by_namespace(sample: FractionSample) -> str:
    return sample.namespace


@dataclass(frozen=True, slots=True)
class Report:
    source: str
    window_s: float
    density: Density
    memory_by_namespace: list[MemoryRow]
    memory_by_queue: list[MemoryRow]
    tenants: list[TenantInterference]
    gpus: list[GpuInterference]
    cost: list[CostRow]
    gpu_hour_price: float | None
    notes: list[str]

    def as_dict(self) -> dict[str, Any]:
        def rows(items: Iterable[Any], **extra: Callable[[Any], Any]) -> list[dict[str, Any]]:
            return [_camel({**asdict(i), **{k: f(i) for k, f in extra.items()}}) for i in items]

        dens = _camel(asdict(self.density))
        dens.pop("timeline")
        return {
            "kind": "GpufracReport",
            "source": self.source,
            "windowSeconds": self.window_s,
            "density": dens,
            "memory": {
                "byNamespace": rows(self.memory_by_namespace, idle_share=lambda r: r.idle_share),
                "byQueue": rows(self.memory_by_queue, idle_share=lambda r: r.idle_share),
            },
            "interference": {
                "tenants": rows(self.tenants, shortfall=lambda t: t.shortfall),
                "gpus": rows(self.gpus),
            },
            "cost": {
                "gpuHourPrice": self.gpu_hour_price,
                "byQueue": rows(self.cost, saved_gpu_hours=lambda r: r.saved_gpu_hours),
            },
            "notes": self.notes,
        }


def _camel(row: dict[str, Any]) -> dict[str, Any]:
    """kubectl's JSON spelling: ``gpus_saved`` → ``gpusSaved``."""
    return {k.split("_")[0] + "".join(w.title() for w in k.split("_")[1:]): v for k, v in row.items()}


TIME_SLICING_NOTE = (
    "time-slicing: NVML reports who ran kernels, not who waited with work queued, so the time a tenant "
    "waited while others ran cannot be measured; CONTENDED is the time it was busy alongside others and "
    "SHORTFALL what it got below an even split of the SMs then"
)


def build(
    history: History,
    *,
    source: str,
    queues: Mapping[tuple[str, str], str],
    gpu_hour_price: float | None,
    notes: Sequence[str] = (),
) -> Report:
    queue_of = queue_lookup(queues)
    tenants, gpus = interference(history)
    costs, unpriced = cost(history, queue_of, gpu_hour_price=gpu_hour_price)
    said = list(notes)
    if any(t.mode != "sm-sharing" for t in tenants):
        said.append(TIME_SLICING_NOTE)
    if unpriced:
        said.append(f"{unpriced} sample(s) left out of the cost: their GPU's memory was not exported")
    return Report(
        source=source,
        window_s=history.seconds,
        density=density(history),
        memory_by_namespace=memory(history, by_namespace),
        memory_by_queue=memory(history, queue_of),
        tenants=tenants,
        gpus=gpus,
        cost=costs,
        gpu_hour_price=gpu_hour_price,
        notes=said,
    )
