"""The GPU-instance profiles of each MIG-capable model gpufrac schedules, as NVIDIA documents them.

Only profiles whose GPU instance holds one full compute instance and no media extension (``+me``) are
listed: those are what the NVIDIA device plugin's ``mixed`` strategy exposes as
``nvidia.com/mig-<profile>`` and what gpufrac places.

Sources:

- Names, compute slices (of 7), memory slices (of 8) and instance counts: NVIDIA Multi-Instance GPU User
  Guide, "Supported MIG Profiles" (A100-SXM4-40GB table; "for A100-SXM4-80GB the profile names change
  according to the memory proportion": 1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb; the H100 80GB
  and H200 141GB tables: 1g.10gb/1g.20gb/2g.20gb/3g.40gb/4g.40gb/7g.80gb and
  1g.18gb/1g.35gb/2g.35gb/3g.71gb/4g.71gb/7g.141gb). A 3g instance takes 4 memory slices and a 1g.10gb
  (A100 40 GB) 2, as the guide's fractions of memory say (4/8, 2/8).
- Placement starts: the guide's placement diagrams and ``nvidia-smi mig -lgipp`` /
  ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``: 1-slice profiles {0..6}:1, the 2-memory-slice 1g
  {0,2,4,6}:2, 2g {0,2,4}:2, 3g {0,4}:4, 4g {0}:4, 7g {0}:8; the same on A100, H100 and H200.
- ``nvml_profile``: the ``NVML_GPU_INSTANCE_PROFILE_*`` constants of nvml.h (1_SLICE 0x0, 2_SLICE 0x1,
  3_SLICE 0x2, 4_SLICE 0x3, 7_SLICE 0x4, 1_SLICE_REV2 0x9, the 2-memory-slice 1g). They are not the
  profile IDs ``nvidia-smi mig -lgip`` prints (19, 15, 14, 9, 5, 0).
- ``memory_mib`` (NVML's ``memorySizeMB``): the ``Memory GiB`` column of ``nvidia-smi mig -lgip`` times
  1024, from published outputs: A100-SXM4-40GB 4.75 / 9.62 / 9.62 / 19.50 / 19.50 / 39.25 GiB; A100 80GB
  9.50 / 19.50 / 19.50 / 39.25 / 39.25 / 79.00; H100 80GB HBM3 9.75 / 19.62 / 19.62 / 39.50 / 39.50 /
  79.25 (9.62 and 19.62 are two-decimal roundings of 9.625 and 19.625). H200: 1g.18gb is 16.00 GiB in a
  published ``-lgip`` line, and CUDA reports 69.8 GB (10^9 bytes, 65.0 GiB) for a 3g.71gb device; the
  other H200 values were not found and are DERIVED: the 2-slice profiles as half of 3g.71gb (33280 MiB),
  7g.141gb as twice 3g.71gb plus 256 MiB, the step H100's 7g.80gb shows over its 3g.40gb.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# NVML_GPU_INSTANCE_PROFILE_* (nvml.h)
_NVML_1_SLICE = 0x0
_NVML_2_SLICE = 0x1
_NVML_3_SLICE = 0x2
_NVML_4_SLICE = 0x3
_NVML_7_SLICE = 0x4
_NVML_1_SLICE_REV2 = 0x9

_ONE_SLICE_STARTS = (0, 1, 2, 3, 4, 5, 6)
_TWO_SLICE_STARTS_1G = (0, 2, 4, 6)
_TWO_SLICE_STARTS_2G = (0, 2, 4)
_THREE_G_STARTS = (0, 4)
_WHOLE_STARTS = (0,)


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of one model."""

    #: As the device plugin spells it in ``nvidia.com/mig-<name>``, e.g. ``1g.10gb``.
    name: str
    #: Compute slices (of the model's 7).
    compute_slices: int
    #: Size in memory slices (of the model's 8): the width of a placement.
    memory_slices: int
    #: The instance's memory as NVML reports it (``memorySizeMB``, in MiB).
    memory_mib: int
    #: Valid placement starts, memory-slice offsets (``nvmlDeviceGetGpuInstancePossiblePlacements_v2``).
    starts: tuple[int, ...]
    #: At most this many instances of the profile on one GPU.
    max_instances: int
    #: The ``NVML_GPU_INSTANCE_PROFILE_*`` constant that names the profile to NVML.
    nvml_profile: int


@dataclass(frozen=True)
class MigModel:
    """A MIG-capable GPU model: its profiles and the slices it has."""

    model: str
    profiles: tuple[MigProfile, ...]
    memory_slices: int = 8
    compute_slices: int = 7

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)


def _model(model: str, gb: tuple[str, str, str, str, str, str], mib: tuple[int, ...]) -> MigModel:
    """The profile table every supported model shares, with its names and memory sizes.

    ``gb`` and ``mib`` are in the order 1g (one memory slice), 1g (two), 2g, 3g, 4g, 7g.
    """
    shape = (
        (1, 1, _ONE_SLICE_STARTS, 7, _NVML_1_SLICE),
        (1, 2, _TWO_SLICE_STARTS_1G, 4, _NVML_1_SLICE_REV2),
        (2, 2, _TWO_SLICE_STARTS_2G, 3, _NVML_2_SLICE),
        (3, 4, _THREE_G_STARTS, 2, _NVML_3_SLICE),
        (4, 4, _WHOLE_STARTS, 1, _NVML_4_SLICE),
        (7, 8, _WHOLE_STARTS, 1, _NVML_7_SLICE),
    )
    profiles = tuple(
        MigProfile(
            name=f"{compute}g.{size}gb",
            compute_slices=compute,
            memory_slices=memory,
            memory_mib=memory_mib,
            starts=starts,
            max_instances=count,
            nvml_profile=nvml,
        )
        for (compute, memory, starts, count, nvml), size, memory_mib in zip(shape, gb, mib, strict=True)
    )
    return MigModel(model=model, profiles=profiles)


MIG_MODELS: Mapping[str, MigModel] = MappingProxyType(
    {
        m.model: m
        for m in (
            _model("A100-40GB", ("5", "10", "10", "20", "20", "40"), (4864, 9856, 9856, 19968, 19968, 40192)),
            _model(
                "A100-80GB", ("10", "20", "20", "40", "40", "80"), (9728, 19968, 19968, 40192, 40192, 80896)
            ),
            _model(
                "H100-80GB", ("10", "20", "20", "40", "40", "80"), (9984, 20096, 20096, 40448, 40448, 81152)
            ),
            _model(
                "H200-141GB",
                ("18", "35", "35", "71", "71", "141"),
                (16384, 33280, 33280, 66560, 66560, 133376),
            ),
        )
    }
)

#: Every profile name some supported model has.
KNOWN_PROFILES: frozenset[str] = frozenset(p.name for m in MIG_MODELS.values() for p in m.profiles)

# NVML product names (nvmlDeviceGetName) of the supported models. The 94 GB H100 NVL and the GH200 have
# other profile tables (1g.12gb, 1g.24gb, ...) and are not supported: they match nothing here.
_NVML_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bA100\b.*\b80\s?GB\b"), "A100-80GB"),
    (re.compile(r"\bA100\b(?!.*\b80\s?GB\b)"), "A100-40GB"),
    (re.compile(r"\bH100\b(?!.*\b(NVL|94\s?GB|96\s?GB)\b)"), "H100-80GB"),
    (re.compile(r"(?<![A-Z0-9])H200\b"), "H200-141GB"),
)


def mig_model(model: str) -> MigModel | None:
    """The MIG tables of a model named as the simulated inventory does (``H100-80GB``) or as NVML does
    (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA H200 NVL``); None for a model without
    MIG or with tables gpufrac does not carry (L4, T4, A10, L40S, H100 NVL, GH200)."""
    if model in MIG_MODELS:
        return MIG_MODELS[model]
    name = model.upper().replace("_", " ")
    for pattern, key in _NVML_NAMES:
        if pattern.search(name):
            return MIG_MODELS[key]
    return None
