"""The report as one PNG: four panels a person would rather look at than read the tables.

Top left, density over the window: GPUs holding fractions against the whole GPUs the same fractions
would need, the gap (GPUs saved) shaded. Top right, memory per queue: used, idle booked, and the limit
headroom above the booking. Bottom left, the tenants with the largest interference: the share of the
SMs they received while busy against an even split. Bottom right, cost (or GPU-hours without a price)
per queue, booked fractions against whole GPUs.

matplotlib is imported only here and only when a plot is asked for (Agg backend, no display).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from gpufrac.kubectl.report import Report
from gpufrac.kubectl.report_text import GIB, TOP


def write(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ((dens, mem), (inter, cost)) = plt.subplots(2, 2, figsize=(14, 9))
    d = report.density
    figure.suptitle(
        f"gpufrac: {d.gpus_saved:.1f} GPUs saved ({100 * d.saved_share:.0f}%) by fractions, "
        f"{d.fractions_per_gpu:.2f} fractions per GPU\n{report.source}",
        fontsize=11,
    )
    times = [datetime.fromtimestamp(t, UTC) for t, _, _ in d.timeline]
    holding = [h for _, h, _ in d.timeline]
    needed = [n for _, _, n in d.timeline]
    if len(times) > 1:
        dens.plot(
            times,
            needed,
            label="whole GPUs needed (one per fraction)",
            color="tab:red",
            drawstyle="steps-post",
        )
        dens.plot(times, holding, label="GPUs holding fractions", color="tab:green", drawstyle="steps-post")
        dens.fill_between(times, holding, needed, color="tab:green", alpha=0.2, label="saved", step="post")
        dens.tick_params(axis="x", labelrotation=20)
    else:
        dens.bar(
            ["whole GPUs needed", "GPUs holding fractions"],
            [needed[0], holding[0]] if times else [0, 0],
            color=["tab:red", "tab:green"],
        )
    dens.set_title("Density")
    dens.set_ylabel("GPUs")
    dens.set_ylim(bottom=0)
    dens.legend(loc="upper left", fontsize=8) if len(times) > 1 else None

    rows = report.memory_by_queue[:TOP]
    names = [r.group for r in rows]
    used = [r.used_bytes / GIB for r in rows]
    idle = [r.idle_booked_bytes / GIB for r in rows]
    booked = [r.booked_bytes / GIB for r in rows]
    headroom = [max(0.0, (r.limit_bytes - r.booked_bytes) / GIB) for r in rows]
    mem.barh(names, [min(u, b) for u, b in zip(used, booked, strict=True)], color="tab:blue", label="used")
    mem.barh(
        names,
        idle,
        left=[b - i for b, i in zip(booked, idle, strict=True)],
        color="tab:orange",
        label="idle booked",
    )
    mem.barh(names, headroom, left=booked, color="lightgray", label="limit above booking")
    mem.set_title("Memory by queue (window mean)")
    mem.set_xlabel("GiB")
    mem.invert_yaxis()
    mem.legend(fontsize=8)

    tenants = report.tenants[:TOP]
    labels = [f"{t.namespace}/{t.pod}" for t in tenants]
    positions = range(len(tenants))
    inter.barh(
        [p - 0.2 for p in positions],
        [100 * t.received_share for t in tenants],
        height=0.4,
        color="tab:purple",
        label="received while busy",
    )
    inter.barh(
        [p + 0.2 for p in positions],
        [100 * t.fair_share for t in tenants],
        height=0.4,
        color="lightgray",
        label="even split (1/n busy)",
    )
    inter.set_yticks(list(positions), labels)
    inter.invert_yaxis()
    inter.set_xlabel("% of the GPU's SM time")
    inter.set_title("Interference: largest shortfall first")
    inter.legend(fontsize=8)

    priced = report.gpu_hour_price is not None
    queues = [r.queue for r in report.cost[:TOP]]
    unit = "cost" if priced else "GPU-hours"
    mine = [(r.booked_cost if priced else r.booked_gpu_hours) or 0.0 for r in report.cost[:TOP]]
    whole = [(r.whole_gpu_cost if priced else r.whole_gpu_hours) or 0.0 for r in report.cost[:TOP]]
    positions = range(len(queues))
    cost.bar([p - 0.2 for p in positions], whole, width=0.4, color="tab:red", label="whole GPUs")
    cost.bar([p + 0.2 for p in positions], mine, width=0.4, color="tab:green", label="booked fractions")
    cost.set_xticks(list(positions), queues, rotation=20)
    cost.set_ylabel(unit)
    cost.set_title(f"{'Cost' if priced else 'GPU-hours'} by queue")
    cost.legend(fontsize=8)

    for panel, rows, empty in (
        (mem, report.memory_by_queue, "no GPU memory booked in the window"),
        (inter, report.tenants, "no fraction was busy in the window:\nnothing to compare"),
        (cost, report.cost, "no fractions in the window"),
    ):
        if not rows:
            panel.cla()
            panel.set_axis_off()
            panel.text(0.5, 0.5, empty, ha="center", va="center", transform=panel.transAxes, color="gray")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
