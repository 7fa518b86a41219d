"""The pure scheduling core: cluster model, per-GPU ledgers, filters, policies, queues and the engine.

No I/O. The scheduler service builds a snapshot from its informers and the simulator builds one from a
trace; both run this same engine, so a quality figure from a trace replay is a figure of the product.

Public API (what the scheduler service calls)::

    engine = Engine(policy="fgd", seed=0, rules=GpuRules(...), queues=[Queue(...)], typical=None)
    engine.add_node(NodeSpec(...))            # node with its GpuDevices (uuid, index, MiB)
    engine.update_node(NodeSpec(...))         # -> uids dropped because their GPUs vanished
    engine.remove_node(name)                  # -> uids that were held on it
    engine.assume(pod, placement)             # book a bound pod (its binding read by the scheduler's
                                              #   objects.bound_placement); rebuilds ledgers at start
    engine.forget(uid)                        # release a pod (deleted, finished, bind failed)
    engine.hold(key, placement, namespace=ns)  # shares no pod holds (a DRA claim, a preemptor's room):
    engine.release_hold(key); engine.held(key)  #   GPU charges only: no pod slot, never a victim
    engine.schedule(pods, gang=False)         # -> [Placement | Unschedulable], in input order;
                                              #   placements are already assumed
    engine.place(pod)                         # one pod
    engine.explain(pod, node)                 # -> Status: the first failing filter on that node
    engine.set_queue(Queue(...)); engine.ledger(node); engine.placement_of(uid)
    with engine.statement() as st:            # a "what if": st.place(pod), st.evict(uid),
        mark = st.checkpoint()                #   st.assume(pod, placement), each undone by
        st.rollback(mark)                     #   rollback(mark) or discard(); st.commit() keeps
    engine.nominate(pod, node); engine.drop_nomination(uid)   # room held for a preemptor's nominee
    engine.set_namespace(name, labels)        # for affinity terms' namespaceSelector

Modules: ``model`` (inputs), ``decision`` (outputs and reason codes), ``demand`` (a pod's request as
filters compute with it), ``state`` (ledgers as arrays), ``filters``, ``scoring``, ``typical`` and
``fragmentation`` (FGD), ``policies``, ``fair_share`` (queue shares and order), ``engine``, ``preemption``
(victims for preemption and reclaim: ``find_victims(engine, pod, kind=Kind.PREEMPT)``), ``gang_preemption``
(victims for a whole gang: ``find_gang_victims(engine, members, min_member=n, kind=...)``), ``consolidation``
(moves of movable pods for a pod that fits nowhere because free memory is fragmented:
``plan_consolidation(engine, pod)``, and ``MoveBudget``, the per-minute bound);
``pod_constraints`` and ``topology``: rules between pods and node-local resources besides GPUs;
``selectors``: node label selection, which ``model`` and ``pod_constraints`` both build on.
docs/placement.md explains the design; docs/scheduler.md how the scheduler preempts and reclaims.
"""

from .decision import (
    ContainerPlacement,
    Decision,
    DeviceAssignment,
    Placement,
    Reason,
    Status,
    Unschedulable,
)
from .engine import Engine, Statement
from .filters import GpuRules
from .model import (
    GpuDevice,
    ModePolicy,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    NodeSpec,
    PendingPod,
    Queue,
    SelectorOperator,
    Taint,
    TaintEffect,
    Toleration,
    TolerationOperator,
)
from .policies import POLICIES, make_policy
from .state import GpuLedger

__all__ = [
    "POLICIES",
    "ContainerPlacement",
    "Decision",
    "DeviceAssignment",
    "Engine",
    "GpuDevice",
    "GpuLedger",
    "GpuRules",
    "ModePolicy",
    "NodeSelectorRequirement",
    "NodeSelectorTerm",
    "NodeSpec",
    "PendingPod",
    "Placement",
    "Queue",
    "Reason",
    "SelectorOperator",
    "Statement",
    "Status",
    "Taint",
    "TaintEffect",
    "Toleration",
    "TolerationOperator",
    "Unschedulable",
    "make_policy",
]
