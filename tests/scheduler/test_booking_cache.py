"""The booking cache against a model: random place / bind / confirm / delete / expire / node / restart runs.

The API is a dict of Pod objects; a successful bind writes into it exactly what the real binder renders
(``binding_annotations``), and a restart builds a new cache from those objects only, as a restarted
scheduler's informers do. At every step the cache's ledgers must equal the model's books (the
placements the engine made, summed per GPU), and the API objects must pass the audit (no GPU
over-committed, no mixed modes). After a restart the cache must hold exactly the model's placements of
the pods the API shows bound, device for device and MiB for MiB: that is what "a restart rebuilds the
books it had" means. One node has GPUs of two sizes, so a portion resolves differently on each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode
from gpufrac.local.simnodes import NodeShape, gpu_uuid, sim_node
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.demand import PPM, portion_ppm
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.binder import binding_annotations
from gpufrac.scheduler.booking_audit import audit
from gpufrac.scheduler.booking_cache import BookingCache, BookingState, uniform
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import gpu_request, node_spec, pending_pod
from gpufrac.scheduler.placement_engine import build_engine

TTL = 30.0
NODES = ("n0", "n1", "n2")

#: Pod shapes: (annotations, whole GPUs, containers).
SHAPES: list[tuple[dict[str, str], int, tuple[str, ...]]] = [
    ({"gpu-fraction": "0.5"}, 0, ("app",)),
    ({"gpu-fraction": "0.3", "gpu-fraction.limit": "0.6"}, 0, ("app",)),
    ({"gpu-memory": "30000"}, 0, ("app",)),
    (
        {keys.memory_request_key("app"): "20Gi", keys.compute_mode_key("app"): "sm-sharing"},
        0,
        ("app",),
    ),
    ({"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}, 0, ("app",)),
    ({"gpu-fraction": "0.2", keys.compute_mode_key("app"): "sm-sharing"}, 0, ("app",)),
    ({}, 1, ("app",)),
    (
        {keys.memory_request_key("a"): "10Gi", keys.memory_request_key("b"): "12Gi"},
        0,
        ("a", "b"),
    ),
]


def node(name: str) -> Node:
    """n0: 2 x H100; n1: one 80 GiB and one 40 GiB GPU (a portion resolves differently on each);
    n2: 1 x H100."""
    obj = sim_node(name=name, shape=NodeShape(gpus=1 if name == "n2" else 2, model="H100-80GB"))
    if name == "n1":
        gpus = [
            {"uuid": gpu_uuid(name, 0), "index": 0, "model": "mixed", "mib": 81920},
            {"uuid": gpu_uuid(name, 1), "index": 1, "model": "mixed", "mib": 40960},
        ]
        obj.metadata.annotations[keys.NODE_GPUS_ANNOTATION] = json.dumps(gpus)
    return obj


def new_pod(i: int, shape: int) -> Pod:
    annotations, whole, containers = SHAPES[shape]
    return Pod.from_dict(
        {
            "metadata": {
                "name": f"p{i}",
                "namespace": f"ns{i % 2}",
                "uid": f"uid-{i}",
                "annotations": dict(annotations),
            },
            "spec": {
                "containers": [
                    {
                        "name": c,
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}
                        | ({"limits": {keys.GPU_RESOURCE: str(whole)}} if whole else {}),
                    }
                    for c in containers
                ]
            },
        }
    )


def bound(pod: Pod, placement: Placement) -> Pod:
    """``pod`` as the API holds it after the binder's Binding: its node and the rendered annotations."""
    written = binding_annotations(gpu_request(pod), placement, device_style="uuid")
    body = pod.to_dict()
    body["metadata"]["annotations"] = {**pod.metadata.annotations, **written}
    body["spec"]["nodeName"] = placement.node
    return Pod.from_dict(body)


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ModelPod:
    """What the model knows of one pod: its booking (state and placement), if any."""

    state: BookingState | None = None
    placement: Placement | None = None
    deadline: float | None = None
    in_flight: Placement | None = None  # a bind that has not answered (the placement it writes)
    waiting: bool = False  # the API shows it bound to a node the cache does not know


def books_of(placements: list[Placement]) -> dict[str, tuple[int, int, int, int]]:
    """Per GPU: guaranteed MiB, limit MiB, compute ppm and pods of ``placements``."""
    books: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for placement in placements:
        for c in placement.containers:
            for d in c.devices:
                entry = books[d.uuid]
                entry[0] += d.request_mib
                entry[1] += d.limit_mib
                entry[2] += 0 if d.compute_portion is None else portion_ppm(d.compute_portion)
                entry[3] += 1
    return {uuid: (e[0], e[1], e[2], e[3]) for uuid, e in books.items()}


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.api_pods: dict[str, Pod] = {}
        self.up: set[str] = set(NODES)
        self.model: dict[str, ModelPod] = {}
        self.created = 0
        self.written: dict[str, Placement] = {}
        self.gone: set[str] = set()  # deleted while the watch was away: booked until they expire
        self.mode_policy = ModePolicy.REQUIRED
        self.cache = self._new_cache()

    def _new_cache(self) -> BookingCache:
        config = SchedulerConfig(policy="binpack", mode_policy=self.mode_policy.value)
        return BookingCache(
            engine=build_engine(config),
            default_queue=config.default_queue,
            mode_policy=self.mode_policy,
            assumed_ttl=TTL,
            clock=self.clock,
        )

    @initialize(preferred=st.booleans())
    def start(self, preferred: bool) -> None:
        self.mode_policy = ModePolicy.PREFERRED if preferred else ModePolicy.REQUIRED
        self.cache = self._new_cache()
        for name in NODES:
            self.cache.set_node(node_spec(node(name)))

    # -- helpers ------------------------------------------------------------------------------------------

    def _in_flight(self) -> list[str]:
        return sorted(uid for uid, m in self.model.items() if m.in_flight is not None)

    def _api_bound(self) -> list[str]:
        return sorted(uid for uid, p in self.api_pods.items() if p.spec.nodeName)

    def _land(self, uid: str, placement: Placement) -> None:
        """The Binding lands: the API pod gets its node and the binder's annotations."""
        self.api_pods[uid] = bound(self.api_pods[uid], placement)
        self.written[uid] = placement

    def _written(self, uid: str) -> Placement:
        """The placement the API objects describe for a bound pod (what the binder wrote)."""
        found = self.written[uid]
        assert found.node == self.api_pods[uid].spec.nodeName
        return found

    def _confirm_in_model(self, uid: str) -> None:
        m = self.model[uid]
        node_name = self.api_pods[uid].spec.nodeName
        m.deadline = None
        if m.state is not None and m.placement is not None and m.placement.node == node_name:
            m.state = BookingState.CONFIRMED
        elif node_name in self.up:
            m.state, m.placement, m.waiting = BookingState.CONFIRMED, self._written(uid), False
        else:
            m.state, m.placement, m.waiting = None, None, True

    # -- rules --------------------------------------------------------------------------------------------

    @rule(shape=st.integers(0, len(SHAPES) - 1))
    def create(self, shape: int) -> None:
        pod = new_pod(self.created, shape)
        self.created += 1
        self.api_pods[pod.metadata.uid] = pod
        self.model[pod.metadata.uid] = ModelPod()

    @rule()
    def place(self) -> None:
        todo = [
            uid
            for uid, m in sorted(self.model.items())
            if m.state is None
            and m.in_flight is None
            and uid in self.api_pods
            and not self.api_pods[uid].spec.nodeName
        ]
        if not todo:
            return
        pods = [self.api_pods[uid] for uid in todo]
        pendings = [
            pending_pod(
                p, gpu=gpu_request(p), arrival=i, default_queue="default", mode_policy=self.mode_policy
            )
            for i, p in enumerate(pods)
        ]
        for uid, decision in zip(todo, self.cache.place(pendings, pods), strict=True):
            if isinstance(decision, Placement):
                assert decision == uniform(decision)  # one amount per container, as written
                m = self.model[uid]
                m.state, m.placement, m.in_flight = BookingState.ASSUMED, decision, decision

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data())
    def bind_ok(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self._in_flight()))
        m = self.model[uid]
        assert m.in_flight is not None
        self._land(uid, m.in_flight)
        m.in_flight = None
        self.cache.finish_binding(uid)
        if m.state is BookingState.ASSUMED:
            m.state, m.deadline = BookingState.BOUND, self.clock.now + TTL

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data())
    def bind_fails(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self._in_flight()))
        m = self.model[uid]
        m.in_flight = None
        self.cache.forget(uid)
        if m.state in (BookingState.ASSUMED, BookingState.BOUND):
            m.state, m.placement, m.deadline = None, None, None

    @precondition(lambda self: self._api_bound())
    @rule(data=st.data())
    def watch_shows_bound(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(self._api_bound()))
        self.cache.confirm(self.api_pods[uid])
        self._confirm_in_model(uid)

    @precondition(lambda self: self.api_pods)
    @rule(data=st.data(), seen=st.booleans())
    def delete(self, data: st.DataObject, seen: bool) -> None:
        """A pod deleted. ``seen=False`` for a pod bound but not yet confirmed: the watch was away and no
        delete arrives (a relist delivers the delete of any pod the informer had seen bound)."""
        uid = data.draw(st.sampled_from(sorted(self.api_pods)))
        pod = self.api_pods.pop(uid)
        m = self.model[uid]
        if m.in_flight is not None:
            self.cache.forget(uid)  # its bind meets a deleted pod: the binder answers GONE
        elif not seen and m.state is BookingState.BOUND:
            self.gone.add(uid)
            return
        else:
            self.cache.remove(pod)
        del self.model[uid]

    @rule()
    def time_passes(self) -> None:
        """The watch confirms every live bound pod within the TTL; then the TTL passes."""
        for uid in self._api_bound():
            if self.model[uid].state is BookingState.BOUND:
                self.cache.confirm(self.api_pods[uid])
                self._confirm_in_model(uid)
        self.clock.now += TTL + 1
        expired = set(self.cache.expire())
        assert expired == self.gone  # exactly the bound pods whose confirmation never came
        for uid in expired:
            del self.model[uid]
        self.gone.clear()

    @precondition(lambda self: self.up)
    @rule(data=st.data())
    def node_goes(self, data: st.DataObject) -> None:
        """A node deleted: its bookings are kept aside in their states (the model does not change)."""
        name = data.draw(st.sampled_from(sorted(self.up)))
        self.up.discard(name)
        self.cache.remove_node(name)

    @precondition(lambda self: set(NODES) - self.up)
    @rule(data=st.data())
    def node_comes_back(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(set(NODES) - self.up)))
        self.up.add(name)
        self.cache.set_node(node_spec(node(name)))
        assert self.cache.waiting_for_node(name) == []
        for uid, m in self.model.items():
            if m.waiting and self.api_pods[uid].spec.nodeName == name:
                m.state, m.placement, m.waiting = BookingState.CONFIRMED, self._written(uid), False

    @rule(data=st.data(), nodes_first=st.booleans())
    def restart(self, data: st.DataObject, nodes_first: bool) -> None:
        """The scheduler dies; each bind in flight landed or not; a new one lists the API objects."""
        for uid in self._in_flight():
            placement = self.model[uid].in_flight
            assert placement is not None
            if data.draw(st.booleans(), label=f"bind of {uid} landed"):
                self._land(uid, placement)
        for uid in self.gone:
            del self.model[uid]
        self.gone.clear()
        self.cache = self._new_cache()
        nodes = [("node", n) for n in sorted(self.up)]
        pods = [("pod", uid) for uid in self._api_bound()]
        for kind, what in nodes + pods if nodes_first else pods + nodes:
            if kind == "node":
                self.cache.set_node(node_spec(node(what)))
            else:
                self.cache.confirm(self.api_pods[what])
        for uid, m in self.model.items():
            m.in_flight, m.deadline, m.state, m.placement, m.waiting = None, None, None, None, False
            where = self.api_pods[uid].spec.nodeName
            if where in self.up:
                m.state, m.placement = BookingState.CONFIRMED, self._written(uid)
            elif where:
                m.waiting = True
        # Exactly the model's placements, device for device and MiB for MiB (and the invariant below
        # checks the ledgers).
        for uid, m in self.model.items():
            booking = self.cache.booking(uid)
            assert (booking.placement if booking else None) == m.placement, uid

    # -- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def books_equal_the_model(self) -> None:
        for uid, m in self.model.items():
            booking = self.cache.booking(uid)
            if m.state is None:
                assert booking is None, f"{uid} is booked as {booking and booking.state}, not in the model"
            else:
                assert booking is not None, f"{uid} should be booked ({m.state})"
                assert (booking.state, booking.placement) == (m.state, m.placement), uid
        assert len(self.cache) == sum(1 for m in self.model.values() if m.state is not None)
        wanted = books_of([m.placement for m in self.model.values() if m.placement is not None])
        for name in sorted(self.up):
            for ledger in self.cache.engine.ledger(name):
                request, limit, ppm, pods = wanted.get(ledger.uuid, (0, 0, 0, 0))
                used = ledger.capacity_mib - ledger.free_mib
                assert (used, ledger.limit_sum_mib, ledger.compute_ppm, ledger.pods) == (
                    request,
                    limit,
                    ppm,
                    pods,
                ), ledger.uuid
                # Never over-committed, by the books.
                assert ledger.free_mib >= 0 and ledger.compute_ppm <= PPM, ledger

    @invariant()
    def the_api_objects_pass_the_audit(self) -> None:
        report = audit(nodes=[node(n) for n in NODES], pods=list(self.api_pods.values()))
        assert not report.problems, report.problems


TestBookingCache = CacheMachine.TestCase
TestBookingCache.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_a_container_on_gpus_of_two_sizes_is_booked_and_written_with_one_amount() -> None:
    """The engine resolves a portion on each GPU; the contract writes one amount per container, so the
    smaller is booked and written (else a restart would book less than was held before it)."""
    big, small = DeviceAssignment("g0", 0, 40960, 65536, None), DeviceAssignment("g1", 1, 20480, 32768, None)
    placement = Placement(
        "u", "n1", (ContainerPlacement("app", ComputeMode.TIME_SLICING, False, (big, small)),)
    )
    assert uniform(placement).containers[0].devices == (
        DeviceAssignment("g0", 0, 20480, 32768, None),
        small,
    )


def test_a_restart_books_what_the_engine_placed_for_two_gpus_of_two_sizes() -> None:
    machine = CacheMachine()
    machine.start(preferred=False)
    for name in ("n0", "n2"):
        machine.up.discard(name)
        machine.cache.remove_node(name)
    machine.create(shape=4)  # gpu-fraction 0.25 on 2 devices: only n1, with its 80 and 40 GiB GPUs
    machine.place()
    (uid,) = machine._in_flight()
    placed = machine.model[uid].in_flight
    assert placed is not None and placed.node == "n1"
    assert {d.request_mib for d in placed.containers[0].devices} == {10240}  # 0.25 x 40 GiB on both
    machine._land(uid, placed)
    fresh = machine._new_cache()
    fresh.set_node(node_spec(node("n1")))
    fresh.confirm(machine.api_pods[uid])
    booking = fresh.booking(uid)
    assert booking is not None and booking.placement == placed
    assert fresh.engine.ledger("n1") == machine.cache.engine.ledger("n1")


def test_a_restart_books_only_the_host_resources_of_a_binding_the_node_refuses() -> None:
    """A pod some binder bound with devices and an unresolved ``gpu-fraction``: the node will not start
    it, so its GPU stays free for the next pod (and its CPU and memory stay counted)."""
    machine = CacheMachine()
    machine.start(preferred=False)
    refused = new_pod(0, shape=0)
    body = refused.to_dict()
    body["metadata"]["annotations"] = {"gpu-fraction": "0.5", keys.devices_key("app"): gpu_uuid("n2", 0)}
    body["spec"]["nodeName"] = "n2"
    machine.cache.confirm(Pod.from_dict(body))
    booking = machine.cache.booking(refused.metadata.uid)
    assert booking is not None and booking.placement.containers == ()
    (gpu,) = machine.cache.engine.ledger("n2")
    assert gpu.free_mib == gpu.capacity_mib and gpu.tenants == ()
    assert machine.cache.engine.bound_pod(refused.metadata.uid).cpu_milli == 1000
