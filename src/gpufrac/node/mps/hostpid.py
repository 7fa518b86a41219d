"""Whether the MPS daemon can see its clients: it must live in the host's PID namespace.

MPS's memory accounting identifies a client by the pid in its socket's peer credentials, and the kernel
translates that pid only into the reader's own PID namespace or an ancestor's. A control daemon in a
pod's own PID namespace therefore sees every workload container as pid 0, cannot tell their cgroups
apart, and their memory limits go unenforced (NVIDIA's fractioning operator shipped exactly that: "failed
to register client pid 0"; its fix was ``hostPID: true``). gpufrac's daemon is the agent's child, so the
agent checks its own namespace: ``NSpid`` in ``/proc/self/status`` lists the process's pid in each PID
namespace it belongs to, outermost first, so more than one entry means it is not in the host's.
"""

from __future__ import annotations

from pathlib import Path

#: What a fraction routed through such a daemon is told (the node agent's pod needs ``hostPID: true``).
OUTSIDE_HOST_PID = (
    "the MPS daemon runs outside the host PID namespace (the node agent's pod lacks hostPID: true), so it "
    "sees this container's processes as pid 0 and cannot account their GPU memory to its cgroup"
)


def pid_namespaces(status_text: str) -> int:
    """How many PID namespaces a process is in, from the text of its ``/proc/<pid>/status``."""
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        if key == "NSpid":
            return max(1, len(value.split()))
    return 1  # kernels before 4.1 have no NSpid: nothing says it is nested


def outside_host_pid_namespace(status: Path = Path("/proc/self/status")) -> bool:
    """True when this process is in a PID namespace nested below the host's."""
    try:
        return pid_namespaces(status.read_text()) > 1
    except OSError:
        return False
