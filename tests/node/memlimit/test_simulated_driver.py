"""The simulated driver answers the per-cgroup limit calls as NVML does (names, fields, errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.memlimit.driver import (
    LIMIT_MAX,
    MIB,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    MemoryLimitError,
    clear_limits,
)
from gpufrac.node.memlimit.enforce import apply_limits, check_limits
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits

GPU = "GPU-aaaa"
MIG = "GPU-mig"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    (root / "kubepods" / "c1").mkdir(parents=True)
    return root


def driver(tmp_path: Path, root: Path, *, version: str = "615.10.01") -> SimulatedMemoryLimits:
    gpus = (
        GpuInfo(uuid=GPU, index=0, minor=0, model="H100", mib=81559),
        GpuInfo(uuid=MIG, index=1, minor=1, model="H100", mib=81559, mig=True),
    )
    return SimulatedMemoryLimits(
        path=tmp_path / "limits.json", gpus=lambda: gpus, driver_version=lambda: version, cgroup_root=root
    )


def test_set_then_get_reads_back_and_clearing_restores_no_limit(tmp_path: Path, root: Path) -> None:
    nvml = driver(tmp_path, root)
    cgroup = str(root / "kubepods" / "c1")
    assert nvml.get_limits(gpu=GPU, cgroup=cgroup).unlimited
    nvml.set_limits(gpu=GPU, cgroup=cgroup, soft=4096 * MIB, hard=8192 * MIB)
    held = nvml.get_limits(gpu=GPU, cgroup=cgroup)
    assert (held.soft, held.hard) == (4096 * MIB, 8192 * MIB)
    # another process sees the same driver state (the file is the driver)
    assert driver(tmp_path, root).get_limits(gpu=GPU, cgroup=cgroup) == held
    clear_limits(nvml, gpu=GPU, cgroup=cgroup)
    cleared = nvml.get_limits(gpu=GPU, cgroup=cgroup)
    assert (cleared.soft, cleared.hard) == (0, LIMIT_MAX)


def test_removing_the_cgroup_clears_its_limit(tmp_path: Path, root: Path) -> None:
    nvml = driver(tmp_path, root)
    cgroup = root / "kubepods" / "c1"
    nvml.set_limits(gpu=GPU, cgroup=str(cgroup), soft=MIB, hard=2 * MIB)
    cgroup.rmdir()
    assert nvml.held() == {}
    cgroup.mkdir()  # a new cgroup of the same name starts without a limit
    assert nvml.get_limits(gpu=GPU, cgroup=str(cgroup)).unlimited


@pytest.mark.parametrize(
    ("version", "gpu", "cgroup", "code", "words"),
    [
        ("580.65.06", GPU, "kubepods/c1", NVML_ERROR_NOT_SUPPORTED, "r615"),
        ("615.10.01", MIG, "kubepods/c1", NVML_ERROR_NOT_SUPPORTED, "MIG"),
        ("615.10.01", "GPU-other", "kubepods/c1", NVML_ERROR_NOT_FOUND, "no GPU"),
        ("615.10.01", GPU, "kubepods/gone", NVML_ERROR_NOT_FOUND, "does not exist"),
        ("615.10.01", GPU, "relative", NVML_ERROR_INVALID_ARGUMENT, "not a cgroup path"),
        ("615.10.01", GPU, "/etc", NVML_ERROR_INVALID_ARGUMENT, "not under the cgroup root"),
    ],
)
def test_the_driver_s_errors(
    tmp_path: Path, root: Path, version: str, gpu: str, cgroup: str, code: int, words: str
) -> None:
    nvml = driver(tmp_path, root, version=version)
    path = cgroup if cgroup.startswith("/") or cgroup == "relative" else str(root / cgroup)
    for call in (
        lambda: nvml.set_limits(gpu=gpu, cgroup=path, soft=MIB, hard=MIB),
        lambda: nvml.get_limits(gpu=gpu, cgroup=path),
    ):
        with pytest.raises(MemoryLimitError) as caught:
            call()
        assert caught.value.code == code
        assert words in str(caught.value)


def test_soft_above_hard_is_an_invalid_argument(tmp_path: Path, root: Path) -> None:
    nvml = driver(tmp_path, root)
    with pytest.raises(MemoryLimitError) as caught:
        nvml.set_limits(gpu=GPU, cgroup=str(root / "kubepods" / "c1"), soft=2 * MIB, hard=MIB)
    assert caught.value.code == NVML_ERROR_INVALID_ARGUMENT


def test_apply_reads_back_and_a_lying_driver_is_caught(tmp_path: Path, root: Path) -> None:
    nvml = driver(tmp_path, root)
    cgroup = str(root / "kubepods" / "c1")
    done = apply_limits(nvml, cgroup=cgroup, gpus=[GPU], request_mib=4096, limit_mib=6144)
    assert done.in_force, done.describe()
    assert "soft 4096 MiB, hard 6144 MiB read back" in done.describe()

    nvml.tamper(gpu=GPU, cgroup=cgroup)  # cleared behind the agent's back
    seen = check_limits(nvml, cgroup=cgroup, gpus=[GPU], request_mib=4096, limit_mib=6144)
    assert not seen.in_force
    assert "the driver holds no limit" in seen.describe()

    nvml.ignore_sets(gpu=GPU)  # the set "succeeds" and nothing changes: only the read-back can tell
    lied = apply_limits(nvml, cgroup=cgroup, gpus=[GPU], request_mib=4096, limit_mib=6144)
    assert not lied.in_force
    assert cgroup in lied.describe() and GPU in lied.describe()


def test_a_refusal_names_the_gpu_the_values_and_the_nvml_error(tmp_path: Path, root: Path) -> None:
    nvml = driver(tmp_path, root)
    nvml.refuse(gpu=GPU, code=NVML_ERROR_NOT_SUPPORTED)
    cgroup = str(root / "kubepods" / "c1")
    failed = apply_limits(nvml, cgroup=cgroup, gpus=[GPU], request_mib=100, limit_mib=200)
    assert not failed.in_force
    text = failed.describe()
    assert GPU in text and cgroup in text and "soft 100 MiB, hard 200 MiB" in text
    assert "NVML_ERROR_NOT_SUPPORTED" in text
    nvml.refuse(gpu=GPU, code=None)
    assert apply_limits(nvml, cgroup=cgroup, gpus=[GPU], request_mib=100, limit_mib=200).in_force
