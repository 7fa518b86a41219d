"""The node agent's heartbeat and its expiry, without a clock: time is passed in.

The service test against the real API server is in test_scheduler_service.py; here are the rules that
decide, for any clock skew, when a node stops (and starts again) taking pods.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpufrac.contract import keys
from gpufrac.kube.heartbeat import AgentHeartbeats
from gpufrac.local.simnodes import sim_node
from gpufrac.placement.decision import Reason, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import ModePolicy, PendingPod
from gpufrac.scheduler.objects import agent_heartbeat, gpu_request, node_spec, pending_pod

WALL = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def test_a_heartbeat_seen_first_is_dated_by_its_timestamp() -> None:
    beats = AgentHeartbeats(expiry_s=180)
    beats.observe("old", WALL - timedelta(hours=1), now=1000.0, wall_now=WALL)
    beats.observe("recent", WALL - timedelta(seconds=100), now=1000.0, wall_now=WALL)
    assert beats.expired("old", now=1000.0)
    assert not beats.expired("recent", now=1000.0)
    assert beats.expired("recent", now=1080.0)  # 100 s old when seen, 180 s old now
    assert beats.next_expiry(now=1000.0) == 1080.0
    assert beats.next_expiry(now=1080.0) is None


def test_a_heartbeat_that_moves_forward_is_dated_by_when_it_was_seen_whatever_the_agents_clock() -> None:
    beats = AgentHeartbeats(expiry_s=180)
    behind = WALL - timedelta(minutes=10)  # the agent's clock is ten minutes behind the scheduler's
    beats.observe("n", behind, now=0.0, wall_now=WALL)
    assert beats.expired("n", now=0.0)  # first sight: only the timestamp to go by
    beats.observe("n", behind + timedelta(seconds=60), now=60.0, wall_now=WALL + timedelta(seconds=60))
    assert not beats.expired("n", now=60.0)
    assert not beats.expired("n", now=239.0)
    assert beats.expired("n", now=240.0)  # the agent stopped: 180 s after its last heartbeat was seen
    assert beats.next_expiry(now=100.0) == 240.0


def test_the_same_heartbeat_seen_again_does_not_extend_it_and_one_moving_backwards_is_no_heartbeat() -> None:
    beats = AgentHeartbeats(expiry_s=180)
    beats.observe("n", WALL, now=0.0, wall_now=WALL)
    # A relist or an unrelated Node update re-delivers the same heartbeat: still dated when first seen.
    beats.observe("n", WALL, now=170.0, wall_now=WALL + timedelta(seconds=170))
    assert beats.expired("n", now=180.0)
    # Someone writes an older time: judged by its own timestamp, not taken as a new heartbeat.
    beats.observe("n", WALL - timedelta(hours=1), now=190.0, wall_now=WALL + timedelta(seconds=190))
    assert beats.expired("n", now=190.0)


def test_no_heartbeat_time_is_expired_and_expiry_none_turns_the_check_off() -> None:
    beats = AgentHeartbeats(expiry_s=180)
    beats.observe("n", None, now=0.0, wall_now=WALL)
    assert beats.expired("n", now=0.0)
    assert beats.expired("never-seen", now=0.0)
    off = AgentHeartbeats(expiry_s=None)
    off.observe("n", WALL - timedelta(days=1), now=0.0, wall_now=WALL)
    assert not off.expired("n", now=1e9) and off.next_expiry(now=0.0) is None


def test_forget_drops_a_deleted_node() -> None:
    beats = AgentHeartbeats(expiry_s=180)
    beats.observe("n", WALL, now=0.0, wall_now=WALL)
    beats.forget("n")
    assert beats.next_expiry(now=0.0) is None and beats.last_seen("n") is None


def test_the_heartbeat_is_read_from_the_node_agents_condition_not_the_kubelets() -> None:
    node = sim_node(name="n1")
    for c in node.status.conditions:
        c.lastHeartbeatTime = WALL if c.type == keys.NODE_READY_CONDITION else WALL + timedelta(hours=1)
    assert agent_heartbeat(node) == WALL
    node.status.conditions = [c for c in node.status.conditions if c.type != keys.NODE_READY_CONDITION]
    assert agent_heartbeat(node) is None


def test_a_node_whose_heartbeat_expired_is_counted_into_the_unschedulable_sentence() -> None:
    engine = Engine(policy="binpack")
    engine.add_node(node_spec(sim_node(name="alive")))
    engine.add_node(node_spec(sim_node(name="silent"), agent_heartbeat_expired=True))
    pod = sim_pod("p", "0.5")
    assert engine.explain(pod, "silent").code is Reason.AGENT_HEARTBEAT_EXPIRED
    first = engine.place(pod)
    assert not isinstance(first, Unschedulable) and first.node == "alive"
    engine.remove_node("alive")
    second = engine.place(sim_pod("q", "0.5"))
    assert isinstance(second, Unschedulable)
    assert second.message == "0/1 nodes are available: 1 node agent heartbeat(s) expired."
    # The heartbeat resumes: the same node with a fresh spec takes the pod.
    engine.update_node(node_spec(sim_node(name="silent")))
    assert not isinstance(engine.place(sim_pod("q", "0.5")), Unschedulable)


def sim_pod(name: str, fraction: str) -> PendingPod:
    from lightkube.resources.core_v1 import Pod

    pod = Pod.from_dict(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": name,
                "annotations": {"gpu-fraction": fraction},
            },
            "spec": {"containers": [{"name": "app", "image": "x"}]},
        }
    )
    return pending_pod(
        pod, gpu=gpu_request(pod), arrival=0, default_queue="default", mode_policy=ModePolicy.REQUIRED
    )
