"""Typed errors of the parameter server, shared by its core, servicer and client.

The core raises these; the servicer maps each to one gRPC status code at a
single boundary and names the class in the ``paramserve-error`` trailing
metadata; the client raises the same class again. No code anywhere classifies
a failure by its message text.

``ConfigurationError`` is the one error here that never crosses the wire: a
setting a process cannot start with (the ``paramserve`` command prints its
message as one line and exits with status 2).
"""

from __future__ import annotations

import enum


class StatusCode(enum.Enum):
    """The gRPC status a core error maps to (mirrors grpc.StatusCode names; the
    core does not import grpc)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"


class ParamServeError(Exception):
    """Base of every paramserve error.

    ``variable`` and ``server`` name where it happened when known; the client
    fills ``server`` with the address it called.
    """

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str, *, variable: str | None = None, server: str | None = None):
        super().__init__(message)
        self.message = message
        self.variable = variable
        self.server = server

    def __str__(self) -> str:
        where = []
        if self.variable:
            where.append(f"variable {self.variable!r}")
        if self.server:
            where.append(f"server {self.server}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class InvalidRequestError(ParamServeError):
    """A request that is malformed: bad header, payload size, unknown optimizer, garbage bytes."""

    code = StatusCode.INVALID_ARGUMENT


class VariableNotFoundError(ParamServeError):
    code = StatusCode.NOT_FOUND


class VariableExistsError(ParamServeError):
    code = StatusCode.ALREADY_EXISTS


class ShapeMismatchError(ParamServeError):
    code = StatusCode.INVALID_ARGUMENT


class DtypeMismatchError(ParamServeError):
    code = StatusCode.INVALID_ARGUMENT


class IndexOutOfRangeError(ParamServeError):
    code = StatusCode.OUT_OF_RANGE


class NonFiniteGradientError(ParamServeError):
    """A gradient holds NaN or Inf; rejected unless the server allows them."""

    code = StatusCode.INVALID_ARGUMENT


class StalePushError(ParamServeError):
    """A push computed from a version older than the server's staleness bound."""

    code = StatusCode.FAILED_PRECONDITION


class CheckpointError(ParamServeError):
    """A checkpoint that is missing, incomplete, or does not match the request."""

    code = StatusCode.FAILED_PRECONDITION


class CheckpointBaseMissingError(CheckpointError):
    """An incremental checkpoint whose base (an older checkpoint it holds only the changes
    since) is gone or not whole: it cannot be restored."""


class MessageTooLargeError(ParamServeError):
    code = StatusCode.RESOURCE_EXHAUSTED


class AuthenticationError(ParamServeError):
    code = StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ParamServeError):
    """An authenticated request for something this server does not allow, e.g. a checkpoint
    path outside its ``--checkpoint-root``."""

    code = StatusCode.PERMISSION_DENIED


class ServerUnavailableError(ParamServeError):
    """A parameter server could not be reached within the call's deadline and retries."""

    code = StatusCode.UNAVAILABLE


class NotPrimaryError(ServerUnavailableError):
    """A replicated server that serves no client now: a backup, a primary that was replaced, or
    a primary whose forward to a backup failed and that waits for the coordinator's decision.
    UNAVAILABLE, as a server going away: the client's closure is re-routed by the coordinator."""


class ReplicaEpochError(ParamServeError):
    """A replication decision or forwarded write of the wrong epoch: refused, nothing changed."""

    code = StatusCode.FAILED_PRECONDITION


class DeadlineExceededError(ParamServeError):
    code = StatusCode.DEADLINE_EXCEEDED


class InternalError(ParamServeError):
    code = StatusCode.INTERNAL


ERROR_TYPES: dict[str, type[ParamServeError]] = {
    cls.__name__: cls
    for cls in (
        ParamServeError,
        InvalidRequestError,
        VariableNotFoundError,
        VariableExistsError,
        ShapeMismatchError,
        DtypeMismatchError,
        IndexOutOfRangeError,
        NonFiniteGradientError,
        StalePushError,
        CheckpointError,
        CheckpointBaseMissingError,
        MessageTooLargeError,
        AuthenticationError,
        PermissionDeniedError,
        ServerUnavailableError,
        NotPrimaryError,
        ReplicaEpochError,
        DeadlineExceededError,
        InternalError,
    )
}
"""Error classes by name, as sent in the ``paramserve-error`` trailing metadata."""

ERROR_METADATA_KEY = "paramserve-error"
ERROR_VARIABLE_METADATA_KEY = "paramserve-error-variable"


class ConfigurationError(ValueError):
    """A flag, file or environment variable a process cannot start with; the message names
    the setting and the fix. Raised before anything starts (never sent over the wire)."""
