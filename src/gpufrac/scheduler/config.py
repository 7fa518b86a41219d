"""The scheduler's configuration file: one pydantic model, validated before anything starts.

Every knob has a default that works for the embedded cluster, so the file is optional; a key the model
does not know is an error (a misspelt knob that silently keeps its default is the worst kind of
configuration bug). Flags of ``gpufrac scheduler`` override the file. docs/scheduler.md documents each
field with an example file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpufrac.contract import keys
from gpufrac.placement.policies import DEFAULT_POLICY


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QueueConfig(_Strict):
    """A queue pods join with the ``gpufrac.io/queue`` (or ``kai.scheduler/queue``) label."""

    name: str
    gpu_memory_limit_mib: int | None = Field(default=None, ge=1)
    """Cap on the guaranteed GPU memory of the queue's placed pods; none by default."""
    deserved_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of the cluster's GPU memory the queue deserves; queues furthest below it go first."""
    preempt_min_runtime_s: float | None = Field(default=None, ge=0.0)
    """A pod of the queue runs this long before preemption may evict it (a Queue's preemptMinRuntime)."""
    reclaim_min_runtime_s: float | None = Field(default=None, ge=0.0)
    """A pod of the queue runs this long before reclaim may evict it (a Queue's reclaimMinRuntime)."""


class LeaderElectionConfig(_Strict):
    """client-go's timing; only the holder of the Lease binds."""

    enabled: bool = True
    lease_name: str = "gpufrac-scheduler"
    lease_namespace: str = "kube-system"
    lease_duration_s: float = Field(default=15.0, gt=0)
    renew_deadline_s: float = Field(default=10.0, gt=0)
    retry_period_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElectionConfig:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("leader_election needs retry_period_s < renew_deadline_s < lease_duration_s")
        return self


class ConsolidationConfig(_Strict):
    """Moving movable pods so that a pod that fits nowhere because free GPU memory is fragmented gets
    room (docs/scheduler.md, "Consolidation")."""

    enabled: bool = False
    max_moves_per_minute: int = Field(default=4, ge=1)
    """The bound on disruption: moves average at most this many a minute and come at most this many at
    once; a plan that needs more waits (the pod says so)."""


class MigConfig(_Strict):
    """MIG layouts (docs/mig.md, "Dynamic layouts")."""

    dynamic: bool = True
    """Ask node agents to re-partition idle GPUs (``gpufrac.io/gpu-layout``) when MIG pods wait that no
    free slice serves, and to give idle MIG or whole GPUs back to fractions when fractions wait that no
    pool holds. False: place only on the layouts the nodes publish."""
    fill: bool = True
    """Fill the rest of a GPU laid out for waiting pods with free slices, in the mix of profiles the
    waiting and the last 64 planned MIG pods asked for, then the smallest profile, so the next MIG pods
    land on them with no new change. False: lay out the waiting pods' slices only."""
    change_timeout_s: float = Field(default=300.0, gt=0)
    """A change the node agent has not answered (done, or refused) in this long is given up: the GPU takes
    bookings again."""
    retry_refused_s: float = Field(default=60.0, ge=0)
    """A GPU whose change was refused or failed is not asked again for this long."""


class MinRuntimeConfig(_Strict):
    """Min-runtimes for queues that set none on their path (docs/queues.md, "Min-runtime")."""

    preempt_s: float = Field(default=0.0, ge=0.0)
    reclaim_s: float = Field(default=0.0, ge=0.0)


class TimeFairnessConfig(_Strict):
    """Time-based fair share (docs/queues.md, "Time-based fair share"): a queue's past use, decayed with
    this half-life, lowers its part of the over-quota GPUs and raises the part of queues that used less.
    Off while ``k`` is 0 (the default): the fair share is then the plain weighted one."""

    k: float = Field(default=0.0, ge=0.0)
    """How much past use counts (KAI Scheduler's ``kValue``): 0 off, 1 a queue that used twice its
    weight's part gets none of the over-quota part while others ask."""
    half_life_s: float = Field(default=3600.0, gt=0)
    """Usage this long ago counts half as much as usage now."""
    counted: Literal["over-quota", "all"] = "over-quota"
    """What counts as use: what a queue held above its deserved quota (the default: the guarantee is not
    charged), or all it held (KAI Scheduler's rule)."""


class SchedulerConfig(_Strict):
    scheduler_name: str = keys.DEFAULT_SCHEDULER_NAME
    """Pods whose ``spec.schedulerName`` equals this are ours."""

    node_selector: str = f"{keys.MANAGED_LABEL}=true"
    """Label selector of the nodes this scheduler places on (the managed nodes; narrow it to shard)."""

    policy: str = DEFAULT_POLICY
    """Placement policy of the engine (a name in ``gpufrac.placement.policies.POLICIES``); a pod may
    override it. The default is the one within 0.1 point of the best of the others on every measured
    workload (docs/placement.md, "Which policy by default")."""

    mode_policy: Literal["Required", "Preferred"] = "Required"
    """Required: a pod only goes to GPUs of its compute mode (or empty ones). Preferred: it may fall
    back to a GPU of the other mode when none fits; a GPU never holds both modes."""

    preemption: bool = True
    """When a pod fits nowhere, evict lower-priority pods of its queue, or reclaim from queues above
    their deserved share for a queue below its own (through the Eviction API; docs/scheduler.md)."""

    preemption_delay_s: float = Field(default=0.0, ge=0.0)
    """A pending pod evicts nobody (preemption, reclaim or consolidation) until this long after its
    creation, so a node autoscaler can add room first; its message says until when. 0: at once."""

    min_runtime: MinRuntimeConfig = MinRuntimeConfig()
    """How long a pod runs before preemption (``preempt_s``) or reclaim (``reclaim_s``) may evict it, where
    neither its queue nor an ancestor sets a minimum; 0: none."""

    consolidation: ConsolidationConfig = ConsolidationConfig()
    """When a pod still fits nowhere (no preemption or reclaim helps) and only because free GPU memory is
    fragmented, evict movable pods (``gpufrac.io/movable: "true"`` and a controller owner) that have a
    new home elsewhere; off by default."""

    mig: MigConfig = MigConfig()
    """MIG layouts: ``dynamic`` (default true) lets the scheduler ask node agents to re-partition idle
    GPUs for waiting pods (docs/mig.md)."""

    sm_sharing_tenancy: Literal["namespace", "shared"] = "namespace"
    """namespace: an sm-sharing GPU holds pods of one namespace only (MPS merges error domains).
    shared: any namespaces may share it."""

    overcommit_cap: float | None = Field(default=None, ge=1.0)
    """When set, the sum of LIMITS on a GPU may not exceed cap x its memory (requests never exceed 1x)."""

    queues: tuple[QueueConfig, ...] = (QueueConfig(name="default"),)
    """Queues for clusters without the Queue CRD, and back-compatibility: a Queue object (or KAI queue) of
    the same name takes precedence (docs/queues.md)."""
    default_queue: str = "default"
    time_fairness: TimeFairnessConfig = TimeFairnessConfig()
    queue_status_interval_s: float | None = Field(default=5.0, gt=0)
    """How often the leader refreshes Queue objects' status (only queues whose status changed are written).
    None: this scheduler writes no Queue status (run several schedulers, e.g. shards of the nodes, and
    let one of them write it: each sees only its own nodes and pods)."""

    batch_window_ms: float = Field(default=10.0, ge=0.0)
    """How long to wait after the first pending pod for others, so a burst is placed as one batch."""
    max_batch: int = Field(default=512, ge=1)
    cycle_budget_ms: float = Field(default=25.0, gt=0.0)
    """How long one scheduling cycle should hold the event loop: a cycle takes as many pods (at least 8,
    at most ``max_batch``) as fit in it at the per-pod cost measured so far (``cycle_pace``)."""

    bind_mode: Literal["atomic", "patch-then-bind"] = "atomic"
    """atomic: one Binding that carries the annotations (applied with nodeName in one update).
    patch-then-bind: a preconditioned annotation patch, then the Binding, rolled back on failure."""
    bind_concurrency: int = Field(default=128, ge=1)
    """Binds in flight at once. Each holds its slot for a round trip to the API server (a claim pod's for
    three), so this caps the pods bound per second at about ``bind_concurrency`` / that round trip: at 32
    a busy API server's 60 ms answers held binds behind a 550 pods/s create burst (docs/benchmarks.md).
    kube-scheduler binds every pod in a goroutine of its own, no cap."""
    backoff_initial_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    assumed_ttl_s: float = Field(default=30.0, gt=0)
    """A bind that succeeded but that the watch has not shown within this long releases its booking
    (kube-scheduler's assumed-pod expiry; the pod was deleted while the watch was away)."""

    unschedulable_resync_s: float = Field(default=60.0, gt=0)
    """Unschedulable pods are retried at once when the cluster changes, and at least this often."""

    node_heartbeat_expiry_s: float | None = Field(default=180.0, gt=0)
    """A node is not placeable once its node agent's heartbeat (the ``renewTime`` of its Lease in
    ``node_lease_namespace``, or the ``lastHeartbeatTime`` of its ``gpu-fractioning.nvidia.com/Ready``
    condition when that is newer: ``gpufrac.kube.heartbeat``) is older than this. The agent renews its
    Lease every ``heartbeat_s`` (10 s by default); keep this at least four times that (40 s is what the
    kubelet's Lease tolerates). None turns the check off (a node agent that never heartbeats)."""

    node_lease_namespace: str = Field(default=keys.NODE_LEASE_NAMESPACE, min_length=1)
    """Where the node agents' heartbeat Leases are (one per node, named after it)."""

    dra: bool = True
    """Allocate ResourceClaims of gpufrac's DRA driver and book every allocated claim of it (whoever
    allocated it) in the same ledger as annotation pods (docs/dra.md). Needs ``resource.k8s.io/v1``
    (Kubernetes 1.34+); on an older cluster the claim informers find the API not served, sync empty
    with one warning and look again every minute, so nothing else changes (the chart also sets it to
    false there, which saves the three watches)."""

    device_names: Literal["uuid", "cdi"] = "uuid"
    """How ``.gpus.devices`` names GPUs: physical UUIDs, or CDI names (``nvidia.com/gpu=<uuid>``)."""

    leader_election: LeaderElectionConfig = LeaderElectionConfig()

    http_host: str = "0.0.0.0"
    http_port: int = Field(default=10259, ge=0, le=65535)
    """/healthz, /readyz and /metrics; 0 picks a free port (it is logged)."""

    @model_validator(mode="after")
    def _default_queue_exists(self) -> SchedulerConfig:
        names = [q.name for q in self.queues]
        if len(set(names)) != len(names):
            raise ValueError("queue names must be unique")
        if self.default_queue not in names:
            raise ValueError(f"default_queue {self.default_queue!r} is not one of the queues {names}")
        return self


def load_config(path: Path | None, **overrides: object) -> SchedulerConfig:
    """The file's configuration (defaults without a file) with ``overrides`` that are not None."""
    data: dict[str, object] = {}
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the scheduler configuration must be a mapping")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return SchedulerConfig.model_validate(data)
