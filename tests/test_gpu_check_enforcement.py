"""scripts/gpu-check's enforcement step (driver per-cgroup GPU memory limits): the parts that need no GPU.

The script is a file without ``.py``; it is loaded as a module here. What is tested: where the throwaway
cgroup is made (mountinfo), which cgroup a process is in (/proc/<pid>/cgroup), when the step runs, the
verdict of every row, the table and the exit status. Where this machine lets the tests make a cgroup, a
real client of the script is run inside one (no GPU needed for the membership half). What only a GPU
machine shows (the driver's answers, CUDA allocations, the transparent view) is not simulated here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def _load():
    loader = SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check_script"] = module
    loader.exec_module(module)
    return module


gc = _load()
MIB = 1 << 20
MAX = gc.LIMIT_MAX

PURE_V2 = """\
24 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""

# This development machine's own mountinfo: a hybrid host (v1 controllers, cgroup2 at .../unified).
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def args(**overrides) -> argparse.Namespace:
    base = dict(
        only=None,
        enforcement=False,
        soft_mib=2048,
        hard_mib=4096,
        chunk_mib=64,
        overhead_mib=1024,
        refill_chunk_mib=256,
        resize_hard_mib=0,
    )
    return argparse.Namespace(**{**base, **overrides})


# --- where the cgroup is made, and which cgroup a process is in ----------------------------------------


def test_pure_v2_host_uses_the_unified_mount():
    assert gc.cgroup_mount(PURE_V2) == gc.CgroupMount(2, Path("/sys/fs/cgroup"), "/")


def test_hybrid_and_v1_hosts_use_the_memory_hierarchy():
    assert gc.cgroup_mount(HYBRID) == gc.CgroupMount(1, Path("/sys/fs/cgroup/memory"), "/")
    # memory co-mounted with other controllers (superoptions name them all)
    text = "35 31 0:32 / /sys/fs/cgroup/memory,hugetlb rw - cgroup cgroup rw,hugetlb,memory\n"
    assert gc.cgroup_mount(text).mountpoint == Path("/sys/fs/cgroup/memory,hugetlb")


def test_no_cgroup_filesystem_is_none():
    assert gc.cgroup_mount("24 1 259:2 / / rw - ext4 /dev/sda1 rw\n") is None
    # a v1 hierarchy without memory is not where the driver accounts memory
    assert gc.cgroup_mount("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n") is None


def test_a_mount_under_sys_fs_cgroup_wins_and_escapes_are_decoded():
    text = (
        "50 1 0:40 / /host/sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
        "51 1 0:41 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
        "52 1 0:42 / /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n"
    )
    assert gc.cgroup_mount(text) == gc.CgroupMount(2, Path("/sys/fs/cgroup"), "/kubepods")
    assert gc.cgroup_mount(text.splitlines()[2]).mountpoint == Path("/mnt/my cgroups")


def test_proc_cgroup_path_v2_and_v1():
    v2 = "0::/gpufrac-check-42\n"
    v1 = "9:name=systemd:/\n4:memory:/gpufrac-check-42\n1:cpu:/\n0::/\n"
    assert gc.proc_cgroup_path(v2, version=2) == "/gpufrac-check-42"
    assert gc.proc_cgroup_path(v1, version=1) == "/gpufrac-check-42"
    assert gc.proc_cgroup_path(v1, version=2) == "/"  # the hybrid host's unified line, not the memory one
    assert gc.proc_cgroup_path("4:memory,hugetlb:/a/b\n", version=1) == "/a/b"
    assert gc.proc_cgroup_path("1:cpu:/\n", version=1) is None
    assert gc.proc_cgroup_path("", version=2) is None


def test_cgroup_paths_follow_the_mount():
    mount = gc.CgroupMount(2, Path("/sys/fs/cgroup"), "/")
    name = gc.check_cgroup_name(42)
    assert name == "gpufrac-check-42"
    assert gc.cgroup_dir(mount, name) == Path("/sys/fs/cgroup/gpufrac-check-42")
    assert gc.expected_proc_path(mount, name) == "/gpufrac-check-42"
    nested = gc.CgroupMount(2, Path("/sys/fs/cgroup"), "/kubepods/")
    assert gc.expected_proc_path(nested, name) == "/kubepods/gpufrac-check-42"


def test_membership_row():
    mount = gc.CgroupMount(1, Path("/sys/fs/cgroup/memory"), "/")
    inside = {"pid": 7, "proc_cgroup": "4:memory:/gpufrac-check-42\n0::/\n"}
    outside = {"pid": 7, "proc_cgroup": "4:memory:/process_api/x\n0::/\n"}
    row = gc.membership_row("in", result=inside, mount=mount, name="gpufrac-check-42")
    assert row.ok and row.observed == "pid 7 in /gpufrac-check-42"
    assert not gc.membership_row("in", result=outside, mount=mount, name="gpufrac-check-42").ok
    failed = gc.membership_row("in", result="client gave no result (exit 1): denied", mount=mount, name="n")
    assert not failed.ok and "denied" in failed.observed


# --- when the step runs --------------------------------------------------------------------------------


def test_gate_runs_on_r615_and_later():
    assert gc.enforcement_gate("615.12.01", mig=False, requested=False) is None
    assert gc.enforcement_gate("620.1", mig=False, requested=True) is None


def test_gate_skips_older_drivers_on_a_default_run_as_a_pass():
    row = gc.enforcement_gate("580.65.06", mig=False, requested=False)
    assert row.ok
    assert "driver r580 does not support per-cgroup limits (r615+)" in row.observed


def test_gate_runs_on_older_drivers_when_asked_so_the_driver_answers():
    assert gc.enforcement_gate("580.65.06", mig=False, requested=True) is None


def test_gate_on_mig_passes_by_default_and_fails_when_asked():
    assert gc.enforcement_gate("615.1", mig=True, requested=False).ok
    row = gc.enforcement_gate("615.1", mig=True, requested=True)
    assert not row.ok and "MIG" in row.observed


def test_requested_by_name():
    assert not gc.enforcement_requested(args())
    assert not gc.enforcement_requested(args(only="mps"))
    assert gc.enforcement_requested(args(only="enforcement"))
    assert gc.enforcement_requested(args(enforcement=True))


def test_unsupported_driver_rows():
    row = gc.unsupported_row("580.65.06", gc.NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found")
    assert not row.ok
    assert row.observed.startswith("driver r580 does not support per-cgroup limits (r615+)")
    assert "NVML_ERROR_FUNCTION_NOT_FOUND" in row.observed
    refused = gc.unsupported_row("615.2", gc.NVML_ERROR_NOT_SUPPORTED, "Not Supported")
    assert not refused.ok and refused.observed.startswith("driver r615 refuses per-cgroup limits")
    assert gc.unsupported_row("615.2", 4, "Insufficient Permissions") is None  # reported as its own check


def test_options_that_make_no_sense_are_refused():
    assert gc.enforcement_args_problem(args()) is None
    assert gc.enforcement_args_problem(args(soft_mib=4096, hard_mib=4096)) is None
    assert "--soft-mib" in gc.enforcement_args_problem(args(soft_mib=5000))
    assert gc.enforcement_args_problem(args(hard_mib=0, soft_mib=0)) is not None
    assert gc.enforcement_args_problem(args(chunk_mib=0)) is not None
    assert gc.enforcement_args_problem(args(resize_hard_mib=4096)) is not None  # not a raise
    assert gc.enforcement_args_problem(args(resize_hard_mib=8192)) is None
    assert gc.enforcement_args_problem(args(chunk_mib=8192)) is not None
    assert gc.enforcement_args_problem(args(only="mps", enforcement=True)) is not None


# --- the rows' verdicts ----------------------------------------------------------------------------------


def test_limits_row_needs_exact_bytes():
    want = (2048 * MIB, 4096 * MIB)
    assert gc.limits_row("rb", want=want, got=gc.Limits(2048 * MIB, 4096 * MIB, 5)).ok
    rounded = gc.limits_row("rb", want=want, got=gc.Limits(2048 * MIB, 4096 * MIB - 4096))
    assert not rounded.ok and rounded.observed == f"soft 2048 MiB / hard {4096 * MIB - 4096} B"
    cleared = gc.limits_row("rb", want=(0, MAX), got=gc.Limits(0, MAX))
    assert cleared.ok and cleared.expected == "soft 0 / hard MAX"
    assert not gc.limits_row("rb", want=want, got="NVML_ERROR_NO_PERMISSION (x)").ok


def test_alloc_row():
    ok = {"code": 0, "error": "CUDA_SUCCESS"}
    oom = {"code": 2, "error": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert gc.alloc_row("a", should_succeed=True, result=ok).ok
    assert not gc.alloc_row("a", should_succeed=True, result=oom).ok
    assert gc.alloc_row("a", should_succeed=False, result=oom).ok
    assert not gc.alloc_row("a", should_succeed=False, result=ok).ok
    assert not gc.alloc_row("a", should_succeed=True, result="client gave no result").ok


def fill(allocated, stop="CUDA_ERROR_OUT_OF_MEMORY", free=80000):
    return {"allocated_mib": allocated, "stop_error": stop, "cap_mib": 4352, "free_mib": free}


def test_fill_stops_just_below_the_hard_limit():
    row = gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(3584))
    assert row.ok and row.observed == "3584 MiB, then CUDA_ERROR_OUT_OF_MEMORY"
    assert gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(4096)).ok
    assert gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(3072)).ok


def test_fill_that_stops_early_late_oddly_or_never_fails():
    assert not gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(2048)).ok  # far too early
    assert not gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(4160)).ok  # over the limit
    assert not gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(3584, "CUDA_ERROR_UNKNOWN")).ok
    never = gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result=fill(4352, None))
    assert not never.ok and "NOT enforced" in never.observed
    assert not gc.fill_row("f", hard_mib=4096, overhead_mib=1024, result="killed").ok


def test_refill_needs_about_all_free_memory_and_more_than_the_old_limit():
    assert gc.refill_row("r", old_hard_mib=4096, overhead_mib=1024, result=fill(79872, free=80000)).ok
    assert not gc.refill_row("r", old_hard_mib=4096, overhead_mib=1024, result=fill(4096, free=80000)).ok
    # a nearly full GPU: the fill must still pass the old limit
    assert not gc.refill_row("r", old_hard_mib=4096, overhead_mib=1024, result=fill(4096, free=4500)).ok
    assert gc.refill_row("r", old_hard_mib=4096, overhead_mib=1024, result=fill(4352, free=4500)).ok


def held(allocated, stop="CUDA_ERROR_OUT_OF_MEMORY", pid=41):
    """A ``--client resize`` answer."""
    return {"pid": pid, "allocated_mib": allocated, "stop_error": stop}


def test_a_raised_limit_lets_the_same_process_grow_to_it_and_no_further():
    grow = dict(old_hard_mib=4096, new_hard_mib=8192, overhead_mib=1024, before=held(0))
    row = gc.resize_grow_row("g", **grow, after=held(8000))
    assert row.ok and row.observed == "pid 41 (same), 8000 MiB, then CUDA_ERROR_OUT_OF_MEMORY"
    assert not gc.resize_grow_row("g", **grow, after=held(4032)).ok  # stuck at the old limit: not raised
    assert not gc.resize_grow_row("g", **grow, after=held(8256)).ok  # past the new one
    never = gc.resize_grow_row("g", **grow, after=held(8448, stop=None))
    assert not never.ok and "no failure" in never.observed
    other = gc.resize_grow_row("g", **grow, after=held(8000, pid=42))
    assert not other.ok and "ANOTHER" in other.observed  # a restarted client proves nothing about a live one
    assert not gc.resize_grow_row("g", **grow | {"before": "client exited"}, after=held(8000)).ok
    # A small raise: growing past the old limit at all is required, whatever the overhead allows.
    assert not gc.resize_grow_row("g", **grow | {"new_hard_mib": 4352}, after=held(4096)).ok


def test_a_lowered_limit_caps_the_same_process():
    capped = dict(hard_mib=2048, overhead_mib=1024, before=held(0))
    assert gc.resize_capped_row("c", **capped, after=held(2048)).ok
    assert not gc.resize_capped_row("c", **capped, after=held(2560, stop=None)).ok  # grew past it
    other = gc.resize_capped_row("c", **capped, after=held(2048, pid=7))
    assert not other.ok and "ANOTHER pid 7" in other.observed


def test_the_commanded_client_protocol_one_json_line_per_command(tmp_path):
    """The parent's side of ``--client resize`` against a real process speaking the same lines (the CUDA
    half needs a GPU): the ready line, one answer per command, and a client that dies is reported."""
    echo = tmp_path / "echo.py"
    echo.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'pid': os.getpid(), 'allocated_mib': 0}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    if line.startswith('die'): sys.exit(3)\n"
        "    print('noise', flush=True)\n"
        "    print(json.dumps({'pid': os.getpid(), 'allocated_mib': int(line.split()[1])}), flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, str(echo)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = gc.CommandedClient(process)
    try:
        ready = client.read(timeout_s=30)
        assert ready == {"pid": process.pid, "allocated_mib": 0}
        assert client.command("fill 4096 64") == {"pid": process.pid, "allocated_mib": 4096}
        assert client.command("fill 8192 64")["allocated_mib"] == 8192
        gone = client.command("die")
        assert isinstance(gone, str) and "client exited (3)" in gone
    finally:
        gc.release(process)


def test_current_used_row():
    assert gc.current_used_row("u", low_mib=2048, high_mib=4096, got=gc.Limits(1, 2, 2560 * MIB)).ok
    assert not gc.current_used_row("u", low_mib=2048, high_mib=4096, got=gc.Limits(1, 2, 0)).ok
    assert not gc.current_used_row("u", low_mib=2048, high_mib=4096, got=gc.Limits(1, 2, 5000 * MIB)).ok
    assert not gc.current_used_row("u", low_mib=2048, high_mib=4096, got="NVML_ERROR_UNKNOWN").ok


def test_view_row_records_what_the_tool_shows():
    fraction = gc.view_row("v", total_mib=4096, used_mib=2600, hard_mib=4096, gpu_mib=81559)
    assert fraction.ok and "(the fraction)" in fraction.observed
    whole = gc.view_row("v", total_mib=81559, used_mib=2600, hard_mib=4096, gpu_mib=81559)
    assert not whole.ok and "whole GPU: no transparent view" in whole.observed
    cuda_total = gc.view_row("v", total_mib=81090, used_mib=2600, hard_mib=4096, gpu_mib=81559)
    assert "whole GPU" in cuda_total.observed  # cuMemGetInfo's total is a little under NVML's
    odd = gc.view_row("v", total_mib=2048, used_mib=0, hard_mib=4096, gpu_mib=81559)
    assert not odd.ok and "neither" in odd.observed
    assert not gc.view_row("v", total_mib=None, used_mib=None, hard_mib=4096, gpu_mib=81559).ok


def test_view_rows_of_each_client():
    smi = {"stdout": "memory.total [MiB], memory.used [MiB]\n4096 MiB, 2600 MiB\n", "returncode": 0}
    assert gc.smi_view_row(smi, hard_mib=4096, gpu_mib=81559).ok
    missing = {"stdout": "", "returncode": None, "stderr": "No such file or directory: 'nvidia-smi'"}
    row = gc.smi_view_row(missing, hard_mib=4096, gpu_mib=81559)
    assert not row.ok and "nvidia-smi" in row.observed
    nvml = {"total_mib": 81559, "used_mib": 3000, "v2": {"total_mib": 81559, "used_mib": 3500}}
    row = gc.nvml_view_row(nvml, hard_mib=4096, gpu_mib=81559)
    assert not row.ok and "v2 total 81559 MiB" in row.observed
    cuda = {"total_mib": 4096, "free_mib": 2000}
    row = gc.cuda_view_row(cuda, hard_mib=4096, gpu_mib=81559)
    assert row.ok and "used 2096 MiB" in row.observed


def test_nvidia_smi_memory():
    text = "memory.total [MiB], memory.used [MiB]\n81559 MiB, 0 MiB\n"
    assert gc.nvidia_smi_memory(text) == (81559, 0)
    assert gc.nvidia_smi_memory("81559 MiB, 12 MiB") == (81559, 12)
    assert gc.nvidia_smi_memory("memory.total [MiB], memory.used [MiB]\n[N/A], [N/A]\n") is None
    assert gc.nvidia_smi_memory("No devices were found\n") is None
    assert gc.nvidia_smi_memory("") is None


def test_removed_cgroup_row():
    assert gc.removed_row("r", got="NVML_ERROR_NOT_FOUND (Not Found)").ok
    assert gc.removed_row("r", got=gc.Limits(0, MAX)).ok
    stale = gc.removed_row("r", got=gc.Limits(2048 * MIB, 4096 * MIB))
    assert not stale.ok and stale.observed == "soft 2048 MiB / hard 4096 MiB"


# --- the table and the exit status ----------------------------------------------------------------------


def test_exit_status_and_table():
    good = gc.Row("enforcement: read-back equals set", "soft 2048 MiB / hard 4096 MiB", "same", True)
    bad = gc.Row("enforcement: nvidia-smi in the cgroup", "total = hard limit 4096 MiB", "total 81559", False)
    assert gc.exit_status([good]) == 0
    assert gc.exit_status([good, bad]) == 1
    table = gc.format_table([good, bad], header="gpufrac GPU check — test")
    lines = table.splitlines()
    assert "gpufrac GPU check — test" in lines
    assert lines[-1] == "FAIL: 1/2 checks"
    body = [line for line in lines if line.startswith("| enforcement")]
    assert len(body) == 2 and body[0].endswith("| ✓  |") and body[1].endswith("| ✗  |")
    assert len({len(line) for line in lines if line.startswith("|")}) == 1  # columns line up
    assert gc.format_table([good], header="h").splitlines()[-1] == "PASS: 1/1 checks"


# --- the script as a program, on this machine (no GPU) ---------------------------------------------------


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120, check=False
    )


def test_help_lists_the_enforcement_options():
    done = run_script("--help")
    assert done.returncode == 0
    for option in (
        "--only {mps,enforcement,mig}",
        "--enforcement",
        "--soft-mib",
        "--hard-mib",
        "--resize-hard-mib",
    ):
        assert option in done.stdout


def test_contradicting_options_are_a_usage_error():
    done = run_script("--only", "mps", "--enforcement")
    assert done.returncode == 2 and "contradict" in done.stderr


def _nvml_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_present(), reason="this machine has NVML: run the script itself")
def test_without_a_gpu_it_exits_2_and_says_why():
    for argv in ((), ("--only", "enforcement")):
        done = run_script(*argv)
        assert done.returncode == 2
        assert "no usable NVIDIA GPU here" in done.stderr


def _writable_mount():
    try:
        mount = gc.cgroup_mount(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None
    if mount is None or os.geteuid() != 0:
        return None
    probe = mount.mountpoint / f"gpufrac-check-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return None
    probe.rmdir()
    return mount


WRITABLE = _writable_mount()


@pytest.mark.skipif(WRITABLE is None, reason="cgroups are not writable here (needs root on a cgroup host)")
def test_a_client_moves_itself_into_the_cgroup_before_anything_else():
    """The real script's client, in a real cgroup: it reports the cgroup it runs in (the nvidia-smi client
    needs no GPU to get that far; without nvidia-smi its reading is an error row, not a crash)."""
    name = f"gpufrac-check-test-{os.getpid()}"
    path = gc.cgroup_dir(WRITABLE, name)
    path.mkdir()
    try:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--client", "smi", "--cgroup", str(path), "--uuid", "GPU-none"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        result = gc.client_result(process, timeout_s=60)
        gc.release(process)
        assert isinstance(result, dict), result
        assert gc.membership_row("m", result=result, mount=WRITABLE, name=name).ok
        if not gc.nvidia_smi_memory(str(result["stdout"])):
            assert not gc.smi_view_row(result, hard_mib=4096, gpu_mib=81559).ok
    finally:
        assert gc.remove_cgroup(path) is None
    assert not path.exists()


@pytest.mark.skipif(WRITABLE is None or _nvml_present(), reason="needs writable cgroups and no NVML")
def test_a_failure_inside_the_step_leaves_a_row_and_no_cgroup():
    """With no NVML behind it the step fails after making its cgroup: it must say so in a row and still
    remove the cgroup (the path a surprise on real hardware would take)."""
    rows: list = []
    gpu = SimpleNamespace(uuid="GPU-none", mig=False, mib=81559)
    gc.check_enforcement(rows, driver_version="615.1", gpu=gpu, args=args(only="enforcement"), env={})
    assert rows[0].check == "enforcement: throwaway cgroup" and rows[0].ok
    assert rows[-1].check == "enforcement: step completes" and not rows[-1].ok
    assert not gc.cgroup_dir(WRITABLE, gc.check_cgroup_name(os.getpid())).exists()
    assert gc.exit_status(rows) == 1


def test_describe_cgroup_names_version_and_controllers(tmp_path):
    v1 = gc.CgroupMount(1, Path("/sys/fs/cgroup/memory"), "/")
    assert gc.describe_cgroup(Path("/sys/fs/cgroup/memory/x"), v1).endswith("(cgroup v1, memory hierarchy)")
    v2 = gc.CgroupMount(2, tmp_path, "/")
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert gc.describe_cgroup(tmp_path, v2).endswith("(cgroup v2, controllers: cpu io memory pids)")
    (tmp_path / "cgroup.controllers").write_text("\n")
    assert gc.describe_cgroup(tmp_path, v2).endswith("controllers: none)")
    assert "unreadable" in gc.describe_cgroup(tmp_path / "gone", v2)
