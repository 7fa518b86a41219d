"""Classic MPS's one pipe directory reaches sm-sharing containers read-only.

Classic MPS cannot give a container a leaf of its own (``gpufrac.node.nri.handler`` says why), so every
sm-sharing container mounts the node's pipe directory; the plan makes that mount read-only, nosuid, nodev
and noexec. The hooks here answer as ``MpsContainerHooks`` does in classic mode (the node's pipe directory
for sm-sharing, nothing for the rest): this machine has no MPS, and which directory MPS picks is not what
is under test -- how the plan mounts it is, through NRI's real adaptation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from nri_harness import GPU_A, Node

from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import CONTAINER_PIPE_DIR, InjectionPlan
from gpufrac.node.mps.containers import MpsAdjustment


class ClassicAnswers:
    """``ContainerHooks`` answering as classic MPS does: sm-sharing containers get the node's pipe dir."""

    def __init__(self, pipe_dir: Path) -> None:
        self.pipe_dir = pipe_dir

    async def on_create(self, plan: InjectionPlan, *, container_id: str) -> MpsAdjustment:
        if plan.bound.mode is not ComputeMode.SM_SHARING:
            return MpsAdjustment()
        return MpsAdjustment(pipe_source=str(self.pipe_dir))

    async def on_stop(self, *, container_id: str) -> None:
        return None

    async def on_remove(self, *, container_id: str) -> None:
        return None

    async def on_synchronize(self, containers: Iterable[tuple[str, InjectionPlan]]) -> None:
        return None


def ask(container: str, mode: str) -> dict[str, str]:
    prefix = f"nvidia.com/container.{container}."
    return {
        prefix + "gpu-memory.request": "2Gi",
        prefix + "gpu-compute.mode": mode,
        prefix + "gpus.devices": GPU_A,
    }


async def test_the_shared_classic_pipe_directory_is_mounted_read_only(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    node = await make_node(agent=False)
    pipe_dir = node.root / "mps-pipe"
    pipe_dir.mkdir()
    await node.start_agent(hooks=ClassicAnswers(pipe_dir), shared_pipe_dir=str(pipe_dir))

    sm = await node.create(await node.pod(ask("infer", "sm-sharing")), "infer")
    mount = sm.mount_at(CONTAINER_PIPE_DIR)
    assert mount is not None and mount["source"] == str(pipe_dir)
    assert sorted(mount["options"]) == sorted(["rbind", "ro", "nosuid", "nodev", "noexec"])

    # A time-slicing container keeps its own empty, writable leaf: it is no MPS client.
    ts = await node.create(await node.pod(ask("nb", "time-slicing")), "nb")
    leaf = ts.mount_at(CONTAINER_PIPE_DIR)
    assert leaf is not None and leaf["source"] == str(node.pipe_root / ts.id)
    assert "rw" in leaf["options"] and "ro" not in leaf["options"]
