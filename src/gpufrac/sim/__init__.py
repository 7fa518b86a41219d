"""Trace replay: the openb GPU-sharing trace (or any pod CSV in its format) through the placement engine.

The simulator owns nothing about placement: it builds ``NodeSpec``s and ``PendingPod``s from trace rows
and drives ``gpufrac.placement.Engine``, the scheduler service's engine, so its figures are the
product's. Modules: ``trace`` (files, data directory), ``workload`` (the published sampling protocol and
row translation), ``scenarios`` (variants with both compute modes, or as DRA claims), ``replay`` (one
run and its metrics), ``metrics``, ``experiment`` (many runs in worker processes), ``report`` (table,
JSON, PNG), ``synthetic`` (a generated trace for tests), ``paper`` (the published means), ``mig_workload`` and
``mig_replay`` (scenario ``mig``: static MIG layouts, dynamic layouts and fractions only, side by side;
``mig_churn`` the same with departures),
``command`` (``gpufrac simulate``).

Programmatic use::

    from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file
    from gpufrac.sim.replay import replay
    result = replay(trace="default", nodes=load_nodes(node_file()), pods=load_pods(pod_file("default")),
                    policy="fgd-align", seed=42)
    result.alloc_130, result.unallocated_gpus_130, result.placements_per_s
"""
