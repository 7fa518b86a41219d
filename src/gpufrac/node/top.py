"""``gpufrac top``: per node and GPU, the fractions with request, limit, used and SM%, live.

It reads nothing but the agents' /metrics endpoints (the same series Prometheus scrapes), so what it
shows is what dashboards and alerts see, and it works from a laptop with a port-forward. Each refresh
scrapes every URL; an agent that does not answer is shown as unreachable and the others still render.
``--once`` prints one snapshot and exits (scripts, tests, CI logs).

A GPU in MIG mode is shown with its slices under it: each slice's profile and UUID, the container on it
(or free), the slice's memory as request and limit, and its used memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from gpufrac.node import metrics
from gpufrac.node.mapping import MIG_MODE

_FRACTION_VALUES = {
    metrics.FRACTION_MEMORY_REQUEST: "request",
    metrics.FRACTION_MEMORY_LIMIT: "limit",
    metrics.FRACTION_MEMORY_USED: "used",
    metrics.FRACTION_SM_UTILIZATION: "sm",
    metrics.FRACTION_COMPUTE_ENTITLEMENT: "entitled",
    metrics.FRACTION_COMPUTE_RECEIVED: "received",
}
_GPU_VALUES = {
    metrics.GPU_MEMORY_TOTAL: "total",
    metrics.GPU_MEMORY_ALLOCATED: "allocated",
    metrics.GPU_MEMORY_USED: "used",
}


_SLICE_VALUES = {metrics.MIG_SLICE_MEMORY_USED: "used", metrics.MIG_SLICE_MEMORY_TOTAL: "total"}


@dataclass
class SliceView:
    """One MIG slice: its profile, the container on it (empty: free) and its memory."""

    uuid: str
    profile: str
    occupant: tuple[str, str, str] = ("", "", "")
    values: dict[str, float] = field(default_factory=dict)
    #: The container's fraction series on the slice (SM% and compute shares), when it has them.
    fraction: dict[str, float] = field(default_factory=dict)


@dataclass
class GpuView:
    uuid: str
    index: str
    values: dict[str, float] = field(default_factory=dict)
    fractions: dict[tuple[str, str, str, str], dict[str, float]] = field(default_factory=dict)
    slices: dict[str, SliceView] = field(default_factory=dict)


@dataclass
class AgentView:
    url: str
    node: str
    gpus: dict[str, GpuView] = field(default_factory=dict)
    error: str | None = None


def parse_agent(*, url: str, text: str) -> AgentView:
    """One agent's exposition text → its node, GPUs and fractions."""
    view = AgentView(url=url, node=url)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if s.name == metrics.AGENT_INFO:
                view.node = labels.get("node", url)
                continue
            uuid = labels.get("gpu_uuid")
            if uuid is None:
                continue
            gpu = view.gpus.setdefault(uuid, GpuView(uuid=uuid, index=labels.get("gpu_index", "?")))
            if s.name in _SLICE_VALUES:
                piece = gpu.slices.setdefault(
                    labels["slice_uuid"], SliceView(uuid=labels["slice_uuid"], profile=labels["profile"])
                )
                if labels.get("container"):
                    piece.occupant = (labels["namespace"], labels["pod"], labels["container"])
                piece.values[_SLICE_VALUES[s.name]] = s.value
            elif s.name in _GPU_VALUES:
                gpu.values[_GPU_VALUES[s.name]] = s.value
            elif s.name in _FRACTION_VALUES:
                key = (labels["namespace"], labels["pod"], labels["container"], labels.get("mode", ""))
                gpu.fractions.setdefault(key, {})[_FRACTION_VALUES[s.name]] = s.value
    _fold_slices(view)
    return view


def _fold_slices(view: AgentView) -> None:
    """A slice's container has fraction series on the slice's UUID: they belong to the slice's row."""
    for gpu in list(view.gpus.values()):
        for piece in gpu.slices.values():
            as_gpu = view.gpus.pop(piece.uuid, None)
            if as_gpu is not None and as_gpu.fractions:
                piece.fraction = next(iter(as_gpu.fractions.values()))


def scrape(urls: list[str], *, timeout_s: float = 3.0) -> list[AgentView]:
    views = []
    with httpx.Client(timeout=timeout_s) as client:
        for url in map(metrics_url, urls):
            try:
                response = client.get(url)
                response.raise_for_status()
                views.append(parse_agent(url=url, text=response.text))
            except (httpx.HTTPError, ValueError) as error:
                views.append(AgentView(url=url, node=url, error=f"{type(error).__name__}: {error}"))
    return views


def metrics_url(address: str) -> str:
    """``host:port`` → ``http://host:port/metrics``; a full URL is kept as given."""
    url = address if "://" in address else f"http://{address}"
    return url if url.split("://", 1)[1].count("/") else f"{url}/metrics"


def render(views: list[AgentView]) -> Table:
    table = Table(title=f"gpufrac top — {time.strftime('%H:%M:%S')}", expand=False)
    for name, justify in (
        ("NODE", "left"),
        ("GPU", "left"),
        ("NAMESPACE/POD/CONTAINER", "left"),
        ("MODE", "left"),
        ("REQUEST", "right"),
        ("LIMIT", "right"),
        ("USED", "right"),
        ("SM%", "right"),
        ("ENTITLED%", "right"),
        ("RECEIVED%", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    for view in views:
        if view.error is not None:
            table.add_row(view.node, "-", f"[red]unreachable: {view.error}[/red]", *[""] * 7)
            continue
        for gpu in sorted(view.gpus.values(), key=lambda g: (len(g.index), g.index)):
            v = gpu.values
            held = f"{len(gpu.slices)} MIG slice(s)" if gpu.slices else f"{len(gpu.fractions)} fraction(s)"
            table.add_row(
                f"[bold]{view.node}[/bold]",
                f"[bold]{gpu.index}[/bold] {gpu.uuid[:12]}",
                f"[dim]{held} on {_bytes(v.get('total'))}[/dim]",
                "",
                _bytes(v.get("allocated")),
                "",
                _bytes(v.get("used")),
                "",
                "",
                "",
            )
            for (namespace, pod, container, mode), f in sorted(gpu.fractions.items()):
                over = f.get("used", 0) > f.get("limit", float("inf"))
                used = _bytes(f.get("used"))
                table.add_row(
                    "",
                    "",
                    f"{namespace}/{pod}/{container}",
                    mode,
                    _bytes(f.get("request")),
                    _bytes(f.get("limit")),
                    f"[red]{used}[/red]" if over else used,
                    _percent(f.get("sm")),
                    _percent(f.get("entitled")),
                    _percent(f.get("received")),
                )
            for piece in sorted(gpu.slices.values(), key=lambda p: (p.profile, p.uuid)):
                table.add_row(*_slice_row(piece))
    return table


def _slice_row(piece: SliceView) -> tuple[str, ...]:
    namespace, pod, container = piece.occupant
    total, f = _bytes(piece.values.get("total")), piece.fraction
    return (
        "",
        f"└ {piece.profile} {piece.uuid[:16]}",
        f"{namespace}/{pod}/{container}" if container else "[dim]free[/dim]",
        MIG_MODE,
        total,
        total,
        _bytes(piece.values.get("used")),
        _percent(f.get("sm")),
        _percent(f.get("entitled")),
        _percent(f.get("received")),
    )


def top(
    urls: list[str] = typer.Argument(..., help="agents' metrics URLs or host:port, e.g. 10.0.0.7:9400"),
    once: bool = typer.Option(False, "--once", help="print one snapshot and exit"),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="seconds between refreshes"),
) -> None:
    """Per node and GPU: the fractions with request, limit, used memory and SM%, live."""
    console = Console() if Console().is_terminal else Console(width=200)
    if once:
        views = scrape(urls)
        console.print(render(views))
        if all(v.error is not None for v in views):
            raise typer.Exit(code=1)
        return
    with Live(render(scrape(urls)), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(Group(render(scrape(urls))))
        except KeyboardInterrupt:
            pass


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1024**3:
        return f"{value / 1024**3:.1f}Gi"
    return f"{value / 1024**2:.0f}Mi"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}"
