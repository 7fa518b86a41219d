"""KAI Scheduler's and NVIDIA's reference node agent's own table tests, replayed against gpufrac.

Each case below is one row of a table-driven Go test, cited by repository, file, commit and the row's own
name, with the inputs exactly as the row gives them and the row's verdict (accepts or refuses, and the MiB
or thread percentage it expects). The case is run the way a user meets gpufrac:

* ``VALIDATE``: a manifest a user wrote, through ``gpufrac validate``'s code path
  (``parse_pod_manifest(..., user_written=True)``, the webhook's rule);
* ``BINDER``: a pod as the scheduler's binder leaves it (binder-owned keys allowed), through the same
  parser with ``user_written=False``;
* ``NODE``: a bound pod reaching the node agent, through ``gpufrac.node.inject.plan_container`` (the
  plan the NRI plugin injects). Rows that exercise the reference's annotation parser alone get the
  binder's device key added (``placed=True``), since gpufrac's node refuses a container without devices
  (difference ``devices-required``).

A case agrees when both accept (with the same amounts) or both refuse. A case that does not agree names
its ``difference``: an entry of the "Where gpufrac differs from KAI Scheduler, on purpose" list in
docs/user-guide.md, which says why. The suite fails when a case disagrees without a listed reason, when
a listed difference stops being one (so the list stays true), and when the guide lists a difference no
case shows.

Where the search index gave no commit for a stored file version, the source names the index id of the
version read (``index:<id>``) and the pinned commit of the pull request it belongs to, where known.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpufrac.contract import keys as k
from gpufrac.contract.errors import ContractError
from gpufrac.contract.parse import parse_pod_manifest
from gpufrac.node.inject import CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, plan_container

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "user-guide.md"

VALIDATE, BINDER, NODE = "validate", "binder", "node"

# -- sources ---------------------------------------------------------------------------------------------

KAI = "kai-scheduler/KAI-Scheduler"
REF = "kai-scheduler/kai-gpu-fractioning"
ADMISSION = (
    f"{KAI} pkg/admission/webhook/v1alpha2/nvfractions/nvfractions_test.go"
    "@a59b04545c7d61914ba96bea0f5221b27355e061"
)
ADMISSION_NEW = f"{KAI} pkg/admission/webhook/v1alpha2/nvfractions/nvfractions_test.go@index:70112659859"
GPU_REQUEST = (
    f"{KAI} pkg/binder/plugins/gpusharing/gpu-request/gpu_request_validator_test.go"
    "@521a99aacceebee740f0c04b52b55ee95a5f5329"
)
COMPUTE_REQUEST = (
    f"{KAI} pkg/common/resources/gpu_compute_request_test.go@9c7622234c71c67298e0fdd4df18d4f03445f710"
)
CONTAINER_REF = (
    f"{KAI} pkg/common/resources/gpu_sharing_container_ref_test.go@45103d4c6fdd02f96ea5ecbce9d5030c6c01dbab"
)
EXTRACT = f"{KAI} pkg/common/resources/gpu_sharing_nvfractions_test.go@index:70824385950"
QUANTITY = (
    f"{REF} fractioning-manager/fractiond/internal/annotations/annotations_test.go"
    "@0ee10b42ff3a8d6aed8215ae4ac98bd4473be8ad"
)
ANNOTATIONS_NEW = (
    f"{REF} fractioning-manager/fractiond/internal/annotations/annotations_test.go@index:70630402511"
)
PLUGIN = (
    f"{REF} fractioning-manager/fractiond/internal/plugin_test.go@index:70144417373"
    " (gpu-fractioning PR #147, af0544e4dbd1d8e03ca14fc1e06d6265fabed99b)"
)


@dataclass(frozen=True, slots=True)
class Case:
    source: str
    annotations: Mapping[str, str]
    kai_accepts: bool
    path: str = VALIDATE
    containers: tuple[tuple[str, int], ...] = (("container-0", 0), ("container-1", 0))
    container: str | None = None  # whose amounts are compared (NODE: the container being created)
    mib: tuple[int, int] | None = None  # (request, limit) per device, when KAI accepts with amounts
    percent: int | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the reference injects (NODE)
    placed: bool = False  # NODE: add the binder's devices key to every container with memory keys
    difference: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def req(c: str) -> str:
    return k.memory_request_key(c)


def lim(c: str) -> str:
    return k.memory_limit_key(c)


def dev(c: str) -> str:
    return k.devices_key(c)


def portion(c: str) -> str:
    return k.compute_portion_key(c)


def mode(c: str) -> str:
    return k.compute_mode_key(c)


def compute(c: str) -> str:
    return k.compute_request_key(c)


C0 = "container-0"
ONE = (("main", 0),)

# -- KAI's NvFractions admission plugin: TestValidate (a user's pod, containers container-0, container-1) --

CASES: list[Case] = [
    Case(
        f"{ADMISSION} TestValidate/valid nvfractions request",
        {req(C0): "1Gi"},
        True,
        container=C0,
        mib=(1024, 1024),
    ),
    Case(
        f"{ADMISSION} TestValidate/valid legacy gpu-fraction (portion) request", {"gpu-fraction": "0.5"}, True
    ),
    Case(
        f"{ADMISSION} TestValidate/valid legacy gpu-memory request",
        {"gpu-memory": "2000"},
        True,
        container=C0,
        mib=(2000, 2000),
    ),
    Case(
        f"{ADMISSION} TestValidate/valid legacy gpu-memory with matching container-name",
        {"gpu-memory": "2000", "gpu-fraction-container-name": C0},
        True,
        container=C0,
        mib=(2000, 2000),
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects both gpu-fraction and gpu-memory",
        {"gpu-fraction": "0.5", "gpu-memory": "2000"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects container-name mismatch with nvfractions annotation",
        {req(C0): "1Gi", "gpu-fraction-container-name": "other"},
        False,
    ),
    Case(f"{ADMISSION} TestValidate/references missing container", {req("missing"): "1Gi"}, False),
    Case(f"{ADMISSION} TestValidate/no fraction request", {}, True),
    Case(
        f"{ADMISSION} TestValidate/rejects non-quantity nvfractions request value",
        {req(C0): "not-a-quantity"},
        False,
    ),
    Case(f"{ADMISSION} TestValidate/rejects non-quantity nvfractions request Nan", {req(C0): "NaN"}, False),
    Case(f"{ADMISSION} TestValidate/rejects empty nvfractions request value", {req(C0): ""}, False),
    Case(f"{ADMISSION} TestValidate/rejects zero nvfractions request value", {req(C0): "0"}, False),
    Case(f"{ADMISSION} TestValidate/rejects negative nvfractions request value", {req(C0): "-1Gi"}, False),
    Case(
        f"{ADMISSION} TestValidate/rejects non-quantity nvfractions limit value",
        {lim(C0): "not-a-quantity"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects non-quantity nvfractions request Nan (limit)",
        {lim(C0): "NaN"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects nvfractions request greater than limit",
        {req(C0): "2Gi", lim(C0): "1Gi"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects unknown nvfractions annotation suffix",
        {"nvidia.com/container.container-0.gpu-memory": "1Gi"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects nvfractions annotation with empty container name",
        {req(""): "1Gi"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects nvfractions annotations on multiple containers",
        {req(C0): "1Gi", req("container-1"): "1Gi"},
        False,
        difference="several-containers",
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects nvfractions request mismatching gpu-memory annotation",
        {req(C0): "1Gi", "gpu-memory": "2000"},
        False,
    ),
    Case(
        f"{ADMISSION} TestValidate/rejects nvfractions limit combined with gpu-fraction",
        {lim(C0): "1Gi", "gpu-fraction": "0.5"},
        False,
    ),
    Case(f"{ADMISSION} TestValidate/rejects non-numeric gpu-fraction value", {"gpu-fraction": "half"}, False),
    Case(f"{ADMISSION} TestValidate/rejects non-numeric gpu-memory value", {"gpu-memory": "2Gi"}, False),
    Case(
        f"{ADMISSION} TestValidate/rejects device count without fraction details",
        {"gpu-fraction-num-devices": "2"},
        False,
    ),
    # -- TestValidateDeviceAnnotationValues (written by the binder) ------------------------------------
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "device annotation alongside a request on the same container",
        {req(C0): "1Gi", dev(C0): "GPU-0"},
        True,
        path=BINDER,
        container=C0,
        mib=(1024, 1024),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects device annotation on a container other than the requesting one",
        {req(C0): "1Gi", dev("container-1"): "GPU-0"},
        False,
        path=BINDER,
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "compute portion alongside a request on the same container",
        {req(C0): "1Gi", portion(C0): "0.5"},
        True,
        path=BINDER,
        container=C0,
        mib=(1024, 1024),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects compute portion on a container other than the requesting one",
        {req(C0): "1Gi", portion("container-1"): "0.5"},
        False,
        path=BINDER,
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects compute portion referencing a missing container",
        {portion("missing"): "0.5"},
        False,
        path=BINDER,
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects compute portion with empty container name",
        {portion(""): "0.5"},
        False,
        path=BINDER,
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects device annotation referencing a missing container",
        {dev("missing"): "GPU-0"},
        False,
        path=BINDER,
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationValues/"
        "rejects device annotation with empty container name",
        {dev(""): "GPU-0"},
        False,
        path=BINDER,
    ),
    # -- who may write what (creation) ------------------------------------------------------------------
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationAuthorization/rejects create by non-binder",
        {req(C0): "1Gi", dev(C0): "GPU-0"},
        False,
        containers=((C0, 0),),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateDeviceAnnotationAuthorization/allows create by binder",
        {req(C0): "1Gi", dev(C0): "GPU-0"},
        True,
        path=BINDER,
        containers=((C0, 0),),
        container=C0,
        mib=(1024, 1024),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateComputePortionAnnotationAuthorization/rejects create by non-binder",
        {req(C0): "1Gi", portion(C0): "1"},
        False,
        containers=((C0, 0),),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateComputePortionAnnotationAuthorization/allows create by binder",
        {req(C0): "1Gi", portion(C0): "0.5"},
        True,
        path=BINDER,
        containers=((C0, 0),),
        container=C0,
        mib=(1024, 1024),
    ),
    Case(
        f"{ADMISSION_NEW} TestValidateAcceptsComputeRequestFromUser/allows create by a normal user",
        {req(C0): "1Gi", compute(C0): "0.25"},
        True,
        containers=((C0, 0),),
        container=C0,
        mib=(1024, 1024),
    ),
]

# -- KAI's gpu-sharing request validator (binder plugin): TestValidateGpuRequests ----------------------

GPU = k.GPU_RESOURCE
CASES += [
    Case(
        f"{GPU_REQUEST} allow MPS and fractional GPU limits",
        {"mps": "true", "gpu-fraction": "0.5"},
        True,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} Don't allow MPS and whole gpu limit", {"mps": "true"}, False, containers=(("c0", 1),)
    ),
    Case(
        f"{GPU_REQUEST} allow MPS and fractional GPU annotation request",
        {"mps": "true", "gpu-fraction": "0.5"},
        True,
        containers=(("c0", 0),),
    ),
    Case(f"{GPU_REQUEST} block MPS without GPU request", {"mps": "true"}, False, containers=(("c0", 0),)),
    Case(
        f"{GPU_REQUEST} forbid GPU annotation and GPU request mismatch (fractional)",
        {"gpu-fraction": "0.5"},
        False,
        containers=(("c0", 0),),
        extra={"gpu": {"c0": "2m"}},
    ),
    Case(
        f"{GPU_REQUEST} forbid fraction limit (1500 milli)",
        {"gpu-fraction": "1.5"},
        False,
        containers=(("c0", 0),),
    ),
    Case(f"{GPU_REQUEST} Allow whole GPU resource limit of 2", {}, True, containers=(("c0", 2),)),
    Case(
        f"{GPU_REQUEST} Allow whole gpu request of 2, represented as millis",
        {},
        True,
        containers=(("c0", 0),),
        extra={"gpu": {"c0": "2000m"}},
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU fraction with GPU Memory fraction annotation",
        {"gpu-fraction": "0.5", "gpu-memory": "1"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} Allow multiple containers with whole GPU resource request",
        {},
        True,
        containers=(("c0", 1), ("c1", 2)),
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU resource limit with GPU Memory fraction annotation",
        {"gpu-memory": "1"},
        False,
        containers=(("c0", 0),),
        extra={"gpu": {"c0": "1m"}},
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU resource limit in sidecar container with GPU Memory fraction annotation",
        {"gpu-memory": "1"},
        False,
        containers=(("distraction", 0), ("sneaky", 0)),
        extra={"gpu": {"sneaky": "1m"}},
    ),
    Case(
        f"{GPU_REQUEST} forbid negative GPU memory annotation",
        {"gpu-memory": "-1"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} forbid negative GPU fraction annotation",
        {"gpu-fraction": "-1"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU fraction which is greater than 1.0",
        {"gpu-fraction": "1.2"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU fraction count without fractions or memory",
        {"gpu-fraction-num-devices": "1"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} forbid GPU fraction count without fractions or memory (1.2 devices)",
        {"gpu-fraction-num-devices": "1.2", "gpu-fraction": "0.2"},
        False,
        containers=(("c0", 0),),
    ),
    Case(
        f"{GPU_REQUEST} allow GPU fraction count with memory",
        {"gpu-fraction-num-devices": "2", "gpu-memory": "1000"},
        True,
        containers=(("c0", 0),),
        container="c0",
        mib=(1000, 1000),
    ),
    Case(
        f"{GPU_REQUEST} allow GPU fraction count with fractions",
        {"gpu-fraction-num-devices": "2", "gpu-fraction": "0.3"},
        True,
        containers=(("c0", 0),),
    ),
]

# -- KAI's compute request (user-settable): TestParsePodGPUFractionRequest_* -----------------------------

for value, accepts in [
    ("1", True), ("1.0", True), ("0.5", True), (".5", True), ("+0.5", True), ("5e-1", True), ("1e-9", True),
    ("0", False), ("0.0", False), ("-0.5", False), ("-0", False), ("1.0000001", False), ("2", False),
    ("100", False), ("NaN", False), ("nan", False), ("Inf", False), ("+Inf", False), ("-Inf", False),
    ("50%", False), ("0.5 ", False), (" 0.5", False), ("half", False), ("", False),
]:  # fmt: skip
    CASES.append(
        Case(
            f"{COMPUTE_REQUEST} TestParsePodGPUFractionRequest_ComputeRequestBoundaries/{value!r}",
            {"gpu-fraction": "0.5", compute("main"): value},
            accepts,
            containers=ONE,
        )
    )
CASES += [
    Case(
        f"{COMPUTE_REQUEST} TestParsePodGPUFractionRequest_ComputeRequestAbsent",
        {"gpu-fraction": "0.5"},
        True,
        containers=ONE,
    ),
    Case(
        f"{COMPUTE_REQUEST} TestParsePodGPUFractionRequest_ComputeRequestForUnknownContainer",
        {"gpu-fraction": "0.5", compute("does-not-exist"): "0.25"},
        True,
        containers=ONE,
        difference="orphan-keys",
    ),
    Case(
        f"{COMPUTE_REQUEST} TestParsePodGPUFractionRequest_MultipleContainersAreDeterministic",
        {"gpu-fraction": "0.5", compute("a"): "0.1", compute("b"): "0.2", compute("c"): "0.3"},
        True,
        containers=(("a", 0), ("b", 0), ("c", 0)),
        difference="orphan-keys",
    ),
]

# -- KAI's fraction container: TestGetFractionContainerRef (a fractional pod: gpu-fraction added where the
#    row only names the container, since KAI resolves the container only for a fractional request) -------

CASES += [
    Case(f"{CONTAINER_REF} no annotations - returns default container", {"gpu-fraction": "0.5"}, True),
    Case(
        f"{CONTAINER_REF} annotation points to first regular container",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": C0},
        True,
    ),
    Case(
        f"{CONTAINER_REF} annotation points to second regular container",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "container-1"},
        True,
    ),
    Case(
        f"{CONTAINER_REF} annotation points to init container",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "init-container"},
        True,
        containers=((C0, 0),),
        difference="init-containers",
    ),
    Case(
        f"{CONTAINER_REF} container not found in regular containers",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "non-existent"},
        False,
    ),
    Case(
        f"{CONTAINER_REF} nvfractions request annotation points to second regular container",
        {req("container-1"): "1Gi"},
        True,
        container="container-1",
        mib=(1024, 1024),
    ),
    Case(
        f"{CONTAINER_REF} nvfractions limit annotation points to init container",
        {lim("init-container"): "1Gi"},
        True,
        containers=((C0, 0),),
        difference="init-containers",
    ),
    Case(
        f"{CONTAINER_REF} matching legacy and nvfractions container annotations",
        {"gpu-fraction-container-name": "container-1", req("container-1"): "1Gi"},
        True,
        container="container-1",
        mib=(1024, 1024),
    ),
    Case(
        f"{CONTAINER_REF} mismatching legacy and nvfractions container annotations",
        {"gpu-fraction-container-name": C0, req("container-1"): "1Gi"},
        False,
    ),
    Case(
        f"{CONTAINER_REF} multiple nvfractions containers",
        {req(C0): "1Gi", req("container-1"): "1Gi"},
        False,
        difference="several-containers",
    ),
    Case(
        f"{CONTAINER_REF} multiple containers with annotation to last one",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "container-4"},
        True,
        containers=tuple((f"container-{i}", 0) for i in range(5)),
    ),
]

# -- KAI's scheduler-side request extraction: TestExtractNvFractionsData (a pod the scheduler reads) -----

MAIN_SIDECAR = (("main", 0), ("sidecar", 0))
CASES += [
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/extracts request and limit by container",
        {req("main"): "1Gi", lim("main"): "2Gi", "other-annotation": "ignored"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(1024, 2048),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/"
        "extracts request and limit by container - ignore visible devices annotation",
        {req("main"): "1Gi", lim("main"): "2Gi", dev("main"): "1,2", "other-annotation": "ignored"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(1024, 2048),
        difference="binder-keys-checked",
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/defaults request from limit",
        {lim("main"): "2Gi"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(2048, 2048),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/extracts multiple containers",
        {req("main"): "1Gi", req("sidecar"): "512Mi"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="sidecar",
        mib=(512, 512),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/compute sharing mode annotation does not break extraction",
        {req("main"): "1Gi", mode("main"): "sm-sharing"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(1024, 1024),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/skips device list annotation",
        {req("main"): "1Gi", dev("main"): "gpu-0"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(1024, 1024),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/skips binder-written compute portion annotation",
        {req("main"): "1Gi", portion("main"): "0.5", dev("main"): "GPU-0", mode("main"): "sm-sharing"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        container="main",
        mib=(1024, 1024),
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/compute portion alone yields no request",
        {portion("main"): "1Gi"},
        True,
        path=BINDER,
        containers=MAIN_SIDECAR,
        difference="binder-keys-checked",
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/rejects invalid annotation key",
        {"nvidia.com/container.main.unknown": "1Gi"},
        False,
        path=BINDER,
        containers=MAIN_SIDECAR,
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/rejects invalid quantity",
        {req("main"): "bad"},
        False,
        path=BINDER,
        containers=MAIN_SIDECAR,
    ),
    Case(
        f"{EXTRACT} TestExtractNvFractionsData/rejects zero quantity",
        {req("main"): "0Mi"},
        False,
        path=BINDER,
        containers=MAIN_SIDECAR,
    ),
]

# -- the reference node agent's quantity parsing: TestParseToMemoryMiB (through the node's plan) ---------

TRAINER = (("trainer", 0),)
for name, value, expected in [
    ("4Gi to NVIDIA MiB", "4Gi", 4096), ("2048Mi to NVIDIA MiB", "2048Mi", 2048),
    ("7680Mi to NVIDIA MiB", "7680Mi", 7680), ("1Gi to NVIDIA MiB", "1Gi", 1024),
    ("512Mi to NVIDIA MiB", "512Mi", 512), ("100Mi remains 100 MiB", "100Mi", 100),
    ("1000Mi remains 1000 MiB", "1000Mi", 1000), ("100M rounds up to MiB", "100M", 96),
    ("1024Ki minimum valid", "1024Ki", 1), ("4096M SI megabytes rounds up to MiB", "4096M", 3907),
    ("1024M SI megabytes rounds up to MiB", "1024M", 977),
    ("1000M SI megabytes rounds up to MiB", "1000M", 954),
    ("500M SI megabytes rounds up to MiB", "500M", 477), ("1G SI gigabyte rounds up to MiB", "1G", 954),
    ("5G SI gigabytes rounds up to MiB", "5G", 4769), ("1M below 1 MiB is error", "1M", None),
    ("plain integer 4Gi in bytes", "4294967296", 4096),
    ("plain byte value below 1 MiB is error", "4096", None),
    ("zero is error", "0", None), ("500Ki below 1 MiB", "500Ki", None),
    ("one byte below 1 MiB is error", "1048575", None), ("empty string", "", None),
    ("whitespace is invalid", "  2048Mi  ", None), ("garbage", "notanumber", None),
]:  # fmt: skip
    CASES.append(
        Case(
            f"{QUANTITY} TestParseToMemoryMiB/{name}",
            {req("trainer"): value},
            expected is not None,
            path=NODE,
            containers=TRAINER,
            container="trainer",
            mib=(expected, expected) if expected is not None else None,
            placed=True,
            difference="quantity-whitespace" if value != value.strip() else None,
        )
    )

# -- TestParseGPUMemoryAnnotations (request and limit after the reference's ApplyDefaults) ---------------

CASES += [
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/both request and limit",
        {req("trainer"): "2048Mi", lim("trainer"): "4Gi"},
        True,
        path=NODE,
        container="trainer",
        mib=(2048, 4096),
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/only limit",
        {lim("main"): "1024M"},
        True,
        path=NODE,
        container="main",
        mib=(977, 977),
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/only request",
        {req("worker"): "512Mi"},
        True,
        path=NODE,
        container="worker",
        mib=(512, 512),
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/no matching annotations",
        {lim("other"): "4096M"},
        True,
        path=NODE,
        container="main",
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/nil annotations",
        {},
        True,
        path=NODE,
        container="main",
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/malformed limit value",
        {lim("main"): "not-a-number"},
        False,
        path=NODE,
        container="main",
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/value below 1 MiB",
        {lim("main"): "500Ki"},
        False,
        path=NODE,
        container="main",
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/multiple containers only target extracted",
        {lim("sidecar"): "1024M", lim("main"): "4096M", lim("init"): "512M"},
        True,
        path=NODE,
        container="main",
        mib=(3907, 3907),
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/container name with dashes",
        {lim("my-training-job"): "2048M"},
        True,
        path=NODE,
        container="my-training-job",
        mib=(1954, 1954),
        placed=True,
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/custom prefix",
        {"gpu-fractioning.kai.scheduler/container.main.gpu-memory.limit": "4Gi"},
        True,
        path=NODE,
        container="main",
        mib=(4096, 4096),
        difference="fixed-prefix",
    ),
    Case(
        f"{QUANTITY} TestParseGPUMemoryAnnotations/empty prefix still matches bare container keys",
        {"main.gpu-memory.limit": "4Gi"},
        True,
        path=NODE,
        container="main",
        mib=(4096, 4096),
        difference="fixed-prefix",
    ),
]

# -- TestParseComputeMode (the newest version: a blank mode is an error) ---------------------------------

for name, value, accepts in [
    ("absent annotation defaults to time-slicing", None, True), ("empty annotation fails", "", False),
    ("whitespace-only annotation fails", "   ", False), ("explicit time-slicing", "time-slicing", True),
    ("sm-sharing", "sm-sharing", True), ("surrounding whitespace trimmed", "  sm-sharing  ", True),
    ("invalid value fails", "mig", False), ("case-sensitive: capitalized value fails", "SM-Sharing", False),
]:  # fmt: skip
    annotations = {lim("trainer"): "4Gi"} | ({mode("trainer"): value} if value is not None else {})
    CASES.append(
        Case(
            f"{ANNOTATIONS_NEW} TestParseComputeMode/{name}",
            annotations,
            accepts,
            path=NODE,
            container="trainer",
            mib=(4096, 4096) if accepts else None,
            placed=True,
        )
    )
CASES.append(
    Case(
        f"{ANNOTATIONS_NEW} TestParseComputeMode/sm-sharing rejected when disabled cluster-wide",
        {lim("trainer"): "4Gi", mode("trainer"): "sm-sharing"},
        False,
        path=NODE,
        container="trainer",
        placed=True,
        difference="sm-sharing-switch",
    )
)

# -- TestParseComputePortion (an sm-sharing container: the only mode the reference caps) ------------------

for name, value, percent in [
    ("absent annotation is not found and not an error", None, None), ("half a GPU", "0.5", 50),
    ("whole GPU", "1", 100), ("whole GPU written as 1.0", "1.0", 100),
    ("one third rounds to nearest whole percent", "0.333", 33),
    ("rounds up to nearest whole percent", "0.336", 34),
    ("half a percent floors at 1%, never 0%", "0.005", 1),
    ("just under half a percent floors at 1%", "0.0049", 1),
    ("vanishingly small portion still floors at 1%", "0.0000001", 1),
    ("scientific notation floors at 1%", "1e-3", 1),
    ("scientific notation in range", "5e-1", 50),
    ("a percentage where a portion belongs is rejected", "50", False),
    ("100 (percent) is rejected", "100", False), ("anything above one whole GPU is rejected", "1.5", False),
    ("barely above one whole GPU is rejected", "1.0000001", False), ("zero is rejected", "0", False),
    ("zero written as 0.0 is rejected", "0.0", False), ("negative portion is rejected", "-0.5", False),
    ("negative zero is rejected", "-0", False), ("present but blank is an error", "", False),
    ("whitespace-only is an error", "   ", False), ("surrounding whitespace is trimmed", "  0.5\t", 50),
    ("non-numeric is rejected", "abc", False), ("a portion with a percent sign is rejected", "50%", False),
    ("a k8s-style quantity is rejected", "500m", False), ("NaN is rejected", "NaN", False),
    ("lowercase nan is rejected", "nan", False), ("positive infinity is rejected", "Inf", False),
    ("spelled-out infinity is rejected", "+Infinity", False),
    ("negative infinity is rejected", "-Inf", False),
]:  # fmt: skip
    annotations = {lim("trainer"): "4Gi", mode("trainer"): "sm-sharing", dev("trainer"): "GPU-abc123"}
    if value is not None:
        annotations[portion("trainer")] = value
    accepts = percent is not False
    CASES.append(
        Case(
            f"{ANNOTATIONS_NEW} TestParseComputePortion/{name}",
            annotations,
            accepts,
            path=NODE,
            container="trainer",
            mib=(4096, 4096) if accepts else None,
            percent=percent if isinstance(percent, int) and percent is not False else None,
            difference="thread-percent-floor" if value == "0.336" else None,
        )
    )
for name, sibling in [
    ("a sibling container's portion does not leak", "sidecar"),
    ("a longer container name is not a prefix match", "trainer-2"),
]:
    CASES.append(
        Case(
            f"{ANNOTATIONS_NEW} TestParseComputePortion/{name}",
            {lim("trainer"): "4Gi", dev("trainer"): "GPU-abc123", portion(sibling): "0.5"},
            True,
            path=NODE,
            container="trainer",
            mib=(4096, 4096),
        )
    )

# -- the reference plugin's injection: TestCreateContainerInjectsMPSEnforcementCaps ----------------------

SM = {mode("trainer"): "sm-sharing"}
CASES += [
    Case(
        f"{PLUGIN} one assigned device is capped by ordinal",
        {lim("trainer"): "4Gi", dev("trainer"): "GPU-abc123"},
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
    ),
    Case(
        f"{PLUGIN} both assigned devices are named",
        {lim("trainer"): "4Gi", dev("trainer"): "GPU-abc123,GPU-def456"},
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
        difference="binder-keys-checked",
    ),
    Case(
        f"{PLUGIN} no device assignment means no pinned memory cap",
        {lim("trainer"): "4Gi"},
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
        difference="devices-required",
    ),
    Case(
        f"{PLUGIN} compute portion becomes the MPS thread percentage",
        {lim("trainer"): "4Gi", portion("trainer"): "0.5"} | SM,
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
        percent=50,
        difference="devices-required",
    ),
    Case(
        f"{PLUGIN} time-slicing is never compute-capped",
        {
            lim("trainer"): "4Gi",
            dev("trainer"): "GPU-abc123",
            portion("trainer"): "0.25",
            mode("trainer"): "time-slicing",
        },
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
    ),
    Case(
        f"{PLUGIN} sm-sharing gets both caps",
        {lim("trainer"): "4Gi", dev("trainer"): "GPU-abc123", portion("trainer"): "0.25"} | SM,
        True,
        path=NODE,
        container="trainer",
        mib=(4096, 4096),
        percent=25,
    ),
    Case(
        f"{PLUGIN} a burstable container is pinned at its limit, not its request",
        {req("trainer"): "2Gi", lim("trainer"): "4Gi", dev("trainer"): "GPU-abc123,GPU-def456"},
        True,
        path=NODE,
        container="trainer",
        mib=(2048, 4096),
        difference="binder-keys-checked",
    ),
    Case(
        f"{PLUGIN} request-only container is pinned at the defaulted limit",
        {req("trainer"): "2Gi", dev("trainer"): "GPU-abc123"},
        True,
        path=NODE,
        container="trainer",
        mib=(2048, 2048),
    ),
]


# -- running a case --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    accepts: bool
    mib: tuple[int, int] | None = None
    percent: int | None = None


def _pod(case: Case) -> dict[str, Any]:
    gpu_text: dict[str, str] = case.extra.get("gpu", {})
    containers = []
    for name, gpus in case.containers:
        limits = {GPU: gpu_text[name]} if name in gpu_text else ({GPU: gpus} if gpus else {})
        containers.append({"name": name, "image": "x", "resources": {"limits": limits}})
    return {
        "kind": "Pod",
        "metadata": {"annotations": dict(case.annotations)},
        "spec": {"containers": containers},
    }


def _placed(annotations: Mapping[str, str]) -> dict[str, str]:
    """What the binder adds to a pod the reference's parser test gives bare: a device per memory ask."""
    placed = dict(annotations)
    for key in annotations:
        split = k.split_container_key(key)
        if (
            split
            and split.prefix == k.NVIDIA_CONTAINER_PREFIX
            and split.suffix in (k.MEMORY_REQUEST, k.MEMORY_LIMIT)
        ):
            placed.setdefault(dev(split.container), f"GPU-{split.container}")
    return placed


def run(case: Case) -> Outcome:
    if case.path == NODE:
        assert case.container is not None
        annotations = _placed(case.annotations) if case.placed else dict(case.annotations)
        try:
            plan, _ = plan_container(annotations=annotations, container=case.container, pipe_source="/leaf")
        except ContractError:
            return Outcome(accepts=False)
        if plan is None:
            return Outcome(accepts=True)
        assert plan.bound.request_mib is not None and plan.bound.limit_mib is not None
        percent = plan.env_map.get(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
        return Outcome(
            True, (plan.bound.request_mib, plan.bound.limit_mib), int(percent) if percent else None
        )
    try:
        request = parse_pod_manifest(_pod(case), user_written=case.path == VALIDATE)
    except ContractError:
        return Outcome(accepts=False)
    wanted = request.container(case.container) if case.container else None
    if wanted is None or wanted.request is None or wanted.limit is None:
        return Outcome(accepts=True)
    if wanted.request.mib is None or wanted.limit.mib is None:
        return Outcome(accepts=True)  # a portion: resolved on the GPU the scheduler picks
    return Outcome(True, (wanted.request.mib, wanted.limit.mib))


def agrees(case: Case, outcome: Outcome) -> bool:
    if outcome.accepts != case.kai_accepts:
        return False
    if not outcome.accepts:
        return True
    if case.mib is not None and outcome.mib != case.mib:
        return False
    return case.path != NODE or outcome.percent == case.percent


def listed_differences() -> set[str]:
    return set(re.findall(r"\(difference `([a-z0-9-]+)`\)", GUIDE.read_text()))


@pytest.mark.parametrize(
    "case", CASES, ids=[c.source.rsplit(" ", 1)[-1][:60] + f"#{i}" for i, c in enumerate(CASES)]
)
def test_case_agrees_with_kai_or_is_a_listed_difference(case: Case) -> None:
    outcome = run(case)
    if case.difference is None:
        assert agrees(case, outcome), (
            f"{case.source}: KAI {'accepts' if case.kai_accepts else 'refuses'} "
            f"{case.mib or ''} {case.percent or ''}, gpufrac gives {outcome}"
        )
    else:
        assert case.difference in listed_differences(), (
            f"docs/user-guide.md does not list `{case.difference}`"
        )
        assert not agrees(case, outcome), f"{case.source} now agrees: drop difference `{case.difference}`"


def test_every_listed_difference_is_shown_by_a_case() -> None:
    assert listed_differences() == {c.difference for c in CASES if c.difference}


def test_suite_size_and_agreement() -> None:
    """The figures the user guide quotes for the suite."""
    counts = Counter("difference" if c.difference else "agree" for c in CASES)
    text = GUIDE.read_text()
    match = re.search(r"(\d+) cases from their table tests: (\d+) agree, (\d+) are listed differences", text)
    assert match, "docs/user-guide.md must quote the suite's figures"
    assert tuple(map(int, match.groups())) == (len(CASES), counts["agree"], counts["difference"])
