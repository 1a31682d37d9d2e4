"""Closures and the queue the dispatchers take them from.

A ``Closure`` is one scheduled call: its payload is pickled once, at schedule
time, and its id stays the same across retries (the parameter servers key
pushes by it, so a retried closure never applies its gradients twice).

``ClosureQueue`` is the only shared state between the user's thread and the
dispatcher threads; everything in it is guarded by one Condition, including
the RemoteValue updates, so "idle" is never observed before a value is set.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paramserve.coordinator import nest
from paramserve.coordinator.dispatch.observer import NO_OBSERVER, CoordinatorObserver
from paramserve.coordinator.errors import (
    ClosureCancelledError,
    ClosureError,
    CoordinatorClosedError,
    InvalidTransitionError,
)
from paramserve.coordinator.remote_value import RemoteValue
from paramserve.worker.resources import PerWorkerResource

__all__ = ["Closure", "ClosureQueue", "ClosureState", "InFlight", "find_resource_ids"]

log = logging.getLogger(__name__)


class ClosureState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRANSITIONS: Mapping[ClosureState, frozenset[ClosureState]] = {
    ClosureState.QUEUED: frozenset({ClosureState.RUNNING, ClosureState.CANCELLED}),
    # RUNNING -> QUEUED: a retry (put back at the front); -> CANCELLED: shutdown mid-call.
    ClosureState.RUNNING: frozenset(
        {ClosureState.SUCCEEDED, ClosureState.FAILED, ClosureState.QUEUED, ClosureState.CANCELLED}
    ),
    ClosureState.SUCCEEDED: frozenset(),
    ClosureState.FAILED: frozenset(),
    ClosureState.CANCELLED: frozenset(),
}


@dataclass(eq=False)  # an entity: two closures are never "equal"
class Closure:
    """One scheduled call of a function on some worker.

    ``attempt`` counts RunClosure calls that failed at the RPC level (it is
    sent to the worker); ``resends`` counts replies that asked for resources;
    ``server_waits`` counts failures of a parameter server it waited out.
    Only the dispatcher running a closure changes them.
    """

    function_name: str
    payload: bytes
    resource_ids: frozenset[str] = frozenset()
    steps: int = 1
    closure_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    attempt: int = 0
    resends: int = 0
    server_waits: int = 0
    read_generation: int = 0
    """The queue's read generation when it was queued (see ClosureQueue.read_barrier)."""
    worker: str | None = None
    """The worker it was last given to (None before): telemetry counts its outcome there."""
    state: ClosureState = ClosureState.QUEUED
    remote_value: RemoteValue[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.remote_value = RemoteValue(self.closure_id, self.function_name)

    @property
    def name(self) -> str:
        return f"{self.function_name} (closure {self.closure_id})"

    def transition(self, to: ClosureState) -> None:
        self.state = InvalidTransitionError.check(TRANSITIONS, self.state, to, self.name)

    def cancel(self, reason: BaseException) -> None:
        """Cancels the closure and its RemoteValue; ``reason`` becomes the error's cause."""
        self.transition(ClosureState.CANCELLED)
        error = ClosureCancelledError(
            f"{self.name} was cancelled: {_first_line(reason)}. Schedule it again to run it.",
            function_name=self.function_name,
            closure_id=self.closure_id,
        )
        error.__cause__ = reason
        self.remote_value.set_cancelled(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


@dataclass(frozen=True)
class InFlight:
    """A closure being run, for progress logs."""

    closure_id: str
    function_name: str
    worker: str
    attempt: int


class ClosureQueue:
    """A bounded FIFO of closures plus the accounting of those in flight.

    Also holds the first error of a failed closure until the coordinator
    raises it (``take_error``); when that error is recorded, every queued
    closure is cancelled at once (TF cancels them when the error is raised).
    ``observer`` hears of each closure queued and each that reached a final state.
    """

    def __init__(self, max_queued: int, observer: CoordinatorObserver = NO_OBSERVER):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._max = max_queued
        self._observer = observer
        self._cond = threading.Condition()
        self._queued: collections.deque[Closure] = collections.deque()
        self._in_flight: dict[str, tuple[Closure, str]] = {}
        self._error: ClosureError | None = None
        self._closed: CoordinatorClosedError | None = None
        self._waker: Callable[[], None] = lambda: None
        self._read_generation = 0

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called, outside the lock, whenever closures may be taken: after a put,
        a put-back or close (the dispatch loop hands them to free workers)."""
        self._waker = wake

    # ---------------------------------------------------------------- producers

    def put(self, closure: Closure, timeout: float | None) -> bool:
        """Appends ``closure``, waiting up to ``timeout`` seconds while the queue is full;
        returns True once it is queued.

        If a closure's error is pending, ``closure`` is cancelled instead and this returns
        False (the caller raises that error). Raises TimeoutError when still full at the
        deadline, CoordinatorClosedError after ``close()``.
        """
        with self._cond:
            ready = self._cond.wait_for(lambda: self._closed or self._error or len(self._queued) < self._max, timeout)
            if self._closed is not None:
                raise self._closed
            if self._error is not None:
                closure.cancel(self._error)  # never queued (schedule raises the error): not counted
                return False
            if not ready:
                raise TimeoutError(
                    f"could not schedule {closure.name}: {len(self._queued)} closures are already queued "
                    f"(the limit) and none finished within {timeout:g}s; are the workers alive?"
                )
            closure.read_generation = self._read_generation
            self._queued.append(closure)
            self._observer.closure_scheduled(closure)
            self._cond.notify_all()
        self._waker()
        return True

    def put_back(self, closures: Sequence[Closure]) -> None:
        """Returns running closures to the FRONT of the queue, in order (a retry, or closures a
        worker did not get to); never blocks. After ``close()``, or while a closure's error
        is pending (TF cancels what is queued at the first error), they are cancelled instead.
        """
        with self._cond:
            for closure in closures:
                self._leave_flight(closure)
                closure.transition(ClosureState.QUEUED)
            reason = self._closed or self._error
            for closure in reversed(closures):
                if reason is not None:
                    self._cancel(closure, reason)
                else:
                    self._queued.appendleft(closure)
            self._cond.notify_all()
        self._waker()

    # ---------------------------------------------------------------- dispatchers

    def take(self, worker: str, limit: int) -> list[Closure]:
        """Up to ``limit`` closures from the front of the queue for ``worker`` (now RUNNING);
        none once closed. Never blocks."""
        with self._cond:
            taken: list[Closure] = []
            while self._queued and self._closed is None and len(taken) < limit:
                closure = self._queued.popleft()
                closure.transition(ClosureState.RUNNING)
                closure.worker = worker
                self._in_flight[closure.closure_id] = (closure, worker)
                taken.append(closure)
            if taken:
                self._cond.notify_all()  # room for put()
            return taken

    def succeed(self, closure: Closure, value: Any) -> None:
        with self._cond:
            self._leave_flight(closure)
            closure.transition(ClosureState.SUCCEEDED)
            closure.remote_value.set_result(value)
            self._observer.closure_finished(closure)
            self._cond.notify_all()

    def fail(self, closure: Closure, error: ClosureError, not_run: Sequence[Closure] = ()) -> bool:
        """Marks ``closure`` FAILED and cancels ``not_run`` (running closures of its batch that
        never started), in one step. The first error is kept for the coordinator to raise and
        cancels every queued closure; returns whether ``error`` was that first one."""
        with self._cond:
            self._leave_flight(closure)
            for sibling in not_run:
                self._leave_flight(sibling)
                sibling.transition(ClosureState.QUEUED)
                self._cancel(sibling, error)
            closure.transition(ClosureState.FAILED)
            closure.remote_value.set_error(error)
            self._observer.closure_finished(closure)
            first = self._error is None
            if first:
                self._error = error
                cancelled = self._cancel_queued(error)
                log.error("%s failed; cancelled %d queued closures: %s", closure.name, cancelled, _first_line(error))
            else:
                log.error("%s failed too (an earlier error is pending): %s", closure.name, _first_line(error))
            self._cond.notify_all()
            return first

    # ---------------------------------------------------------------- the coordinator

    def cancel_all(self, reason: BaseException) -> int:
        """Cancels every queued closure (RemoteValues CANCELLED); returns how many."""
        with self._cond:
            count = self._cancel_queued(reason)
            self._cond.notify_all()
            return count

    def abort(self, error: ClosureError) -> int:
        """Makes ``error`` pending (unless one is) and cancels every queued closure with it: a
        failure of no one closure (a parameter server that never came back). Returns how many
        were cancelled."""
        with self._cond:
            if self._error is None:
                self._error = error
            count = self._cancel_queued(error)
            log.error("cancelled %d queued closures: %s", count, _first_line(error))
            self._cond.notify_all()
            return count

    def close(self, reason: CoordinatorClosedError) -> int:
        """Accepts nothing more, cancels the queued closures and wakes every waiter."""
        with self._cond:
            self._closed = reason
            count = self._cancel_queued(reason)
            self._cond.notify_all()
        self._waker()
        return count

    def read_barrier(self) -> None:
        """Closures queued from now on read the variables afresh on their worker (no values an
        earlier closure read back): called when join() or fetch() returns, so a closure
        scheduled after them sees every update that finished before them, as in TensorFlow."""
        with self._cond:
            self._read_generation += 1

    def pending_error(self) -> ClosureError | None:
        """The error a failed closure left for the coordinator to raise (None: none), kept."""
        with self._cond:
            return self._error

    def take_error(self) -> ClosureError | None:
        """The pending error of a failed closure, which is then forgotten (TF raises it once).
        Call it once nothing is in flight (``wait_settled``): a closure put back while the
        error is pending is cancelled, one put back after it would run again."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def wait_settled(self, timeout: float | None) -> bool:
        """True once no closure is in flight (each one succeeded, failed, or was put back and
        so cancelled while an error is pending); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout)

    def wait_idle(self, timeout: float | None) -> bool:
        """True once nothing is queued or in flight, or a closure's error is pending (TF raises
        it at once, without waiting for the closures still running); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._idle() or self._error is not None, timeout)

    def idle(self) -> bool:
        with self._cond:
            return self._idle()

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def in_flight(self) -> list[InFlight]:
        with self._cond:
            return [InFlight(c.closure_id, c.function_name, w, c.attempt) for c, w in self._in_flight.values()]

    def in_flight_by_worker(self) -> dict[str, int]:
        """How many closures each worker is running (the status page reads it every second)."""
        with self._cond:
            return dict(collections.Counter(worker for _, worker in self._in_flight.values()))

    # ---------------------------------------------------------------- internals (lock held)

    def _idle(self) -> bool:
        return not self._queued and not self._in_flight

    def _leave_flight(self, closure: Closure) -> None:
        if self._in_flight.pop(closure.closure_id, None) is None:
            raise InvalidTransitionError(f"{closure.name} is not in flight")

    def _cancel_queued(self, reason: BaseException) -> int:
        count = len(self._queued)
        while self._queued:
            self._cancel(self._queued.popleft(), reason)
        return count

    def _cancel(self, closure: Closure, reason: BaseException) -> None:
        closure.cancel(reason)
        self._observer.closure_finished(closure)


# -------------------------------------------------------------------- resource references


def find_resource_ids(fn: Callable[..., Any], args: Iterable[Any], kwargs: Mapping[str, Any]) -> frozenset[str]:
    """Ids of the per-worker resources a closure refers to.

    Looks through ``args`` and ``kwargs`` (nested lists, tuples, sets and dicts)
    and at the values ``fn`` captures (closure cells, globals it names) without
    walking into them. Anything missed is caught by the worker, which reports
    the resources it lacks.
    """
    candidates = [*nest.flatten([list(args), dict(kwargs)]), *_captured(fn)]
    return frozenset(value.resource_id for value in candidates if isinstance(value, PerWorkerResource))


def _captured(fn: Callable[..., Any]) -> list[Any]:
    target = getattr(fn, "func", fn)  # functools.partial
    values: list[Any] = [*getattr(fn, "args", ()), *getattr(fn, "keywords", {}).values()] if target is not fn else []
    for cell in getattr(target, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code, namespace = getattr(target, "__code__", None), getattr(target, "__globals__", {})
    if code is not None:
        values.extend(namespace[n] for n in code.co_names if n in namespace)
    return values
