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

Deferred pushes (a step that looked rows up, under ``overlap_pushes`` or ``max_row_staleness``
>= 1): a step's push is not sent when the step ends but
held (``defer``) until the next step's lookup, which takes it (``take_deferred``) and sends it
in the same round trip: each server applies the push, then reads the rows, so the rows include
it, and one exchange per server serves both steps. The dense values that exchange reads back
are installed at the next step boundary (``arrive``, ``install``: after the step's backward,
before the next forward), never in the middle of a step whose autograd graph may hold the old
ones; so a step's dense values miss at most its own previous push (one of its steps old). A
deferred push no lookup took is sent on its own by ``settle``, which also runs before any pull
and at the end of the batch: as with overlap, a closure's result is sent only once its pushes
are applied, and a push that fails is its owner's error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paramserve.psserver.protocol.types import PendingExchange, PullResult, PushSummary

__all__ = ["DeferredPush", "EarlierPushFailed", "PushPipeline"]


class EarlierPushFailed(Exception):
    """The push of an earlier closure of this batch failed: this closure stops before pushing
    (the worker reports the earlier closure's error, and this one as not run)."""


@dataclass
class DeferredPush:
    """A step's push held until the next lookup (module docstring)."""

    owner: object
    """The access of the closure that made it: its counts and failure are reported there."""
    client: object
    """The client it must travel on: a lookup on another one (another cluster) does not take it."""
    parts: list
    """(server, PushPart) pairs, checked and cut already (VariableClient.push_parts)."""
    read_back: list[str]
    """The dense variables to read back after it (the values the next steps use)."""
    key: str
    flush: Callable[[], None]
    """Sends it on its own (push and read back), recording its outcome on the owner."""
    received: Callable[[PushSummary, PullResult], None]
    """``received(summary, pulled)``: its outcome, when it travelled with a lookup."""


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
        self._deferred: DeferredPush | None = None
        self._arrived: list[Callable[[], None]] = []
        self.failure: tuple[object, BaseException] | None = None
        """(owner, error) of the first push that failed once settled."""

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None or self._deferred is not None

    def defer(self, push: DeferredPush) -> None:
        """Holds ``push`` for the next lookup (settle the previous one first)."""
        if self._in_flight is not None or self._deferred is not None:
            raise RuntimeError("a push is pending already: settle it first")
        self._deferred = push

    def take_deferred(self, client: object) -> DeferredPush | None:
        """The deferred push, for a lookup on ``client`` to send with its reads (it is then the
        lookup's to send, or to ``defer`` again untouched); None when there is none or it must
        travel on another client."""
        push = self._deferred
        if push is None or push.client is not client:
            return None
        self._deferred = None
        return push

    def failed(self, push: DeferredPush, error: BaseException) -> EarlierPushFailed:
        """A deferred push that travelled with a lookup failed: recorded for its owner; the
        lookup raises what this returns."""
        if self.failure is None:
            self.failure = (push.owner, error)
        return EarlierPushFailed(f"the push of an earlier step failed: {error}")

    def arrive(self, install: Callable[[], None]) -> None:
        """Values read back mid-step, to install at the next step boundary (``install``)."""
        self._arrived.append(install)

    def install(self) -> None:
        """Installs the values that arrived since the last step boundary (call only there)."""
        arrived, self._arrived = self._arrived, []
        for install in arrived:
            install()

    def hold(self, owner: object, exchange: PendingExchange, settled: Callable[[PendingExchange], None]) -> None:
        """Leaves ``exchange`` in flight; ``settled(exchange)`` runs when it is settled."""
        if self._in_flight is not None:
            raise RuntimeError("a push is in flight already: settle it first")
        self._in_flight = _InFlight(owner, exchange, settled)

    def settle(self) -> None:
        """Waits for the push in flight, if any. When it fails, records the failure for its
        owner and raises EarlierPushFailed (from it). A deferred push is sent on its own."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            try:
                deferred.flush()
            except Exception as exc:
                if self.failure is None:
                    self.failure = (deferred.owner, exc)
                raise EarlierPushFailed(f"the push of an earlier step failed: {exc}") from exc
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
        """``settle`` for the end of a batch, with what arrived installed: a failure is only
        recorded."""
        try:
            self.settle()
        except EarlierPushFailed:
            pass
        self.install()

    def abandon(self) -> None:
        """Drops the push in flight unread, and a deferred one unsent (the worker is closing, or
        the batch failed before its end)."""
        self._deferred = None
        self._arrived = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.exchange.abandon()
