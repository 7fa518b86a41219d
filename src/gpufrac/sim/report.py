"""Reports of an experiment: per-policy means as a table, machine-readable JSON, and a PNG of the curves.

The offline reference (``replay.offline_bound``) is shown as a bound, never as a policy: its row is
labelled ``BOUND_LABEL`` with a caption saying what it is, its JSON entries carry ``"bound": true``,
and the plot marks it as one point at 130 %.

matplotlib is imported only when a plot is written (Agg backend, no display), so the table and JSON
paths stay fast to start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from .churn import ChurnResult
from .experiment import by_policy, mean
from .metrics import CURVE_POINTS
from .paper import published
from .replay import BOUND_POLICY, RunResult

BOUND_LABEL = "bound: offline"
BOUND_NOTE = (
    f"bound: offline = not a policy: the same workload known in advance, placed largest first with "
    f"{BOUND_POLICY} (@130% only)"
)
#: A share of capacity no arrival landed on exactly (a cluster of a few GPUs), and the caption that says so.
UNREACHED = "-"
UNREACHED_NOTE = (
    "-: no arrival brought the offered load to exactly that share of GPU capacity (each pod is a large "
    "step on a cluster of few GPUs)."
)


def summary_rows(trace: str, results: Sequence[RunResult], scenario: str = "plain") -> list[dict[str, Any]]:
    """Per-policy means; the paper's figure only where it measured the same workload."""
    rows = []
    for policy, runs in by_policy(results).items():
        bound = runs[0].bound
        paper = published(trace, policy) if scenario == "plain" and not bound else None
        rows.append(
            {
                "policy": policy,
                "bound": bound,
                "seeds": len(runs),
                "alloc_100": round(mean([r.alloc_100 for r in runs]), 3),
                "alloc_130": round(mean([r.alloc_130 for r in runs]), 3),
                "unallocated_gpus_130": round(mean([r.unallocated_gpus_130 for r in runs]), 1),
                "frag_rate_90": round(mean([r.frag_rate_90 for r in runs]), 2),
                "frag_rate_end": round(mean([r.frag_rate_end for r in runs]), 2),
                "placed": round(mean([r.placed for r in runs]), 1),
                "failed": round(mean([r.failed for r in runs]), 1),
                "placements_per_s": round(mean([r.placements_per_s for r in runs]), 1),
                "paper_130": paper[1] if paper else None,
            }
        )
    return rows


def table(trace: str, results: Sequence[RunResult], scenario: str = "plain") -> Table:
    suffix = "" if scenario == "plain" else f", scenario {scenario}"
    bounded = any(r.bound for r in results)
    rows = summary_rows(trace, results, scenario)
    unreached = any(
        math.isnan(row[key]) for row in rows if not row["bound"] for key in ("alloc_100", "alloc_130")
    )
    notes = [note for note, shown in ((BOUND_NOTE, bounded), (UNREACHED_NOTE, unreached)) if shown]
    t = Table(
        title=f"GPU allocation on trace {trace}{suffix} (mean over seeds)",
        caption="\n".join(notes) or None,
    )
    headers = ("policy", "seeds", "@100%", "@130%", "paper @130%", "unalloc. GPUs", "frag % @90%", "placed/s")
    for header in headers:
        if header == "policy":
            widest = max(len(BOUND_LABEL if r.bound else r.policy) for r in results)
            t.add_column(header, no_wrap=True, min_width=widest)
        else:
            t.add_column(header, justify="right")
    for row in rows:
        paper = row["paper_130"]
        t.add_row(
            BOUND_LABEL if row["bound"] else row["policy"],
            str(row["seeds"]),
            _cell(row["alloc_100"]),
            _cell(row["alloc_130"]),
            "" if paper is None else f"{paper:.2f}",
            _cell(row["unallocated_gpus_130"], 0),
            _cell(row["frag_rate_90"], 1),
            f"{row['placements_per_s']:.0f}",
        )
    return t


def _cell(value: float, digits: int = 2) -> str:
    return UNREACHED if math.isnan(value) else f"{value:.{digits}f}"


def as_json(trace: str, scenario: str, results: Sequence[RunResult]) -> dict[str, Any]:
    return {
        "trace": trace,
        "scenario": scenario,
        "runs": [
            {
                "policy": r.policy,
                "bound": r.bound,
                "window": r.window,
                "seed": r.seed,
                "alloc_100": _finite(r.alloc_100),
                "alloc_130": _finite(r.alloc_130),
                "unallocated_gpus_100": _finite(r.unallocated_gpus_100),
                "unallocated_gpus_130": _finite(r.unallocated_gpus_130),
                "placed": r.placed,
                "failed": r.failed,
                "placements_per_s": round(r.placements_per_s, 1),
                "frag_rate_90": _finite(r.frag_rate_90),
                "frag_rate_end": _finite(r.frag_rate_end),
            }
            for r in results
        ],
        "policies": [
            {k: _finite(v) if isinstance(v, float) else v for k, v in row.items()}
            for row in summary_rows(trace, results, scenario)
        ],
    }


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def plot(trace: str, results: Sequence[RunResult], path: Path) -> Path:
    """Allocation vs arrival and fragmentation rate vs arrival, one line per policy (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (alloc_ax, zoom_ax, frag_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    zoom = CURVE_POINTS >= 80
    for policy, runs in by_policy(results).items():
        if runs[0].bound:
            value = mean([r.alloc_130 for r in runs])
            for ax in (alloc_ax, zoom_ax):
                ax.plot([130], [value], marker="*", linestyle="none", color="black", label=BOUND_LABEL)
            continue
        alloc = [mean([r.curve[i] for r in runs if i < len(r.curve)]) for i in range(CURVE_POINTS.size)]
        alloc_ax.plot(CURVE_POINTS, alloc, label=policy)
        zoom_ax.plot(CURVE_POINTS[zoom], [a for a, z in zip(alloc, zoom, strict=True) if z], label=policy)
        points = sorted((x, y) for r in runs for x, y in r.frag_curve)
        if points:
            buckets: dict[int, list[float]] = {}
            for x, y in points:
                buckets.setdefault(round(x), []).append(y)
            xs = sorted(buckets)
            frag_ax.plot(xs, [mean(buckets[x]) for x in xs], label=policy)
    alloc_ax.plot(CURVE_POINTS, CURVE_POINTS, color="grey", linestyle=":", linewidth=0.8, label="arrived")
    alloc_ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="allocated GPU (% of capacity)")
    alloc_ax.set_ylim(0, 100)
    alloc_ax.set_title(f"{trace}: allocation vs arrival")
    alloc_ax.legend(loc="lower right")
    zoom_ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="allocated GPU (% of capacity)")
    zoom_ax.set_title("from 80% arrival")
    zoom_ax.grid(alpha=0.3)
    zoom_ax.legend(loc="lower right")
    frag_ax.set(xlabel="arrived GPU demand (% of capacity)", ylabel="fragmented share of free GPU (%)")
    frag_ax.set_title("fragmentation rate")
    frag_ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_churn(trace: str, runs: Sequence[ChurnResult], path: Path) -> Path:
    """Per queue, its share of the cluster's GPU memory over time against its fair share over time
    (dashed) and its deserved share (dotted), one panel per run (each reclaim rule; then with
    consolidation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        hours = [t / 3600 for t, _ in run.timeline]
        for q in run.queues:
            line = ax.plot(hours, [shares.get(q.queue, 0.0) for _, shares in run.timeline], label=q.queue)
            color = line[0].get_color()
            fair = [shares.get(q.queue, 0.0) for _, shares in run.fair_timeline]
            if fair:
                ax.plot(
                    [t / 3600 for t, _ in run.fair_timeline], fair, color=color, linestyle="--", linewidth=0.8
                )
            ax.axhline(q.deserved_share, color=color, linestyle=":", linewidth=0.8)
        ax.set(xlabel="hours", ylabel="share of cluster GPU memory (dashed: fair share; dotted: deserved)")
        rule = run.reclaim_rule or ("on" if run.reclaim else "off")
        title = f"{trace}: reclaim {rule} ({run.preemptions} preemptions, Jain {run.jain_index:.3f})"
        if run.consolidation:
            title += f", consolidation ({run.moves} moves)"
        ax.set_title(title)
        ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
