"""gpufrac's second NRI plugin: refuse a GPU container whose final adjustment lacks the node agent's
injection, so that no GPU container starts unenforced whatever the agent does.

Why a second plugin. The webhook marks every GPU container as requiring the agent's plugin
(``required-plugins.noderesource.dev``) and containerd's default validator refuses it while the plugin
is not connected. That covers an agent that is gone, not one that is in the runtime's path and fails
there: NRI (``pkg/adaptation``, v0.12.3) counts every plugin it consults as present before it calls it,
and when the call times out (``plugin_request_timeout``, 2 s; a hung or starved agent) or the connection
drops in the middle of it (a killed agent, before NRI has pruned it), NRI closes the plugin and goes on
with the adjustment of the others. The default validator then sees "gpufrac" among the consulted plugins,
and the container is created bare. What is missing is not a plugin but the adjustment, so this plugin
judges the adjustment: NRI asks every validating plugin, after all plugins answered, with the pod, the
container as the kubelet asked for it, the merged adjustment and the plugins consulted
(``ValidateContainerAdjustment``); any refusal fails the create, and the kubelet retries.

It must not live in the agent's process: a hung agent would hang its own validator too, and NRI treats a
validator that times out as a refusal only for that one container (it then drops it, as any plugin).
So it is a process of its own (``gpufrac node-agent-validator``, a second container of the agent's
pod), small enough to stay answering: it subscribes to nothing else, keeps no state, reads nothing but
the request.

The judgment is the one Synchronize and the audit make for a running container, on what the container
will get: the plan comes from the pod's annotations through the contract's reader
(``gpufrac.node.inject.plan_container`` -> ``read_binding``), the environment is the container's with the
final adjustment applied as containerd applies it (``effective_env``), and the two are compared by
``gpufrac.node.inject.injection_problems``. A container without a GPU ask is never judged. A
pod whose annotations break the contract is refused with the contract's message (the agent refuses it
too; this matters when the agent was skipped). With ``fail_open`` (the agent's ``--fail-open``, which
creates containers without enforcement by choice) the validator refuses nothing and logs what it would
have refused.

What it does not see: the CDI devices and the MPS mount depend on the agent's settings and MPS state,
and the driver's per-cgroup limit is set at StartContainer; the enforcement variables are what the
toolkit's memory-limit hook and CUDA read, and the agent's audit keeps checking the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError
from gpufrac.node.inject import CONTAINER_PIPE_DIR, ENFORCEMENT_ENV, injection_problems, plan_container
from gpufrac.node.nri.plugin import PluginIdentity

log = logging.getLogger(__name__)

#: The validator's NRI identity. Validators are asked after every plugin, whatever their index; 90 keeps
#: it after the agent (10) in the runtime's plugin list, where people read it.
VALIDATOR_IDENTITY = PluginIdentity(name=keys.NRI_VALIDATOR_PLUGIN_NAME, index="90")


def effective_env(env: Iterable[str], adjust: Iterable[api.KeyValue]) -> dict[str, str]:
    """The environment a container gets: its own ``KEY=value`` list with NRI's adjustment applied as
    containerd applies it (NRI's ``generate.AdjustEnv``: an entry replaces its key, ``-KEY`` removes it)."""
    result = dict(entry.partition("=")[::2] for entry in env)
    for entry in adjust:
        if entry.key.startswith("-"):
            result.pop(entry.key[1:], None)
        else:
            result[entry.key] = entry.value
    return result


def missing_injection(
    request: api.ValidateContainerAdjustmentRequest,
    *,
    agent_plugin: str = keys.NRI_PLUGIN_NAME,
    container_pipe_dir: str = CONTAINER_PIPE_DIR,
) -> str | None:
    """Why ``request``'s container would start without its GPU enforcement, in one sentence; None when it
    has no GPU ask or gets exactly its plan."""
    pod, container = request.pod, request.container
    where = f"container {container.name} of pod {pod.namespace}/{pod.name}"
    try:
        plan, _ = plan_container(
            annotations=pod.annotations,
            container=container.name,
            pipe_source="",  # the host side of the mount; the variables do not depend on it
            container_pipe_dir=container_pipe_dir,
        )
    except ContractError as exc:
        return f"gpufrac: {exc}"
    if plan is None:
        return None
    problems = injection_problems(
        expected=plan.env_map,
        actual=effective_env(container.env, request.adjust.env),
        managed_keys=ENFORCEMENT_ENV,
    )
    if not problems:
        return None
    consulted = {p.name for p in request.plugins}
    if agent_plugin not in consulted:
        why = f'required plugin "{agent_plugin}" not present: the node agent is not connected to the runtime'
    else:
        why = (
            f'the node agent ("{agent_plugin}") was consulted but its adjustment is not there: it hung, '
            "died or answered after the runtime's plugin request timeout, and the runtime went on without it"
        )
    return (
        f"gpufrac: {where} would start without its GPU enforcement ({'; '.join(problems)}): {why}; "
        "the kubelet retries"
    )


class InjectionValidator:
    """The validator's ``NriHandler``: subscribes to ValidateContainerAdjustment only."""

    def __init__(
        self,
        *,
        agent_plugin: str = keys.NRI_PLUGIN_NAME,
        container_pipe_dir: str = CONTAINER_PIPE_DIR,
        fail_open: bool = False,
    ) -> None:
        self._agent_plugin = agent_plugin
        self._container_pipe_dir = container_pipe_dir
        self._fail_open = fail_open
        self.refused = 0
        self.would_refuse = 0  # fail-open: refusals only logged
        self.runtime: tuple[str, str] | None = None

    def events(self) -> Iterable[int]:
        return (api.VALIDATE_CONTAINER_ADJUSTMENT,)

    async def validate_container_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> str | None:
        reason = missing_injection(
            request, agent_plugin=self._agent_plugin, container_pipe_dir=self._container_pipe_dir
        )
        if reason is None:
            return None
        where = {"pod": f"{request.pod.namespace}/{request.pod.name}", "container": request.container.name}
        if self._fail_open:
            self.would_refuse += 1
            log.warning("nri validator: creating anyway (fail-open): %s", reason, extra=where)
            return None
        self.refused += 1
        log.warning("nri validator: refusing container: %s", reason, extra=where)
        return reason

    async def configure(self, *, config: str, runtime_name: str, runtime_version: str) -> None:
        self.runtime = (runtime_name, runtime_version)

    async def synchronize(
        self, *, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> None:
        return None

    async def create_container(
        self, *, pod: api.PodSandbox, container: api.Container
    ) -> api.ContainerAdjustment | None:
        return None

    async def start_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        return None

    async def stop_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        return None

    async def remove_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        return None

    async def shutdown(self) -> None:
        log.info("nri validator: the runtime is shutting down")
