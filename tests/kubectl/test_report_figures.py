"""The report's figures over a history small enough to work out by hand (docs/metrics.md, "The report's
figures"): two instants a minute apart; GPU G1 holds two time-slicing fractions of namespace a, G2 two
sm-sharing fractions of namespace b (at the first instant only), G3 one whole-GPU tenant of b. GPUs have
80 GiB; amounts below are GiB."""

from __future__ import annotations

import pytest

from gpufrac.kubectl.report import (
    TIME_SLICING_NOTE,
    UNKNOWN_QUEUE,
    FractionSample,
    History,
    build,
    by_namespace,
    cost,
    density,
    interference,
    memory,
    queue_lookup,
)

GIB = 2**30


def sample(ns, pod, gpu, mode, request, limit, used, sm, received, memory_gib=80) -> FractionSample:
    return FractionSample(
        node="n1",
        namespace=ns,
        pod=pod,
        container="c",
        gpu_uuid=gpu,
        mode=mode,
        request_bytes=request * GIB,
        limit_bytes=limit * GIB,
        used_bytes=used * GIB,
        sm_ratio=sm,
        received_ratio=received,
        gpu_memory_bytes=memory_gib * GIB,
    )


WHOLE = sample("b", "p4", "G3", "time-slicing", 80, 80, 50, 0.9, 1.0)
HISTORY = History(
    instants=[
        (
            0.0,
            [
                sample("a", "p1", "G1", "time-slicing", 20, 40, 10, 0.6, 0.75),
                sample("a", "p2", "G1", "time-slicing", 20, 20, 20, 0.2, 0.25),
                sample("b", "p3", "G2", "sm-sharing", 40, 40, 0, 0.5, 0.4),
                sample("b", "p5", "G2", "sm-sharing", 20, 20, 20, 0.7, 0.6),
                WHOLE,
            ],
        ),
        (
            60.0,
            [
                sample("a", "p1", "G1", "time-slicing", 20, 40, 30, 0.5, 1.0),
                sample("a", "p2", "G1", "time-slicing", 20, 20, 20, 0.0, 0.0),
                WHOLE,
            ],
        ),
    ],
    step_s=60.0,
)
QUEUES = {("a", "p1"): "q-infer", ("a", "p2"): "q-infer", ("b", "p3"): "q-train"}


def test_density_counts_fractions_against_one_gpu_each_and_leaves_whole_gpus_out() -> None:
    d = density(HISTORY)
    # 4 fractions on 2 GPUs, then 2 on 1: means 3 and 1.5; the whole-GPU tenant on G3 is in neither.
    assert (d.fractions, d.gpus_holding_fractions, d.whole_gpus_needed) == (3.0, 1.5, 3.0)
    assert d.gpus_saved == 1.5
    assert d.saved_share == 0.5
    assert d.fractions_per_gpu == 2.0
    assert d.timeline == [(0.0, 2, 4), (60.0, 1, 2)]


def test_memory_per_namespace_is_the_window_mean_of_booked_limit_used_and_idle_booked() -> None:
    rows = {r.group: r for r in memory(HISTORY, by_namespace)}
    a, b = rows["a"], rows["b"]
    # a: booked 40 both times; used 30 then 50; idle (20-10)+0 = 10, then max(0, 20-30)+0 = 0.
    assert (a.booked_bytes, a.limit_bytes, a.used_bytes, a.idle_booked_bytes) == tuple(
        x * GIB for x in (40, 60, 40, 5)
    )
    # b: 140/140/70 idle 70 (p3 40 + G3's 30), then the whole GPU alone 80/80/50 idle 30.
    assert (b.booked_bytes, b.limit_bytes, b.used_bytes, b.idle_booked_bytes) == tuple(
        x * GIB for x in (110, 110, 60, 50)
    )
    assert b.idle_share == pytest.approx(50 / 110)
    assert [r.group for r in memory(HISTORY, by_namespace)] == ["b", "a"]  # the most idle first


def test_memory_per_queue_puts_pods_nobody_named_a_queue_for_under_unknown() -> None:
    rows = memory(HISTORY, queue_lookup(QUEUES))
    assert [(r.group, r.booked_bytes / GIB, r.idle_booked_bytes / GIB) for r in rows] == [
        (UNKNOWN_QUEUE, 90, 30),
        ("q-train", 20, 20),
        ("q-infer", 40, 5),
    ]


def test_interference_is_the_share_received_while_busy_against_an_even_split() -> None:
    tenants, gpus = interference(HISTORY)
    got = [(t.pod, t.busy_s, t.contended_s, t.received_share, t.fair_share) for t in tenants]
    assert got == [
        ("p2", 60.0, 60.0, 0.25, 0.5),  # busy once, beside p1: a quarter of the SMs for a half's right
        ("p3", 60.0, 60.0, 0.4, 0.5),
        ("p5", 60.0, 60.0, 0.6, 0.5),
        ("p1", 120.0, 60.0, 0.875, 0.75),  # alone at 60 s: 1 of 1 counts as even
    ]
    assert [round(t.shortfall, 6) for t in tenants] == [0.25, 0.1, -0.1, -0.125]
    assert all(t.pod != "p4" for t in tenants)  # nobody shares a whole GPU
    assert [(g.gpu_uuid, g.contended_s, g.worst_tenant, round(g.worst_shortfall, 6)) for g in gpus] == [
        ("G1", 60.0, "a/p2/c", 0.25),
        ("G2", 60.0, "b/p3/c", 0.1),
    ]


def test_cost_prices_booked_fractions_against_a_whole_gpu_each_per_queue() -> None:
    rows, unpriced = cost(HISTORY, queue_lookup(QUEUES), gpu_hour_price=3.0)
    assert unpriced == 0
    by_queue = {r.queue: r for r in rows}
    infer = by_queue["q-infer"]
    # Two quarter-GPU fractions for two minutes: 1 GPU-minute booked; 4 GPU-minutes as whole GPUs.
    assert infer.booked_gpu_hours == pytest.approx(1 / 60)
    assert infer.whole_gpu_hours == pytest.approx(4 / 60)
    assert (infer.booked_cost, infer.whole_gpu_cost) == (pytest.approx(0.05), pytest.approx(0.2))
    assert by_queue["q-train"].booked_gpu_hours == pytest.approx(0.5 / 60)
    assert by_queue[UNKNOWN_QUEUE].whole_gpu_hours == pytest.approx(1 / 60)  # p5 only: G3 is whole
    assert [r.queue for r in rows] == ["q-infer", UNKNOWN_QUEUE, "q-train"]  # the most saved first
    unpriced_rows, _ = cost(HISTORY, queue_lookup(QUEUES), gpu_hour_price=None)
    assert all(r.booked_cost is None and r.whole_gpu_cost is None for r in unpriced_rows)


def test_a_fraction_on_a_gpu_of_unknown_memory_is_counted_but_not_priced_and_the_report_says_so() -> None:
    history = History([(0.0, [sample("a", "p1", "G1", "sm-sharing", 20, 20, 0, 0, 0, memory_gib=0)])], 60)
    assert density(history).fractions == 1
    report = build(history, source="test", queues={}, gpu_hour_price=1.0)
    assert report.cost == []
    assert "1 sample(s) left out of the cost: their GPU's memory was not exported" in report.notes


def test_the_report_says_what_time_slicing_cannot_measure_and_serializes_every_figure() -> None:
    report = build(HISTORY, source="test", queues=QUEUES, gpu_hour_price=3.0)
    assert TIME_SLICING_NOTE in report.notes and "cannot be measured" in TIME_SLICING_NOTE
    data = report.as_dict()
    assert data["windowSeconds"] == 120.0
    assert data["density"]["gpusSaved"] == 1.5
    assert data["interference"]["tenants"][0]["shortfall"] == 0.25
    assert data["cost"]["byQueue"][0]["savedGpuHours"] == pytest.approx(3 / 60)
