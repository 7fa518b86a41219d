"""The node's last word on GPU memory (and mode): a claim's share is prepared only if it fits beside what
the node already holds on that GPU, and in the mode the GPU is held in.

The stock kube-scheduler keeps the claims of our driver within each GPU's ``memory`` capacity, but it
does not know the annotation pods gpufrac-scheduler binds to the same GPUs (their memory is booked in
gpufrac-scheduler's ledger, not in any claim). So at prepare the node adds up what each GPU holds and
refuses a share that would go past the GPU's usable MiB, naming the GPU, the amounts and who holds them;
the kubelet retries, and the pod starts once enough is released (like the refusal of a mixed mode).

What a GPU holds, and why these sources:

- **Prepared claims**: their CDI specs (``prepare.read_prepared``), the node's own state; each share's
  request MiB (a share with no consumed capacity holds the whole GPU).
- **Annotation pods**: the pods bound to this node as the API server has them (a field selector on
  ``spec.nodeName``), read at each prepare; each container's binding (``contract.render.read_binding``,
  the node's one reader of a bound pod) gives its devices and request MiB (an exclusive container holds
  the whole GPU). This source is complete: gpufrac-scheduler's binder writes the annotations and
  ``nodeName`` in one update (its default ``atomic`` binding), so a pod holds memory here from the moment
  it is bound -- before the kubelet has admitted it, before its sandbox or any container exists. What the
  agent learns over NRI (its mapping records, made at CreateContainer) would miss exactly those pods,
  which is the race that matters: a claim pod and an annotation pod started at the same time. Pods that
  have finished (``Succeeded``/``Failed``) hold nothing; a pod being deleted still does until it is gone.

What is counted is the request (the guaranteed amount, what both schedulers book), never a limit above
it: a limit lets a container use memory it is not guaranteed, on either path. The same annotation pods
say which compute mode they hold a GPU in (``pod_modes``), which ``prepare.refuse_mixed_modes`` weighs
with the prepared claims' modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufrac.contract.dra import AllocationError
from gpufrac.contract.errors import ContractError
from gpufrac.contract.render import read_binding
from gpufrac.node.dra.prepare import PreparedDevice, PreparedShare
from gpufrac.node.inject import is_cdi_name

#: Pod phases whose containers are gone: they hold no GPU memory.
FINISHED_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class NodeGpu:
    """A GPU as the DRA driver offers it: its UUID, index and usable MiB (the slice's ``memory``)."""

    uuid: str
    index: int
    usable_mib: int


@dataclass(frozen=True, slots=True)
class Holding:
    """Memory one holder (``claim <ns>/<name>`` or ``pod <ns>/<name>``) has on one GPU."""

    holder: str
    mib: int


def _resolve(device: str, gpus: Iterable[NodeGpu]) -> NodeGpu | None:
    """The node's GPU a binding names, by UUID, index or CDI name ``<kind>=<uuid|index>``."""
    name = device.partition("=")[2] if is_cdi_name(device) else device
    return next((g for g in gpus if name in (g.uuid, str(g.index))), None)


def claim_holdings(
    prepared: Iterable[PreparedDevice], *, gpus: Iterable[NodeGpu]
) -> dict[str, list[Holding]]:
    """GPU UUID -> what prepared claims hold there (a whole-GPU share holds its usable MiB)."""
    usable = {g.uuid: g.usable_mib for g in gpus}
    held: dict[str, list[Holding]] = {}
    for device in prepared:
        uuid = device.bound.devices[0]
        mib = device.bound.request_mib if device.bound.request_mib is not None else usable.get(uuid, 0)
        held.setdefault(uuid, []).append(Holding(holder=f"claim {device.claim}", mib=mib))
    return held


@dataclass(frozen=True, slots=True)
class PodShare:
    """What one annotation pod holds on one GPU: its memory (all its containers there) and mode."""

    uuid: str
    holder: str  # pod <namespace>/<name>
    mode: str
    mib: int


def pod_shares(pods: Iterable[Mapping[str, Any]], *, gpus: Iterable[NodeGpu]) -> list[PodShare]:
    """What the annotation pods among ``pods`` (dicts, as the API server has them) hold on this node's GPUs.

    A pod whose binding the contract refuses holds nothing: its containers are refused at creation."""
    gpus = tuple(gpus)
    found: list[PodShare] = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        metadata = pod.get("metadata") or {}
        try:
            bound = read_binding(metadata.get("annotations") or {})
        except ContractError:
            continue
        per_gpu: dict[tuple[str, str], int] = {}
        for container in bound:
            for device in container.devices:
                gpu = _resolve(device, gpus)
                if gpu is None:
                    continue  # not a GPU of this node: refused at creation, holds nothing here
                mib = gpu.usable_mib if container.request_mib is None else container.request_mib
                key = (gpu.uuid, container.mode.value)
                per_gpu[key] = per_gpu.get(key, 0) + mib
        who = f"pod {metadata.get('namespace')}/{metadata.get('name')}"
        found.extend(PodShare(uuid=u, holder=who, mode=m, mib=mib) for (u, m), mib in per_gpu.items())
    return found


def pod_holdings(shares: Iterable[PodShare]) -> dict[str, list[Holding]]:
    """GPU UUID -> what annotation pods hold there."""
    held: dict[str, list[Holding]] = {}
    for share in shares:
        held.setdefault(share.uuid, []).append(Holding(holder=share.holder, mib=share.mib))
    return held


def pod_modes(shares: Iterable[PodShare]) -> dict[str, dict[str, set[str]]]:
    """GPU UUID -> mode -> the annotation pods holding it in that mode (``prepare.ModesInUse``)."""
    found: dict[str, dict[str, set[str]]] = {}
    for share in shares:
        found.setdefault(share.uuid, {}).setdefault(share.mode, set()).add(share.holder)
    return found


def refuse_overcommit(
    shares: Iterable[PreparedShare],
    *,
    gpus: Iterable[NodeGpu],
    held: Mapping[str, Iterable[Holding]],
    claim: str,
) -> None:
    """Raises ``AllocationError`` when ``claim``'s shares with what ``held`` says each GPU holds already
    would go past a GPU's usable MiB; the message names the GPU, the amounts and every holder."""
    usable = {g.uuid: g.usable_mib for g in gpus}
    asked: dict[str, list[PreparedShare]] = {}
    for share in shares:
        asked.setdefault(share.plan.bound.devices[0], []).append(share)
    for uuid, mine in sorted(asked.items()):
        capacity = usable.get(uuid)
        if capacity is None:
            continue  # prepare_claim refused a device the node does not offer already
        want = sum(capacity if s.plan.bound.request_mib is None else s.plan.bound.request_mib for s in mine)
        holders = list(held.get(uuid) or ())
        booked = sum(h.mib for h in holders)
        if booked + want <= capacity:
            continue
        requests = ", ".join(sorted(s.request for s in mine))
        who = "; ".join(f"{h.mib} MiB by {h.holder}" for h in sorted(holders, key=lambda h: h.holder))
        raise AllocationError(
            f"claim {claim} (request {requests}) asks for {want} MiB on GPU {uuid}, which has "
            f"{capacity} usable MiB of which {booked} are held ({who or 'nothing'}): "
            f"{booked} + {want} = {booked + want} MiB is over {capacity} (the stock kube-scheduler does "
            "not know annotation pods' memory; the node refuses to over-commit). The claim waits until "
            "memory is released"
        )
