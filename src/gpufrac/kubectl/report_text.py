"""The report as kubectl-style tables: one titled section per figure, numbers a person can read.

Sections are returned as data (title, headers, rows) and printed by the command's table printer, so
``report`` lines up exactly as ``nodes`` and ``queues`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufrac.kubectl.report import CostRow, GpuInterference, MemoryRow, Report, TenantInterference
from gpufrac.kubectl.report_whatif import FRACTIONS, WHOLE_GPUS, WhatIfRow

GIB = 2**30
#: Rows shown per ranked list in the table (``-o json`` has all).
TOP = 10


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    headers: list[str]
    rows: list[list[Any]]


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 60:.0f}m" if seconds >= 60 else f"{seconds:.0f}s"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _memory(title: str, rows: list[MemoryRow]) -> Section:
    headers = [
        title.split()[-1].upper(),
        "BOOKED(GiB)",
        "LIMIT(GiB)",
        "USED(GiB)",
        "IDLE-BOOKED(GiB)",
        "IDLE",
    ]
    return Section(
        title,
        headers,
        [
            [
                r.group,
                *map(_gib, (r.booked_bytes, r.limit_bytes, r.used_bytes, r.idle_booked_bytes)),
                _pct(r.idle_share),
            ]
            for r in rows
        ],
    )


def header(report: Report) -> list[str]:
    d = report.density
    return [
        f"Source:   {report.source}",
        f"Density:  {d.fractions:.1f} fractions on {d.gpus_holding_fractions:.1f} GPUs "
        f"({d.fractions_per_gpu:.2f} per GPU); whole GPUs would need {d.whole_gpus_needed:.1f}: "
        f"{d.gpus_saved:.1f} GPUs saved ({_pct(d.saved_share)})",
    ]


def _tenant(t: TenantInterference) -> list[Any]:
    return [
        f"{t.namespace}/{t.pod}/{t.container}",
        f"{t.node}/{t.gpu_uuid[:12]}",
        t.mode,
        _duration(t.busy_s),
        _duration(t.contended_s),
        _pct(t.received_share),
        _pct(t.fair_share),
        f"{100 * t.shortfall:+.1f}pt",
    ]


def _gpu(g: GpuInterference) -> list[Any]:
    worst = f"{100 * g.worst_shortfall:+.1f}pt"
    return [f"{g.node}/{g.gpu_uuid[:12]}", g.mode, _duration(g.contended_s), worst, g.worst_tenant]


def _cost(r: CostRow) -> list[Any]:
    hours = (r.booked_gpu_hours, r.whole_gpu_hours, r.saved_gpu_hours)
    return [r.queue, *(f"{h:.2f}" for h in hours), _money(r.booked_cost), _money(r.whole_gpu_cost)]


def sections(report: Report) -> list[Section]:
    hours = "GPU-H/H" if report.source.startswith("snapshot") else "GPU-HOURS"
    return [
        _memory("Memory by queue", report.memory_by_queue),
        _memory("Memory by namespace", report.memory_by_namespace),
        Section(
            "Interference by tenant (largest shortfall first)",
            ["TENANT", "GPU", "MODE", "BUSY", "CONTENDED", "RECEIVED", "EVEN-SPLIT", "SHORTFALL"],
            [_tenant(t) for t in report.tenants[:TOP]],
        ),
        Section(
            "Interference by GPU",
            ["GPU", "MODE", "CONTENDED", "WORST-SHORTFALL", "WORST-TENANT"],
            [_gpu(g) for g in report.gpus[:TOP]],
        ),
        Section(
            f"Cost by queue (price {_money(report.gpu_hour_price)} per GPU-hour)",
            [
                "QUEUE",
                f"BOOKED-{hours}",
                f"WHOLE-{hours}",
                f"SAVED-{hours}",
                "BOOKED-COST",
                "WHOLE-GPU-COST",
            ],
            [_cost(r) for r in report.cost],
        ),
    ]


WHAT_IF_HEADERS = [
    "POLICY",
    "FRACTIONS-PLACED",
    "FRACTIONS-GPUS",
    "WHOLE-PLACED",
    "WHOLE-GPUS",
    "MORE-PODS-WITH-FRACTIONS",
]


def what_if_section(rows: list[WhatIfRow]) -> Section:
    """Per policy, as booked against a whole GPU per device: pods placed, left out, GPUs taken."""
    by_policy: dict[str, dict[str, WhatIfRow]] = {}
    for r in rows:
        by_policy.setdefault(r.policy, {})[r.allocation] = r
    table = []
    for policy, pair in by_policy.items():
        mine, whole = pair[FRACTIONS], pair[WHOLE_GPUS]
        placed = (f"{mine.placed}/{mine.pods}", f"{mine.gpus_used}/{mine.gpus}")
        placed_whole = (f"{whole.placed}/{whole.pods}", f"{whole.gpus_used}/{whole.gpus}")
        table.append([policy, *placed, *placed_whole, whole.left_out - mine.left_out])
    return Section(
        "What if whole GPUs (the window's pods placed again by the engine)",
        WHAT_IF_HEADERS,
        table,
    )
