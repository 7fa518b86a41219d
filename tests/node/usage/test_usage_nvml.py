"""The REAL NVML backend cannot run without a GPU; what can be checked here is how it fails."""

from __future__ import annotations

import pynvml
import pytest

from gpufrac.node.usage.nvml import NvmlUsage


def test_without_a_driver_the_nvml_backend_refuses_to_start_with_nvmls_own_error():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a GPU machine
        pynvml.nvmlShutdown()
        pytest.skip("NVML is available here; the GPU check covers this backend")
    with pytest.raises(pynvml.NVMLError):
        NvmlUsage()
