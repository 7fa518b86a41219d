"""The profile tables: what NVIDIA's MIG user guide and NVML say of each supported model, and the models
NVML product names and the simulated inventory's names resolve to."""

from __future__ import annotations

import pytest

from gpufrac.mig.profiles import KNOWN_PROFILES, MIG_MODELS, mig_model
from gpufrac.node.inventory.simulated import MODEL_MIB


@pytest.mark.parametrize("model", sorted(MIG_MODELS))
def test_each_table_is_the_guides_shape(model: str) -> None:
    mig = MIG_MODELS[model]
    by_compute = [(p.compute_slices, p.memory_slices, p.starts, p.max_instances) for p in mig.profiles]
    assert by_compute == [
        (1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
        (1, 2, (0, 2, 4, 6), 4),
        (2, 2, (0, 2, 4), 3),
        (3, 4, (0, 4), 2),
        (4, 4, (0,), 1),
        (7, 8, (0,), 1),
    ]
    for p in mig.profiles:
        assert p.name.startswith(f"{p.compute_slices}g.")
        assert all(start + p.memory_slices <= mig.memory_slices for start in p.starts)
        # A slice never has more memory than its share of the GPU the simulated inventory gives.
        assert p.memory_mib <= MODEL_MIB[model] * p.memory_slices // mig.memory_slices
    mib = {p.memory_slices: p.memory_mib for p in mig.profiles}
    assert mib[1] < mib[2] < mib[4] < mib[8]


def test_nvml_profile_constants() -> None:
    """NVML_GPU_INSTANCE_PROFILE_1_SLICE .. 7_SLICE are 0..4 and the 2-memory-slice 1g is 1_SLICE_REV2 (9)."""
    for mig in MIG_MODELS.values():
        assert [p.nvml_profile for p in mig.profiles] == [0, 9, 1, 2, 3, 4]


def test_known_profiles_are_the_device_plugins_names() -> None:
    assert {"1g.5gb", "1g.10gb", "3g.40gb", "7g.80gb", "1g.18gb", "3g.71gb", "7g.141gb"} <= KNOWN_PROFILES
    assert "1g.5gb+me" not in KNOWN_PROFILES
    assert MIG_MODELS["A100-40GB"].profile("1g.10gb").memory_slices == 2
    assert MIG_MODELS["A100-80GB"].profile("1g.10gb").memory_slices == 1
    assert MIG_MODELS["H100-80GB"].profile("3g.40gb").memory_mib == 40448
    assert MIG_MODELS["A100-40GB"].profile("9g.1gb") is None


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("A100-40GB", "A100-40GB"),
        ("H200-141GB", "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA H200 NVL", "H200-141GB"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA L4", None),
        ("Tesla T4", None),
        ("L40S-48GB", None),
        ("", None),
    ],
)
def test_mig_model_of_a_product_name(name: str, model: str | None) -> None:
    found = mig_model(name)
    assert (found.model if found else None) == model
