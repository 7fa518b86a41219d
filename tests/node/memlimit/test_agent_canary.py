"""The node agent runs the canary before the node is offered, and again when the driver or toolkit changes;
until it passes, the node's readiness says why."""

from __future__ import annotations

from pathlib import Path

from gpufrac.contract import keys
from gpufrac.node.agent import NodeAgent
from gpufrac.node.config import load_settings
from gpufrac.node.inventory.publish import desired_state
from gpufrac.node.inventory.simulated import SimulatedInventory


def agent(tmp_path: Path, *, driver: str = "615.20.01") -> NodeAgent:
    settings = load_settings(
        None,
        node_name="n1",
        backend="simulated",
        sim_gpus="2xH100-80GB",
        sim_driver=driver,
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        publish=False,
    )
    return NodeAgent(settings=settings, client=None)


async def test_the_canary_runs_once_per_driver_and_again_after_a_driver_change(tmp_path: Path) -> None:
    node = agent(tmp_path)
    assert node.limits is not None
    assert node._canary_problem() == "the canary has not run yet"  # not offered before it ran
    node._inventory = node.backend.read()
    await node._canary()
    assert node._canary_problem() is None and node.limits.totals.canary_runs == 1
    await node._canary()
    assert node.limits.totals.canary_runs == 1  # nothing changed: not again
    assert isinstance(node.backend, SimulatedInventory)
    node.backend.set_driver("580.65.06")  # a driver without per-cgroup limits
    node._inventory = node.backend.read()
    await node._canary()
    assert node.limits.totals.canary_runs == 2
    problem = node._canary_problem()
    assert problem is not None and "NVML_ERROR_NOT_SUPPORTED" in problem
    state = desired_state(inventory=node._inventory, limits_canary=problem)
    assert not state.ready and state.reason == keys.NODE_REASON_MEMORY_LIMIT_CANARY_FAILED
    assert "could not be set and read back on a test cgroup" in state.message
    node.backend.set_driver("615.30.01")
    node._inventory = node.backend.read()
    await node._canary()
    assert node._canary_problem() is None and node.limits.totals.canary_runs == 3
    node.store.close()


async def test_memory_limits_off_runs_no_canary_and_gates_nothing(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        node_name="n1",
        backend="simulated",
        sim_gpus="1xH100-80GB",
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        publish=False,
        memory_limits="off",
    )
    node = NodeAgent(settings=settings, client=None)
    assert node.limits is None and node._canary_problem() is None
    node.store.close()
