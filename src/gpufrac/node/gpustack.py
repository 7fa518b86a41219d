"""GPU stack gates: a node is Ready only when the stack below gpufrac can enforce what gpufrac injects.

The memory limits gpufrac injects (``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``) are applied by the NVIDIA
container toolkit's ``apply-cuda-memory-limits`` CDI hook, which exists from toolkit 1.20.1, and reach a
container through the device plugin's CDI specs from 0.20.1; the driver enforces them from r615. On an
older stack the variables are injected and nothing acts on them — enforcement that is silently absent.
So the node agent reads what the cluster says about its GPU stack and withholds readiness (the scheduler
places nothing on a node whose ``gpu-fractioning.nvidia.com/Ready`` is False) with a reason:

- ``GPUDriverVersionUnsupported``: the driver the agent reads through NVML is below r615;
- ``GPUOperandVersionUnsupported``: the toolkit or the device plugin is below its minimum, or no version
  is known for it at all (nothing says the hook is there, so it is not assumed);
- ``GPUOperatorNotReady``: the GPU Operator's ClusterPolicy exists and its ``status.state`` is not
  ``ready`` (``notReady`` while an operand's DaemonSet is not rolled out or its validator fails, or no
  state reported yet). Its spec names the versions it *wants*; until it is ready nothing says they run
  here, so the toolkit's hook is not assumed either. Without a ClusterPolicy (no GPU Operator) this gate
  does not apply.

Where each operand's version comes from, first that says it:

1. The NVIDIA GPU Operator's ClusterPolicy (``clusterpolicies.nvidia.com/v1``): ``spec.toolkit.version``
   and ``spec.devicePlugin.version`` (image tags such as ``v1.20.1-ubuntu22.04``), unless the Node's GPU
   Operator label ``nvidia.com/gpu.deploy.container-toolkit`` / ``nvidia.com/gpu.deploy.device-plugin``
   is ``false`` (the operator does not deploy that operand on this node, so its version says nothing
   here). A ClusterPolicy whose ``status.state`` is not ``ready`` gates the node (``GPUOperatorNotReady``).
2. The agent's explicit settings (``gpu_stack.toolkit_version``, ``gpu_stack.device_plugin_version``),
   for clusters without the GPU Operator, and for an operand the GPU Operator does not deploy there.
3. The simulated backend's stack (the minimum versions; SIMULATED: a machine without GPUs has no toolkit).

The escape hatch: ``gpu_stack.allow_unsupported``. The node is then Ready, but its condition's message
says what the gate found and that it was overridden, and the label ``gpufrac.io/gpu-stack-gate`` is
``overridden`` (``passed`` or ``failed`` otherwise), so
``kubectl get nodes -L gpufrac.io/gpu-stack-gate`` shows every
node that runs on the hatch.

The ClusterPolicy and the Node are read at most every ``refresh_s`` (one GET each per node), not at every
publish, so a thousand nodes do not poll the API server every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Node
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpufrac.contract import keys
from gpufrac.contract.gpu_operator import DEPLOY_DEVICE_PLUGIN_LABEL, DEPLOY_TOOLKIT_LABEL
from gpufrac.kube.errors import KubeError, NotFound, api_errors
from gpufrac.node.mps.mode import V3_MIN_DRIVER_MAJOR, DriverVersion

log = logging.getLogger(__name__)

MIN_TOOLKIT = (1, 20, 1)
MIN_DEVICE_PLUGIN = (0, 20, 1)
MIN_DRIVER_MAJOR = V3_MIN_DRIVER_MAJOR  # the cgroup GPU-memory limit and MPS v3 both arrive with r615

REASON_OPERAND_UNSUPPORTED = keys.NODE_REASON_OPERAND_UNSUPPORTED
REASON_DRIVER_UNSUPPORTED = keys.NODE_REASON_DRIVER_UNSUPPORTED
REASON_GPU_OPERATOR_NOT_READY = keys.NODE_REASON_GPU_OPERATOR_NOT_READY

GATE_LABEL = keys.GPU_STACK_GATE_LABEL
GATE_PASSED = "passed"
GATE_FAILED = "failed"
GATE_OVERRIDDEN = "overridden"

ClusterPolicy = create_global_resource(
    group="nvidia.com", version="v1", kind="ClusterPolicy", plural="clusterpolicies"
)

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``v1.20.1-ubuntu22.04`` → (1, 20, 1); ``26.7`` → (26, 7, 0); anything else → None."""
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


class GpuStackSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    toolkit_version: str | None = Field(
        None, description="the NVIDIA container toolkit's version, where no GPU Operator says it"
    )
    device_plugin_version: str | None = Field(
        None, description="the NVIDIA device plugin's version, where no GPU Operator says it"
    )
    cluster_policy: bool = Field(True, description="read the GPU Operator's ClusterPolicy")
    allow_unsupported: bool = Field(
        False,
        description="escape hatch: Ready even when the gate fails; the node's condition and its "
        f"{GATE_LABEL} label say so",
    )
    refresh_s: float = Field(60.0, gt=0, description="how often the ClusterPolicy and the Node are re-read")

    @field_validator("toolkit_version", "device_plugin_version")
    @classmethod
    def _a_version(cls, value: str | None, info: Any) -> str | None:
        if value is not None and parse_version(value) is None:
            raise ValueError(
                f"gpu_stack.{info.field_name}={value!r} is not a version: expected MAJOR.MINOR[.PATCH], "
                "optionally with a leading v and a suffix (v1.20.1-ubuntu22.04)"
            )
        return value


@dataclass(frozen=True, slots=True)
class GpuStack:
    """The operand versions as the cluster tells them, and where each was read."""

    toolkit: str | None
    device_plugin: str | None
    source: str
    #: Why the GPU Operator is not ready (its ClusterPolicy's state); empty when it is, or when none.
    not_ready: str = ""


#: SIMULATED: what a simulated node's toolkit and device plugin are (there is no toolkit on the machine).
SIMULATED_STACK = GpuStack(
    toolkit=_dotted(MIN_TOOLKIT), device_plugin=_dotted(MIN_DEVICE_PLUGIN), source="the simulated backend"
)


@dataclass(frozen=True, slots=True)
class StackVerdict:
    """``reason`` None: the gate passed. ``overridden``: it failed and the escape hatch is set."""

    reason: str | None
    message: str
    overridden: bool = False

    @property
    def blocks(self) -> bool:
        return self.reason is not None and not self.overridden

    @property
    def label(self) -> str:
        if self.reason is None:
            return GATE_PASSED
        return GATE_OVERRIDDEN if self.overridden else GATE_FAILED


def stack_from_cluster_policy(policy: dict[str, Any], *, node_labels: dict[str, str]) -> GpuStack:
    """The operand versions a ClusterPolicy gives this node (see the module docstring)."""
    spec = policy.get("spec") or {}

    def operand(key: str, deploy_label: str) -> str | None:
        if node_labels.get(deploy_label, "").lower() == "false":
            return None
        version = (spec.get(key) or {}).get("version")
        return str(version) if version else None

    state = str((policy.get("status") or {}).get("state") or "")
    name = (policy.get("metadata") or {}).get("name", "")
    not_ready = "" if state.lower() == "ready" else f"ClusterPolicy {name} state is {state or 'unreported'!r}"
    return GpuStack(
        toolkit=operand("toolkit", DEPLOY_TOOLKIT_LABEL),
        device_plugin=operand("devicePlugin", DEPLOY_DEVICE_PLUGIN_LABEL),
        source=f"the GPU Operator's ClusterPolicy {name}",
        not_ready=not_ready,
    )


def judge(stack: GpuStack | None, *, driver: DriverVersion | None, allow_unsupported: bool) -> StackVerdict:
    """Pure: whether this node's stack enforces the injected memory limits, and why not."""
    problems: list[tuple[str, str]] = []
    if driver is not None and driver.major < MIN_DRIVER_MAJOR:
        problems.append(
            (
                REASON_DRIVER_UNSUPPORTED,
                f"driver {driver} is below r{MIN_DRIVER_MAJOR}, which enforces the containers' GPU-memory "
                "limits",
            )
        )
    if stack is not None and stack.not_ready:
        problems.append(
            (
                REASON_GPU_OPERATOR_NOT_READY,
                f"the GPU Operator is not ready ({stack.not_ready}): its operands, the container toolkit's "
                "apply-cuda-memory-limits hook among them, may not run on this node yet",
            )
        )
    operands = (
        ("NVIDIA container toolkit", stack.toolkit if stack else None, MIN_TOOLKIT, "toolkit_version"),
        (
            "NVIDIA device plugin",
            stack.device_plugin if stack else None,
            MIN_DEVICE_PLUGIN,
            "device_plugin_version",
        ),
    )
    for name, version, minimum, setting in operands:
        where = stack.source if stack else "nothing"
        parsed = parse_version(version) if version else None
        if version is None:
            said = f"{where} does not say it" if stack else "no ClusterPolicy and no setting says it"
            problems.append(
                (
                    REASON_OPERAND_UNSUPPORTED,
                    f"the {name} version is unknown ({said}; set gpu_stack.{setting}); "
                    f">= {_dotted(minimum)} is needed for the apply-cuda-memory-limits hook",
                )
            )
        elif parsed is None or parsed < minimum:
            problems.append(
                (
                    REASON_OPERAND_UNSUPPORTED,
                    f"the {name} is {version} (from {where}), below {_dotted(minimum)}: without its "
                    "apply-cuda-memory-limits hook the injected memory limits are not enforced",
                )
            )
    if not problems:
        source = stack.source if stack else "nothing"
        return StackVerdict(reason=None, message=f"GPU stack supported per {source}")
    # The driver first (no operand helps on an old driver), then a GPU Operator still converging (the
    # likely cause of an operand that looks old or unknown meanwhile).
    reason = problems[0][0]
    message = "; ".join(text for _, text in problems)
    if allow_unsupported:
        return StackVerdict(
            reason=reason,
            message=f"GPU stack gate overridden (gpu_stack.allow_unsupported): {reason}: {message}",
            overridden=True,
        )
    return StackVerdict(reason=reason, message=message)


class GpuStackGate:
    """Reads the cluster's GPU stack for one node (cached ``refresh_s``) and judges it."""

    def __init__(
        self,
        *,
        client: AsyncClient | None,
        node_name: str,
        settings: GpuStackSettings,
        fallback: GpuStack | None = None,
    ) -> None:
        """``fallback``: the stack when neither the ClusterPolicy nor the settings say (the simulated
        backend's ``SIMULATED_STACK``; None on a real node: unknown fails the gate)."""
        self._client = client
        self._node = node_name
        self._settings = settings
        self._fallback = fallback
        self._stack: GpuStack | None = None
        self._policy: GpuStack | None = None  # the ClusterPolicy's, as last read
        self._read_at: float | None = None

    @property
    def toolkit(self) -> str | None:
        """The container toolkit's version as last read (None: unknown, or not read yet)."""
        return self._stack.toolkit if self._stack is not None else None

    async def verdict(self, *, driver: DriverVersion | None) -> StackVerdict:
        loop = asyncio.get_running_loop()
        if self._read_at is None or loop.time() - self._read_at >= self._settings.refresh_s:
            self._stack = await self._read()
            self._read_at = loop.time()
        return judge(self._stack, driver=driver, allow_unsupported=self._settings.allow_unsupported)

    async def _read(self) -> GpuStack | None:
        policy = await self._cluster_policy()
        settings = self._settings
        configured = None
        if settings.toolkit_version is not None or settings.device_plugin_version is not None:
            configured = GpuStack(
                toolkit=settings.toolkit_version,
                device_plugin=settings.device_plugin_version,
                source="the node agent's gpu_stack settings",
            )
        known = [stack for stack in (policy, configured, self._fallback) if stack is not None]
        if not known:
            return None
        toolkit = next((st for st in known if st.toolkit is not None), known[0])
        plugin = next((st for st in known if st.device_plugin is not None), known[0])
        sources = " and ".join(dict.fromkeys((toolkit.source, plugin.source)))
        return GpuStack(
            toolkit=toolkit.toolkit,
            device_plugin=plugin.device_plugin,
            source=sources,
            not_ready=policy.not_ready if policy is not None else "",
        )

    async def _cluster_policy(self) -> GpuStack | None:
        """What the GPU Operator's ClusterPolicy says for this node (None: no GPU Operator, or unread)."""
        if self._client is None or not self._settings.cluster_policy:
            return None
        try:
            with api_errors():
                policies = [p async for p in self._client.list(ClusterPolicy)]
                if not policies:
                    return None
                node = await self._client.get(Node, self._node)
                labels = dict((node.metadata.labels if node.metadata else None) or {})
                self._policy = stack_from_cluster_policy(policies[0].to_dict(), node_labels=labels)
                return self._policy
        except NotFound:
            return None  # no ClusterPolicy API: no GPU Operator on this cluster
        except httpx2.HTTPStatusError as error:
            # An API group the server does not serve answers a plain-text 404, not a Status.
            if error.response.status_code == 404:
                return None
            log.warning("GPU stack: cannot read the GPU Operator's ClusterPolicy: %s", error)
        except (KubeError, httpx2.HTTPError) as error:
            log.warning("GPU stack: cannot read the GPU Operator's ClusterPolicy: %s", error)
        return self._policy  # the last answer over a passing API error
