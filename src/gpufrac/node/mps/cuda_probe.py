"""The MPS probe's test client (REAL; needs the NVIDIA driver's ``libcuda.so.1``): become an MPS client
the way every workload does, and exit.

With CUDA <= 13.5 a client killed with GPU work in flight orphans that work on its MPS server, and every
client that connects afterwards hangs inside CUDA initialisation while the control daemon answers as
usual (NVIDIA: a known limitation, fixed in CUDA 13.6 / r625). Nothing the control daemon says shows it;
only a client does. So the supervisor (``gpufrac.node.mps.probe``) runs this program with
``CUDA_MPS_PIPE_DIRECTORY`` pointing at the server and a timeout: exit 0 means a client got a context;
not exiting in time means the server is wedged. A non-zero exit is an error of the probe itself (no
driver library, no device), which proves nothing about MPS.

It uses ctypes on the driver API (``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``: the context
is where an MPS client attaches to its server) so that the agent image needs no CUDA toolkit.
"""

from __future__ import annotations

import ctypes
import sys


def main() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        print(f"cuda probe: no driver library: {error}", file=sys.stderr)
        return 2
    if (code := cuda.cuInit(0)) != 0:
        print(f"cuda probe: cuInit failed with CUresult {code}", file=sys.stderr)
        return 1
    device = ctypes.c_int()
    if (code := cuda.cuDeviceGet(ctypes.byref(device), 0)) != 0:
        print(f"cuda probe: cuDeviceGet failed with CUresult {code}", file=sys.stderr)
        return 1
    context = ctypes.c_void_p()
    if (code := cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)) != 0:
        print(f"cuda probe: no context (CUresult {code})", file=sys.stderr)
        return 1
    cuda.cuDevicePrimaryCtxRelease(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
