"""The Eviction subresource: how a scheduler removes a pod while honouring PodDisruptionBudgets.

A plain DELETE ignores disruption budgets; an Eviction (policy/v1, POST pods/<name>/eviction) is refused
with 429 (``TooManyRequests``) when a budget covering the pod allows no disruption now. The ``uid``
precondition makes sure the pod evicted is the one chosen, not a namesake created since. A dry run
asks the same question without evicting, so a caller can try a whole set of victims before touching any.

Not every 429 is a budget's answer: the API server's priority-and-fairness filter sheds load with a 429
too ("please try again later", ``Retry-After``), and a budget's refusal is the one whose Status names the
``DisruptionBudget`` cause. Taking a throttled eviction for a budget's refusal made the scheduler put the
victim aside for a minute and look for other (more) victims. So a throttled eviction is tried again after
the server's ``Retry-After`` (``TooManyRequests.wait_s``), as are a 5xx and a lost answer: an eviction is
idempotent for one pod uid (a repeat of one that landed finds the pod terminating, or answers 404 once it
is gone), so repeating it cannot evict anything else. ``attempts`` bounds the repeats; the last error is
raised.
"""

from __future__ import annotations

import asyncio
import logging

import httpx2
from lightkube import AsyncClient
from lightkube.models.meta_v1 import DeleteOptions, ObjectMeta, Preconditions
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.errors import KubeError, TooManyRequests
from gpufrac.kube.stream import post_subresource

log = logging.getLogger(__name__)

ATTEMPTS = 5
_MAX_BACKOFF_S = 5.0


async def evict_pod(
    client: AsyncClient,
    *,
    name: str,
    namespace: str,
    uid: str | None = None,
    dry_run: bool = False,
    attempts: int = ATTEMPTS,
) -> None:
    """Evict; raises ``TooManyRequests`` when a disruption budget refuses, ``NotFound`` when gone, and
    the last error when the API server still sheds load or fails after ``attempts``."""
    eviction = Pod.Eviction(
        metadata=ObjectMeta(name=name, namespace=namespace),
        deleteOptions=DeleteOptions(
            preconditions=Preconditions(uid=uid) if uid else None,
            dryRun=["All"] if dry_run else None,
        ),
    )
    for attempt in range(1, attempts + 1):
        try:
            await post_subresource(client, eviction, name=name, namespace=namespace)
            return
        except TooManyRequests as error:
            if error.disruption_budget or attempt == attempts:
                raise
            wait = error.wait_s
        except KubeError as error:
            if error.code < 500 or attempt == attempts:
                raise
            wait = min(_MAX_BACKOFF_S, 0.2 * 2**attempt)
        except (httpx2.HTTPError, OSError):
            # The answer was lost (the eviction may have landed): asking again is safe, see above.
            if attempt == attempts:
                raise
            wait = min(_MAX_BACKOFF_S, 0.2 * 2**attempt)
        log.info(
            "eviction of %s/%s not answered (attempt %d), trying again in %.1fs",
            namespace,
            name,
            attempt,
            wait,
        )
        await asyncio.sleep(wait)
