"""scripts/gpu-check's MIG step (8): the parts that need no GPU.

When it runs (only when asked: it changes the GPU's mode), the clear line it gives when it does not, the
layout it makes on each supported model, and the verdicts of the client's rows. What only a MIG GPU shows
(NVML creating slices, a CUDA client on one) is not simulated here.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from gpufrac.mig.geometry import check_layout, pack
from gpufrac.mig.profiles import mig_model
from gpufrac.node.inventory.backend import GpuInfo

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def _load():
    loader = SourceFileLoader("gpu_check_mig_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check_mig_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_mig_script"] = module
    loader.exec_module(module)
    return module


gc = _load()
H100 = GpuInfo(uuid="GPU-h100", index=0, minor=0, model="NVIDIA H100 80GB HBM3", mib=81559)
L4 = GpuInfo(uuid="GPU-l4", index=0, minor=0, model="NVIDIA L4", mib=23034)


def args(*argv: str) -> argparse.Namespace:
    return argparse.Namespace(only=None, mig=False, enforcement=False) if not argv else _parse(argv)


def _parse(argv: tuple[str, ...]) -> argparse.Namespace:
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    return argparse.Namespace(only=only, mig="--mig" in argv, enforcement="--enforcement" in argv)


def test_a_default_run_does_not_touch_mig_and_says_how_to_ask_for_it():
    row = gc.mig_gate(H100, requested=gc.mig_requested(args()))
    assert row is not None and row.ok
    assert row.observed == "not asked for (it enables MIG on the GPU and may reset it); step not run"


@pytest.mark.parametrize("argv", [("--mig",), ("--only", "mig")])
def test_asked_for_on_a_mig_capable_gpu_the_step_runs(argv):
    assert gc.mig_requested(args(*argv))
    assert gc.mig_gate(H100, requested=True) is None


def test_on_a_gpu_without_mig_profiles_the_step_is_skipped_with_the_model_named():
    row = gc.mig_gate(L4, requested=True)
    assert row is not None and row.ok  # nothing changed: a skip, not a failure
    assert row.observed == "NVIDIA L4 has no MIG profiles gpufrac carries; step not run"


@pytest.mark.parametrize(
    ("model", "wanted"),
    [
        ("A100-40GB", ["1g.5gb", "3g.20gb"]),
        ("A100-80GB", ["1g.10gb", "3g.40gb"]),
        ("H100-80GB", ["1g.10gb", "3g.40gb"]),
        ("H200-141GB", ["1g.18gb", "3g.71gb"]),
    ],
)
def test_the_layout_is_the_smallest_profile_and_the_3g_one_and_fits_an_empty_gpu(model, wanted):
    tables = mig_model(model)
    assert tables is not None
    assert gc.mig_test_profiles(tables) == wanted
    layout, left = pack(tables, wanted)
    assert left == () and sorted(s.profile for s in layout) == sorted(wanted)
    check_layout(tables, layout)


def test_the_client_must_see_the_slice_not_the_gpu_and_allocate_half_of_it():
    ok = {"pid": 7, "mib": 4992, "code": 0, "error": "CUDA_SUCCESS", "total_mib": 9728, "free_mib": 9500}
    assert [r.ok for r in gc.mig_client_rows(ok, slice_mib=9984)] == [True, True]
    whole_gpu = {**ok, "total_mib": 81559}  # CUDA_VISIBLE_DEVICES did not narrow it to the slice
    seen, _ = gc.mig_client_rows(whole_gpu, slice_mib=9984)
    assert not seen.ok and seen.observed == "total 81559 MiB"
    refused = {**ok, "code": 2, "error": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert [r.ok for r in gc.mig_client_rows(refused, slice_mib=9984)] == [True, False]
    (failed,) = gc.mig_client_rows("client gave no result within 120s (killed)", slice_mib=9984)
    assert not failed.ok


def test_an_allocation_over_the_slice_must_fail():
    assert gc.mig_over_row({"code": 2, "error": "CUDA_ERROR_OUT_OF_MEMORY"}, slice_mib=9984).ok
    assert not gc.mig_over_row({"code": 0, "error": "CUDA_SUCCESS"}, slice_mib=9984).ok


def test_contradicting_options_are_refused_before_anything_runs():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "enforcement", "--mig"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--only enforcement and --mig contradict each other" in done.stderr
