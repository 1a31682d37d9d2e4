"""Typed errors of the ClusterCoordinator.

A closure that fails surfaces as a ``ClosureError`` (or a subclass) at
``join()``, ``schedule()``, ``done()`` or ``fetch()``, so users catch one
thing. It names the remote exception type, its message and traceback, the
closure's function and id, and the worker it ran on; when the original
exception could be unpickled it is ``remote_exception`` and ``__cause__``.
Which subclass is raised is decided from structured fields of the worker's
reply (``coordinator.failures``), never from message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol, TypeVar

import cloudpickle

__all__ = [
    "ClosureCancelledError",
    "ClosureError",
    "CoordinatorClosedError",
    "CoordinatorError",
    "InvalidTransitionError",
    "OutOfRangeError",
    "ParameterServerUnavailableError",
    "WorkerRejectedError",
    "WorkerUnavailableError",
]

_S = TypeVar("_S", bound=enum.Enum)


class CoordinatorError(Exception):
    """Base of every error the coordinator raises itself."""


class InvalidTransitionError(RuntimeError):
    """A lifecycle (closure, remote value, worker) was asked for a transition its table forbids:
    a bug in the coordinator, never a user error."""

    @staticmethod
    def check(table: Mapping[_S, frozenset[_S]], current: _S, to: _S, subject: str) -> _S:
        """Returns ``to`` when ``current -> to`` is allowed; raises InvalidTransitionError otherwise."""
        if to not in table[current]:
            allowed = ", ".join(sorted(s.name for s in table[current])) or "nothing (terminal)"
            raise InvalidTransitionError(f"{subject} cannot go from {current.name} to {to.name} (allowed: {allowed})")
        return to


class RemoteErrorData(Protocol):
    """What a worker reports about a failed closure (worker.results.ClosureFailure fits)."""

    @property
    def type(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def traceback(self) -> str: ...

    @property
    def pickled(self) -> bytes: ...


class ClosureError(CoordinatorError):
    """A scheduled closure failed. Raised by ``join()``/``fetch()``/``schedule()``/``done()``.

    ``remote_type`` is the qualified class name of the exception on the worker,
    ``remote_traceback`` its formatted traceback, ``remote_exception`` the
    exception itself when it could be unpickled (also set as ``__cause__``).
    """

    def __init__(
        self,
        *,
        remote_type: str,
        message: str,
        remote_traceback: str = "",
        function_name: str = "",
        closure_id: str = "",
        worker: str = "",
        remote_exception: BaseException | None = None,
    ):
        super().__init__(message)
        self.remote_type = remote_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.function_name = function_name
        self.closure_id = closure_id
        self.worker = worker
        self.remote_exception = remote_exception
        if remote_exception is not None:
            self.__cause__ = remote_exception

    def __str__(self) -> str:
        text = (
            f"{self.remote_type}: {self.message}\n"
            f"  in {self.function_name or '<closure>'} (closure {self.closure_id or '?'}) "
            f"on worker {self.worker or '?'}"
        )
        if self.remote_traceback:
            text += "\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Keyword-only constructor: rebuild from a dict of fields.
        return (_rebuild, (type(self), self._fields()))

    def _fields(self) -> dict[str, object]:
        return {
            "remote_type": self.remote_type,
            "message": self.message,
            "remote_traceback": self.remote_traceback,
            "function_name": self.function_name,
            "closure_id": self.closure_id,
            "worker": self.worker,
        }


def _rebuild(cls: type[ClosureError], fields: dict[str, object]) -> ClosureError:
    return cls(**fields)  # type: ignore[arg-type]


class OutOfRangeError(ClosureError):
    """The step raised StopIteration on the worker: its per-worker dataset is exhausted
    (TF's ``tf.errors.OutOfRangeError``)."""


class ParameterServerUnavailableError(ClosureError):
    """A parameter server the closure used failed and was not recovered: it did not come back
    within the recovery policy's ``replacement_timeout``, it lost variables no checkpoint
    holds, recovery is off (``RecoveryPolicy(enabled=False)``: then the first failure raises,
    as in TF), or it kept failing (``FailurePolicy.max_server_waits``). ``server`` is its address."""

    def __init__(self, *, server: str = "", **fields: object):
        super().__init__(**fields)  # type: ignore[arg-type]
        self.server = server

    def __str__(self) -> str:
        return f"parameter server {self.server or '?'} is unavailable: " + super().__str__()

    def _fields(self) -> dict[str, object]:
        return {**super()._fields(), "server": self.server}


class WorkerUnavailableError(ClosureError):
    """The closure's RunClosure calls kept failing (worker unreachable, deadline
    exceeded...) until the failure policy's ``max_attempts`` was used up."""


class WorkerRejectedError(ClosureError):
    """A worker refused the RunClosure call for a reason retrying cannot fix
    (wrong token, malformed or too large request)."""


class ClosureCancelledError(CoordinatorError):
    """The closure never ran (or was abandoned): an earlier closure failed, or the
    coordinator shut down. ``__cause__`` is the reason. Schedule it again to run it."""

    def __init__(self, message: str, *, function_name: str = "", closure_id: str = ""):
        super().__init__(message)
        self.function_name = function_name
        self.closure_id = closure_id


class CoordinatorClosedError(CoordinatorError):
    """The coordinator was shut down; it accepts no more closures."""


def unpickle_remote_exception(data: RemoteErrorData) -> BaseException | None:
    """The worker's original exception, or None when it did not travel or does not unpickle here."""
    if not data.pickled:
        return None
    try:
        value = cloudpickle.loads(data.pickled)
    except Exception:
        return None
    return value if isinstance(value, BaseException) else None


def closure_error_from_remote(
    error_type: type[ClosureError],
    data: RemoteErrorData,
    *,
    function_name: str,
    closure_id: str,
    worker: str,
    server: str = "",
) -> ClosureError:
    """Builds the typed error a coordinator raises for a closure that failed on a worker."""
    extra: dict[str, object] = {"server": server} if issubclass(error_type, ParameterServerUnavailableError) else {}
    return error_type(
        **extra,
        remote_type=data.type,
        message=data.message,
        remote_traceback=data.traceback,
        function_name=function_name,
        closure_id=closure_id,
        worker=worker,
        remote_exception=unpickle_remote_exception(data),
    )
