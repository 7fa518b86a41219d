"""MPS supervision on the node: the REAL supervisor (tests run it against a STAND-IN control daemon).

The node agent owns the NVIDIA MPS control daemon on its node. What it runs depends on the driver:
r615 and newer get the MPS v3 interface (``nvidia-cuda-mps-control -p 3 -m -f -a <toml>``) with
per-process memory accounting and one context-share server (``shared``) on which every sm-sharing
container gets its own namespace; older drivers get classic MPS, used for sm-sharing containers only.
Whatever actually runs decides which compute modes the node advertises (``capability``), so the scheduler
never promises what the node cannot enforce.

Modules, one job each:

- ``mode``       driver version -> MPS mode, and the node capability derived from what runs
- ``config``     the supervisor's settings (binary, directories, timeouts, backoff)
- ``backoff``    exponential restart backoff whose budget resets after a stable period
- ``v3config``   the TOML handed to ``-a`` in v3 mode
- ``control``    typed control commands, issued through the control binary as a client
- ``daemon``     one daemon process: spawn, wait for the control socket, stop, sweep stray servers
- ``events``     the ``EventSink`` seam and its Kubernetes implementation (core/v1 Events)
- ``supervisor`` the state machine: start, restart with backoff, wedge recovery, namespace reconcile
- ``containers`` per-container MPS plans and the ``ContainerHooks`` seam used by the NRI plugin

The stand-in control daemon the tests run in place of ``nvidia-cuda-mps-control`` is a test double and
lives with the tests (``tests/node/mps/mps_standin.py``), not in the agent's package.
"""
