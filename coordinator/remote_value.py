"""RemoteValue: the result of a scheduled closure, available once a worker ran it.

``ClusterCoordinator.schedule`` returns one at once; ``fetch()`` blocks until
the closure finished and returns its value or raises its error.
"""

from __future__ import annotations

import copy
import enum
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Generic, NoReturn, TypeVar

from paramserve.coordinator import nest
from paramserve.coordinator.errors import InvalidTransitionError
from paramserve.worker.resources import select_for_worker

__all__ = ["PerWorkerValues", "RemoteValue", "RemoteValueState", "fetch_structure"]

_T = TypeVar("_T")


class RemoteValueState(enum.Enum):
    NOT_READY = "not_ready"
    READY = "ready"
    ABORTED = "aborted"
    """The closure failed; fetch() raises its error."""
    CANCELLED = "cancelled"
    """The closure never ran or was stopped before it finished: an earlier closure failed (the
    closures in flight are stopped at their next push or step), or the coordinator shut down."""


TRANSITIONS: Mapping[RemoteValueState, frozenset[RemoteValueState]] = {
    RemoteValueState.NOT_READY: frozenset(
        {RemoteValueState.READY, RemoteValueState.ABORTED, RemoteValueState.CANCELLED}
    ),
    RemoteValueState.READY: frozenset(),
    RemoteValueState.ABORTED: frozenset(),
    RemoteValueState.CANCELLED: frozenset(),
}


class RemoteValue(Generic[_T]):
    """The future result of one scheduled closure (TF's ``RemoteValue``).

    Set once by the coordinator (``set_result``, ``set_error``, ``set_cancelled``);
    read by users with ``fetch``/``get``/``done``/``state``. Thread-safe.
    """

    def __init__(self, closure_id: str, function_name: str):
        self.closure_id = closure_id
        self.function_name = function_name
        self._cond = threading.Condition()
        self._state = RemoteValueState.NOT_READY
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def state(self) -> RemoteValueState:
        with self._cond:
            return self._state

    def done(self) -> bool:
        """True once the closure succeeded, failed or was cancelled."""
        return self.state is not RemoteValueState.NOT_READY

    def fetch(self, timeout: float | None = None) -> _T:
        """Blocks until the closure finished; returns its value.

        Raises the closure's ClosureError (ABORTED), ClosureCancelledError
        (CANCELLED), or TimeoutError naming the closure after ``timeout`` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._state is not RemoteValueState.NOT_READY, timeout):
                raise TimeoutError(
                    f"{self.function_name} (closure {self.closure_id}) is not ready after {timeout:g}s; "
                    "it is still queued or running (ClusterCoordinator.join() waits for every closure)"
                )
            if self._state is RemoteValueState.READY:
                return self._value
            self._raise_error()

    get = fetch

    def set_result(self, value: Any) -> None:
        """Coordinator only: the closure succeeded."""
        self._finish(RemoteValueState.READY, value=value)

    def set_error(self, error: BaseException) -> None:
        """Coordinator only: the closure failed with ``error``."""
        self._finish(RemoteValueState.ABORTED, error=error)

    def set_cancelled(self, error: BaseException) -> None:
        """Coordinator only: the closure will not run; fetch() raises ``error``."""
        self._finish(RemoteValueState.CANCELLED, error=error)

    def _finish(self, to: RemoteValueState, *, value: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            self._state = InvalidTransitionError.check(TRANSITIONS, self._state, to, f"remote value of {self._name()}")
            self._value, self._error = value, error
            self._cond.notify_all()

    def _raise_error(self) -> NoReturn:
        assert self._error is not None
        raise self._error

    def _name(self) -> str:
        return f"{self.function_name} (closure {self.closure_id})"

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"the RemoteValue of {self._name()} cannot be sent to a worker: pass its value "
            "(remote_value.fetch()) instead"
        )

    def __repr__(self) -> str:
        return f"<RemoteValue {self._name()} {self.state.name}>"


class PerWorkerValues:
    """One value per worker, by worker index (TF's ``PerWorkerValues``).

    Passed to ``ClusterCoordinator.schedule`` (as an argument, or inside one), each worker's
    function gets that worker's value (``worker.resources.select_for_worker``: IndexError when
    there are fewer values than workers); ``fetch_structure`` turns it into a tuple.
    """

    def __init__(self, values: Sequence[Any]):
        self.values = tuple(values)

    def __len__(self) -> int:
        return len(self.values)

    def __reduce__(self) -> tuple[Any, tuple[tuple[Any, ...]]]:
        # Unpickled on a worker, it becomes that worker's value.
        return select_for_worker, (self.values,)

    def __copy__(self) -> PerWorkerValues:
        return PerWorkerValues(self.values)

    def __deepcopy__(self, memo: dict[int, Any]) -> PerWorkerValues:
        return PerWorkerValues(copy.deepcopy(self.values, memo))

    def __repr__(self) -> str:
        return f"PerWorkerValues({self.values!r})"


def fetch_structure(structure: Any, timeout: float | None = None) -> Any:
    """``structure`` with every RemoteValue replaced by its fetched value.

    Walks lists, tuples (named too), dicts and PerWorkerValues (which become
    tuples); other objects are returned as they are. ``timeout`` bounds the
    whole call; raises like ``RemoteValue.fetch``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout

    def fetch(leaf: Any) -> Any:
        if isinstance(leaf, RemoteValue):
            return leaf.fetch(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if isinstance(leaf, PerWorkerValues):
            return tuple(nest.map_structure(fetch, value) for value in leaf.values)
        return leaf

    return nest.map_structure(fetch, structure)
