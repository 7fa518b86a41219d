"""The validating plugin (``gpufrac.node.nri.validator``) against NRI's real adaptation and its default
validator: a GPU container whose final adjustment lacks the agent's injection is refused, whatever the
agent did -- answered, hung past the request timeout, or was not there.

The agent and the validator run here as tasks of the test process (each its own NRI connection, as two
processes would have); the real node runs them as two processes and stops the agent with SIGSTOP and
SIGKILL (tests/realnode). The hang is an agent whose CreateContainer sleeps past the runtime's request
timeout: what NRI does then (close the plugin, go on with the others' adjustment) is NRI's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nri_harness import GPU_A, Node

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.local.nriruntime import ContainerCreateFailed, NriRuntime
from gpufrac.node.inject import (
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
    NVIDIA_GPU_MEMORY_LIMIT,
    NVIDIA_GPU_MEMORY_REQUEST,
    NVIDIA_VISIBLE_DEVICES,
)
from gpufrac.node.nri.plugin import NriPlugin
from gpufrac.node.nri.validator import VALIDATOR_IDENTITY, InjectionValidator, effective_env

REQUEST_TIMEOUT_S = 0.5
#: What the webhook and the scheduler leave on a placed GPU pod (container ``train``).
GPU_POD = {
    "nvidia.com/container.train.gpu-memory.request": "20Gi",
    "nvidia.com/container.train.gpus.devices": GPU_A,
    keys.nri_required_plugins_key("train"): keys.nri_required_plugins_value(),
}
#: What a user writes to widen the limit; the agent replaces it.
USER_ENV = {NVIDIA_GPU_MEMORY_LIMIT: "999999", "PATH": "/usr/bin"}


class Guarded:
    """A node whose runtime runs NRI's default validator, with our validator beside the agent."""

    def __init__(self, node: Node, validator: InjectionValidator, task: asyncio.Task[None]) -> None:
        self.node, self.validator, self._task = node, validator, task

    async def stop_validator(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _start_validator(node: Node, *, fail_open: bool = False) -> tuple[InjectionValidator, asyncio.Task]:
    registered = int((await node.runtime.list())["registrations"]) + 1
    validator = InjectionValidator(fail_open=fail_open)
    plugin = NriPlugin(
        handler=validator,
        socket_path=str(node.socket),
        identity=VALIDATOR_IDENTITY,
        backoff_initial_s=0.02,
        backoff_max_s=0.2,
    )
    task = asyncio.create_task(plugin.run())
    await node.runtime.wait_registrations(registered, timeout_s=10)
    return validator, task


@pytest.fixture
async def make_guarded(nriruntime_binary: Path) -> AsyncIterator:
    made: list[Guarded] = []

    async def make(*, agent: bool = True, validator: bool = True, fail_open: bool = False) -> Guarded:
        root = Path(tempfile.mkdtemp(prefix="nriv", dir="/tmp"))
        runtime = NriRuntime(
            socket_path=root / "nri.sock",
            binary=nriruntime_binary,
            default_validator=True,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
        await runtime.start()
        node = Node(root=root, runtime=runtime)
        if agent:
            await node.start_agent()
        checker, task = (
            await _start_validator(node, fail_open=fail_open)
            if validator
            else (InjectionValidator(), asyncio.create_task(asyncio.sleep(0)))
        )
        guarded = Guarded(node, checker, task)
        made.append(guarded)
        return guarded

    yield make
    for guarded in made:
        await guarded.stop_validator()
        for agent in guarded.node.agents:
            await agent.stop()
        await guarded.node.runtime.stop()
        shutil.rmtree(guarded.node.root, ignore_errors=True)


def _hang(node: Node) -> None:
    """The agent stops answering CreateContainer (a hung or starved process) for longer than NRI waits."""

    async def hung(**_: object) -> None:
        await asyncio.sleep(30)

    node.agent.injector.create_container = hung  # type: ignore[method-assign]


async def test_an_injected_gpu_container_and_a_plain_one_pass(make_guarded) -> None:  # type: ignore[no-untyped-def]
    g = await make_guarded()
    created = await g.node.create(await g.node.pod(GPU_POD, name="trainer"), "train", env=USER_ENV)
    assert created.env[NVIDIA_GPU_MEMORY_REQUEST] == created.env[NVIDIA_GPU_MEMORY_LIMIT] == "20480"
    plain = await g.node.create(await g.node.pod({"team": "a"}, name="web"), "web", env=USER_ENV)
    assert plain.env[NVIDIA_GPU_MEMORY_LIMIT] == "999999" and NVIDIA_VISIBLE_DEVICES not in plain.env
    assert g.validator.refused == 0


async def test_nris_default_validator_alone_lets_a_container_past_a_hung_agent(  # type: ignore[no-untyped-def]
    make_guarded,
) -> None:
    """The gap this plugin closes, shown on NRI's own code: the hung agent was consulted, so it counts as
    present, and the container is created with the user's variables only."""
    g = await make_guarded(validator=False)
    _hang(g.node)
    created = await g.node.create(await g.node.pod(GPU_POD, name="trainer"), "train", env=USER_ENV)
    assert created.env[NVIDIA_GPU_MEMORY_LIMIT] == "999999" and NVIDIA_VISIBLE_DEVICES not in created.env


async def test_a_container_past_a_hung_agent_is_refused_and_says_why(make_guarded) -> None:  # type: ignore[no-untyped-def]
    g = await make_guarded()
    _hang(g.node)
    pod = await g.node.pod(GPU_POD, name="trainer")
    with pytest.raises(ContainerCreateFailed) as refused:
        await g.node.create(pod, "train", env=USER_ENV)
    message = str(refused.value)
    assert f'validator "{VALIDATOR_IDENTITY.index}-{VALIDATOR_IDENTITY.name}" rejected' in message
    assert "container train of pod ml/trainer would start without its GPU enforcement" in message
    assert f"{NVIDIA_GPU_MEMORY_LIMIT}='999999', want '20480'" in message
    assert 'the node agent ("gpufrac") was consulted but its adjustment is not there' in message
    # NRI dropped the hung agent: the next try is refused at once, by both validators' reasons.
    with pytest.raises(ContainerCreateFailed) as again:
        await g.node.create(pod, "train", env=USER_ENV)
    assert 'required plugin "gpufrac" not present' in str(again.value)
    # The agent answers again (a new connection, as after SIGCONT or a restart): created with its plan.
    await g.node.start_agent()
    created = await g.node.create(pod, "train", env=USER_ENV)
    assert created.env[NVIDIA_GPU_MEMORY_LIMIT] == "20480"
    assert g.validator.refused == 2


async def test_without_the_agent_the_validator_refuses_even_without_nris_default_validator(  # type: ignore[no-untyped-def]
    nriruntime_binary: Path,
) -> None:
    """containerd's default validator is off unless configured; this plugin does not depend on it, nor on
    the pod carrying the required-plugins annotation (a pod bound by another scheduler's webhook)."""
    root = Path(tempfile.mkdtemp(prefix="nriv", dir="/tmp"))
    runtime = NriRuntime(socket_path=root / "nri.sock", binary=nriruntime_binary)
    await runtime.start()
    node = Node(root=root, runtime=runtime)
    validator, task = await _start_validator(node)
    try:
        annotations = {k: v for k, v in GPU_POD.items() if not k.startswith(keys.NRI_REQUIRED_PLUGINS_PREFIX)}
        pod = await node.pod(annotations, name="trainer")
        with pytest.raises(ContainerCreateFailed) as refused:
            await node.create(pod, "train", env=USER_ENV)
        assert 'required plugin "gpufrac" not present: the node agent is not connected' in str(refused.value)
        assert NVIDIA_VISIBLE_DEVICES not in (await node.create(await node.pod(name="web"), "web")).env
        assert validator.refused == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_pod_that_breaks_the_contract_is_refused_with_the_contracts_message(  # type: ignore[no-untyped-def]
    make_guarded,
) -> None:
    g = await make_guarded()
    _hang(g.node)  # the agent, which would refuse it itself, is skipped
    bad = {**GPU_POD, "nvidia.com/container.train.gpu-memory.request": "4Zi"}
    with pytest.raises(ContainerCreateFailed) as refused:
        await g.node.create(await g.node.pod(bad, name="bad"), "train")
    assert 'nvidia.com/container.train.gpu-memory.request="4Zi" is invalid' in str(refused.value)


async def test_fail_open_logs_and_refuses_nothing(make_guarded) -> None:  # type: ignore[no-untyped-def]
    g = await make_guarded(fail_open=True)
    _hang(g.node)
    created = await g.node.create(await g.node.pod(GPU_POD, name="trainer"), "train", env=USER_ENV)
    assert NVIDIA_VISIBLE_DEVICES not in created.env
    assert (g.validator.refused, g.validator.would_refuse) == (0, 1)


async def test_a_validator_that_hangs_fails_the_container_not_opens_it(make_guarded) -> None:  # type: ignore[no-untyped-def]
    """NRI treats a validator past its timeout as a refusal (and drops it): the validator's own failure
    is closed too. The agent still requires itself through the default validator."""
    g = await make_guarded()
    _hang(g.node)

    async def hung(_request: object) -> None:
        await asyncio.sleep(30)

    g.validator.validate_container_adjustment = hung  # type: ignore[method-assign]
    with pytest.raises(ContainerCreateFailed) as refused:
        await g.node.create(await g.node.pod(GPU_POD, name="trainer"), "train", env=USER_ENV)
    assert f"validator plugin {VALIDATOR_IDENTITY.index}-{VALIDATOR_IDENTITY.name} failed" in str(
        refused.value
    )


async def test_an_enforcement_variable_the_plan_leaves_out_is_judged_as_containerd_applies_it(  # type: ignore[no-untyped-def]
    make_guarded,
) -> None:
    """A user's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` on a time-slicing container: NRI's merged adjustment
    (v0.12.3) carries no env removal, and containerd applies only that, so the variable would reach the
    process. The agent refuses it first, naming it (``handler.unremovable_variable``); the validator,
    judging the environment as the runtime will apply it (``effective_env``, below), would too."""
    g = await make_guarded()
    pod = await g.node.pod(GPU_POD, name="trainer")
    with pytest.raises(ContainerCreateFailed) as refused:
        await g.node.create(pod, "train", env={**USER_ENV, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: "100"})
    assert f"sets {CUDA_MPS_ACTIVE_THREAD_PERCENTAGE}='100' in its environment" in str(refused.value)
    assert "the runtime cannot remove" in str(refused.value)


def test_effective_env_applies_an_adjustment_as_containerd_does() -> None:
    adjust = [
        api.KeyValue(key="A", value="planned"),
        api.KeyValue(key="-B"),
        api.KeyValue(key="C", value="new"),
    ]
    assert effective_env(["A=user", "B=user", "D=kept", "E=x=y"], adjust) == {
        "A": "planned",
        "C": "new",
        "D": "kept",
        "E": "x=y",
    }
