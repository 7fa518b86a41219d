"""The Eviction subresource: how a scheduler removes a pod while honouring PodDisruptionBudgets.

A plain DELETE ignores disruption budgets; an Eviction (policy/v1, POST pods/<name>/eviction) is refused
with 429 (``TooManyRequests``) when a budget covering the pod allows no disruption now. The ``uid``
precondition makes sure the pod evicted is the one chosen, not a namesake created since. A dry run
asks the same question without evicting, so a caller can try a whole set of victims before touching any.
"""

from __future__ import annotations

from lightkube import AsyncClient
from lightkube.models.meta_v1 import DeleteOptions, ObjectMeta, Preconditions
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.stream import post_subresource


async def evict_pod(
    client: AsyncClient, *, name: str, namespace: str, uid: str | None = None, dry_run: bool = False
) -> None:
    """Evict; raises ``TooManyRequests`` when a disruption budget refuses, ``NotFound`` when gone."""
    eviction = Pod.Eviction(
        metadata=ObjectMeta(name=name, namespace=namespace),
        deleteOptions=DeleteOptions(
            preconditions=Preconditions(uid=uid) if uid else None,
            dryRun=["All"] if dry_run else None,
        ),
    )
    await post_subresource(client, eviction, name=name, namespace=namespace)
