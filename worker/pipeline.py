"""Overlapped pushes: a worker's next step computes while its last push is on its way.

Without overlap a step ends with a round trip: the gradients go to the servers, which
apply them and send the updated values back, and the worker idles meanwhile. With
``overlap_pushes`` a step's push is sent and left in flight (``PushPipeline.hold``); the
next step runs its forward and backward on the values the worker holds, which miss its own
push in flight (its gradients are one step staler, as in any asynchronous training, and
the servers' staleness bound counts that), and reads the reply (``settle``) just before it
pushes. At most one push is in flight, and never across RunClosures calls: a batch of
closures settles its last push before the worker answers, so each closure's result is
sent only once its pushes are applied, and a push that fails is that closure's error.

A closure whose predecessor's push failed is stopped at its own push (``EarlierPushFailed``)
and reported as not run: the coordinator retries both, with their ids, so the servers'
idempotency keys keep every push applied once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paramserve.psserver.protocol.types import PendingExchange

__all__ = ["EarlierPushFailed", "PushPipeline"]


class EarlierPushFailed(Exception):
    """The push of an earlier closure of this batch failed: this closure stops before pushing
    (the worker reports the earlier closure's error, and this one as not run)."""


@dataclass
class _InFlight:
    owner: object
    """What the push belongs to (the closure's access): its failure is reported there."""
    exchange: PendingExchange
    settled: Callable[[PendingExchange], None]
    """Reads the replies (``exchange.result()``) and applies them to the worker's variables."""


class PushPipeline:
    """The push in flight of one batch of closures, and the first failure of one."""

    def __init__(self) -> None:
        self._in_flight: _InFlight | None = None
        self.failure: tuple[object, BaseException] | None = None
        """(owner, error) of the first push that failed once settled."""

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def hold(self, owner: object, exchange: PendingExchange, settled: Callable[[PendingExchange], None]) -> None:
        """Leaves ``exchange`` in flight; ``settled(exchange)`` runs when it is settled."""
        if self._in_flight is not None:
            raise RuntimeError("a push is in flight already: settle it first")
        self._in_flight = _InFlight(owner, exchange, settled)

    def settle(self) -> None:
        """Waits for the push in flight, if any. When it fails, records the failure for its
        owner and raises EarlierPushFailed (from it)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.settled(in_flight.exchange)
        except Exception as exc:
            if self.failure is None:
                self.failure = (in_flight.owner, exc)
            raise EarlierPushFailed(f"the push of an earlier closure failed: {exc}") from exc

    def settle_quietly(self) -> None:
        """``settle`` for the end of a batch: a failure is only recorded."""
        try:
            self.settle()
        except EarlierPushFailed:
            pass

    def abandon(self) -> None:
        """Drops the push in flight unread (the worker is closing)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.exchange.abandon()
