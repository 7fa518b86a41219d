"""Typed API errors: callers branch on the class, never on a message string.

lightkube raises one ``ApiError`` for every status; the scheduler needs to tell "someone changed the
pod under us" (409, retry with the new version) from "the watch window moved on" (410, relist) from
"the pod is gone" (404, forget it). ``translate`` turns lightkube's error (which carries the API's
``Status``) into one of the classes below, keeping the code, the reason and the message, so every
layer above stays free of lightkube's exception type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from lightkube import ApiError

#: The Status cause type of an eviction refused by a PodDisruptionBudget (policy/v1 DisruptionBudgetCause).
DISRUPTION_BUDGET_CAUSE = "DisruptionBudget"
#: The longest a throttled request waits before it is asked again, whatever ``Retry-After`` says.
MAX_RETRY_WAIT_S = 5.0


class KubeError(Exception):
    """An error answered by the API server: ``code`` is the HTTP status, ``reason`` the Status reason,
    ``causes`` the types of its ``details.causes`` and ``retry_after_s`` its ``details.retryAfterSeconds``."""

    code: int = 0

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        reason: str = "",
        causes: tuple[str, ...] = (),
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason
        self.causes = causes
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}" if self.reason else f"{self.code}: {self.message}"


class NotFound(KubeError):
    code = 404


class Conflict(KubeError):
    """409: a precondition (resourceVersion, uid) failed, the object already exists, or a pod is bound."""

    code = 409

    @property
    def already_exists(self) -> bool:
        return self.reason == "AlreadyExists"


class Gone(KubeError):
    """410: the resourceVersion is older than the server keeps; the watcher must list again."""

    code = 410


class Invalid(KubeError):
    """422: the server rejected the object's content."""

    code = 422


class TooManyRequests(KubeError):
    """429: on an eviction, a PodDisruptionBudget does not allow this disruption now (``disruption_budget``);
    otherwise the API server is shedding load (priority and fairness) and asks to come back after
    ``retry_after_s``."""

    code = 429

    @property
    def disruption_budget(self) -> bool:
        return DISRUPTION_BUDGET_CAUSE in self.causes

    @property
    def wait_s(self) -> float:
        """How long to wait before asking again: the server's ``Retry-After`` (1 s when it names none),
        at most ``MAX_RETRY_WAIT_S``."""
        return min(MAX_RETRY_WAIT_S, self.retry_after_s or 1.0)


_BY_CODE: dict[int, type[KubeError]] = {
    c.code: c for c in (NotFound, Conflict, Gone, Invalid, TooManyRequests)
}


def from_status(
    *, code: int | None, reason: str | None, message: str | None, details: Mapping[str, Any] | None = None
) -> KubeError:
    """The typed error for an API ``Status`` (from a response or a watch ERROR event); ``details`` is the
    Status's ``details`` as decoded JSON."""
    cls = _BY_CODE.get(code or 0, KubeError)
    details = details or {}
    causes = tuple(str(c.get("reason") or c.get("type") or "") for c in details.get("causes") or ())
    retry = details.get("retryAfterSeconds")
    return cls(
        message or "",
        code=code or 0,
        reason=reason or "",
        causes=causes,
        retry_after_s=float(retry) if isinstance(retry, int | float) and retry > 0 else None,
    )


def translate(error: ApiError) -> KubeError:
    status = error.status
    code = status.code if status.code else error.response.status_code if error.response else 0
    details = status.details.to_dict() if status.details is not None else None
    return from_status(code=code, reason=status.reason, message=status.message, details=details)


@contextlib.contextmanager
def api_errors() -> Iterator[None]:
    """Re-raise lightkube's ``ApiError`` inside the block as the matching ``KubeError``."""
    try:
        yield
    except ApiError as error:
        raise translate(error) from error
