"""What dispatch reports as closures and workers change: the observer protocol of the closure
queue, the dispatch loop and the dispatchers.

Dispatch declares what it tells; the coordinator's telemetry (``status``) implements it. So
dispatch imports nothing of the status page or metrics, and a test can pass its own observer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from paramserve.coordinator.dispatch.closures import Closure

__all__ = ["CoordinatorObserver", "NO_OBSERVER"]


class CoordinatorObserver(Protocol):
    """What the closure queue and the dispatchers report (called on their threads; quick)."""

    def closure_scheduled(self, closure: Closure) -> None:
        """``closure`` was queued by ``schedule``."""

    def closure_finished(self, closure: Closure) -> None:
        """``closure`` reached a final state (``closure.state``: SUCCEEDED, FAILED or CANCELLED)."""

    def closure_retried(self, closure: Closure, code: str) -> None:
        """A call running ``closure`` failed with gRPC status ``code``; it goes to another worker."""

    def worker_state(self, address: str, state: str | None) -> None:
        """The worker at ``address`` joined or changed state (a WORKER_STATES value), or left (None)."""

    def worker_device(self, address: str, device: str) -> None:
        """The worker at ``address`` computes on ``device`` (told when it first answers, and when it changes)."""

    def rows_read(self, pulled: int, cached: int, cached_by_age: Mapping[int, int]) -> None:
        """A closure's lookups pulled ``pulled`` distinct rows from the servers and took ``cached``
        from the worker's row cache (``cached_by_age``: by how many of its steps ago they were read)."""


class _NoObserver:
    def closure_scheduled(self, closure: Closure) -> None:
        pass

    def closure_finished(self, closure: Closure) -> None:
        pass

    def closure_retried(self, closure: Closure, code: str) -> None:
        pass

    def worker_state(self, address: str, state: str | None) -> None:
        pass

    def worker_device(self, address: str, device: str) -> None:
        pass

    def rows_read(self, pulled: int, cached: int, cached_by_age: Mapping[int, int]) -> None:
        pass


NO_OBSERVER: CoordinatorObserver = _NoObserver()
