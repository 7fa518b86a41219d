"""docs/user-guide.md tells the truth: every key, every rejection message, every example pod.

The rejection messages in the guide are not copied by hand from the code: each rule has a real input
here, the message it produces must appear verbatim in the guide, and a new rule without an example
fails this test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpufrac.contract import keys as k
from gpufrac.contract.changes import forbidden_changes
from gpufrac.contract.errors import InvalidPodRequest, RuleViolation, rule_classes
from gpufrac.contract.parse import ContainerSpec, parse_pod, parse_pod_manifest
from gpufrac.contract.render import read_binding

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"
REQ, LIM = k.memory_request_key("app"), k.memory_limit_key("app")
MODE, PORTION, DEV = k.compute_mode_key("app"), k.compute_portion_key("app"), k.devices_key("app")
APP = [ContainerSpec("app")]
MIG_PROFILE, MIG_COUNT, MIG_MEMORY = (k.mig_key("app", s) for s in (k.MIG_PROFILE, k.MIG_COUNT, k.MIG_MEMORY))


def rejected(annotations: dict[str, str], containers: list[ContainerSpec] = APP, *, user: bool = True) -> str:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, containers, user_written=user)
    (message,) = raised.value.messages
    return message


def not_placed() -> str:
    with pytest.raises(InvalidPodRequest) as raised:
        read_binding({REQ: "1Gi"})
    return raised.value.messages[0]


EXAMPLES: dict[str, Callable[[], str]] = {
    "NotAQuantity": lambda: rejected({REQ: "lots"}),
    "UnknownQuantitySuffix": lambda: rejected({REQ: "40GB"}),
    "NotPositive": lambda: rejected({REQ: "-1Gi"}),
    "BelowMinimum": lambda: rejected({REQ: "4096"}),
    "TooLarge": lambda: rejected({REQ: "8Ei"}),
    "QuantityTooLong": lambda: rejected({REQ: "1" * 100 + "Mi"}),
    "QuantityNeedsUnit": lambda: rejected({"gpu-memory": "4096", "gpu-memory.limit": "8192"}),
    "LimitBelowRequest": lambda: rejected({REQ: "40Gi", LIM: "20Gi"}),
    "InvalidFraction": lambda: rejected({"gpu-fraction": "1.5"}),
    "InvalidFractionLimit": lambda: rejected({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.4"}),
    "InvalidLegacyMemory": lambda: rejected({"gpu-memory": "4Gi"}),
    "ConflictingRequests": lambda: rejected({"gpu-fraction": "0.5", "gpu-memory": "4096"}),
    "InvalidDeviceCount": lambda: rejected({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}),
    "InvalidComputeMode": lambda: rejected({REQ: "1Gi", MODE: ""}),
    "InvalidComputePortion": lambda: rejected({REQ: "1Gi", MODE: "sm-sharing", PORTION: "1.5"}, user=False),
    "InvalidDeviceList": lambda: rejected({REQ: "1Gi", DEV: "GPU-a,,GPU-b"}, user=False),
    "DeviceCountMismatch": lambda: rejected(
        {REQ: "1Gi", DEV: "GPU-a", "gpu-fraction-num-devices": "2"}, user=False
    ),
    "FractionWithWholeGpu": lambda: rejected({"gpu-fraction": "0.5"}, [ContainerSpec("app", gpus=1)]),
    "UnknownKey": lambda: rejected({"nvidia.com/container.app.gpu-memory.requests": "1Gi"}),
    "UnknownContainer": lambda: rejected(
        {"nvidia.com/container.trainer.gpu-memory.request": "1Gi"}, [ContainerSpec("train")]
    ),
    "KeyWithoutRequest": lambda: rejected({"gpu-fraction.limit": "0.8"}),
    "NotTheFractionTarget": lambda: rejected(
        {"gpu-fraction": "0.5", k.portion_limit_key("side"): "0.7"},
        [ContainerSpec("app"), ContainerSpec("side")],
    ),
    "NotTheRequestingContainer": lambda: rejected(
        {"gpu-fraction-container-name": "app", k.memory_request_key("side"): "1Gi"},
        [ContainerSpec("app"), ContainerSpec("side")],
    ),
    "InvalidMps": lambda: rejected({"gpu-fraction": "0.5", k.KAI_MPS: "yes"}),
    "UnwritableKey": lambda: rejected(
        {"gpu-fraction": "0.5"}, [ContainerSpec("tokenizer-and-embedding-server-east")]
    ),
    "BinderOwnedKey": lambda: rejected({REQ: "1Gi", DEV: "GPU-1"}),
    "ResizeNotAllowed": lambda: rejected({REQ: "1Gi", k.resize_key("app", k.RESIZE_MEMORY_REQUEST): "2Gi"}),
    "ImmutableRequest": lambda: forbidden_changes({REQ: "1Gi"}, {REQ: "2Gi"}, creating=False)[0].message,
    "NotPlaced": not_placed,
    "UnknownMigProfile": lambda: rejected({MIG_PROFILE: "5g.30gb"}),
    "MigMemoryTooLarge": lambda: rejected({MIG_MEMORY: "200Gi"}),
    "InvalidMigCount": lambda: rejected({MIG_PROFILE: "1g.10gb", MIG_COUNT: "0"}),
    "MigWithOtherRequest": lambda: rejected({MIG_PROFILE: "1g.10gb", REQ: "1Gi"}),
}


def guide() -> str:
    return GUIDE.read_text()


def test_every_rule_has_an_example() -> None:
    assert set(EXAMPLES) == {cls.__name__ for cls in rule_classes()}


@pytest.mark.parametrize("rule", rule_classes(), ids=lambda cls: cls.__name__)
def test_the_guide_shows_each_rejection_message(rule: type[RuleViolation]) -> None:
    message = EXAMPLES[rule.__name__]()
    assert rule.summary in message
    assert f"`{rule.__name__}`" in guide()
    assert message in guide(), f"docs/user-guide.md lacks the message:\n{message}"


ACCEPTED_KEYS = [
    REQ,
    LIM,
    MODE,
    PORTION,
    DEV,
    k.compute_request_key("app"),
    k.KAI_MPS,
    k.portion_limit_key("app"),
    k.whole_gpus_key("app"),
    MIG_PROFILE,
    MIG_COUNT,
    MIG_MEMORY,
    k.mig_resource("1g.10gb"),
    *k.POD_LEVEL_KEYS,
    k.GPU_RESOURCE,
    k.QUEUE_LABEL,
    k.KAI_QUEUE_LABEL,
    k.MANAGED_TAINT_KEY,
]


@pytest.mark.parametrize("key", ACCEPTED_KEYS)
def test_the_guide_documents_each_key(key: str) -> None:
    assert f"`{key}`" in guide() or f"{key}:" in guide()


def test_every_example_pod_in_the_guide_is_valid() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", guide(), flags=re.DOTALL)
    pods = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc and doc.get("kind") == "Pod"]
    assert len(pods) >= 6
    for pod in pods:
        assert parse_pod_manifest(pod, user_written=True).wants_gpu, pod["metadata"]["name"]
