"""The error boundary of every gRPC servicer: each core error becomes one status code.

A ``ParamServeError`` ends the RPC with its class's status code, the class named in the
``paramserve-error`` trailer and its variable in ``paramserve-error-variable`` (escaped to
printable ASCII), the message cut to what a client's metadata limit takes; a client-caused
``MemoryError`` or ``RecursionError`` becomes the typed error it stands for; anything else is
INTERNAL (never UNKNOWN), logged with its traceback. ``parse`` makes a malformed request
INVALID_ARGUMENT, and ``boundary_error`` is the same mapping for the data plane, which has no
gRPC context.

Apart from serving.py because the servicers (the parameter server's and the worker's) need only
this boundary, not the server, interceptors and options around them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from paramserve.psserver.protocol.errors import (
    ERROR_METADATA_KEY,
    ERROR_VARIABLE_METADATA_KEY,
    InternalError,
    InvalidRequestError,
    MessageTooLargeError,
    ParamServeError,
)
from paramserve.psserver.protocol.metadata import MAX_ERROR_METADATA_CHARS, metadata_value

__all__ = ["abort_with", "boundary_error", "bounded_details", "parse", "stream_boundary", "unary_boundary"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _encoded_chars(text: str) -> int:
    # gRPC percent-encodes an error's details: bytes outside printable ASCII, and '%', take 3.
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in text.encode("utf-8", "backslashreplace"))


def _prefix_within(text: str, budget: int) -> str:
    used = 0
    for index, char in enumerate(text):
        used += _encoded_chars(char)
        if used > budget:
            return text[:index]
    return text


def bounded_details(message: str, limit: int = MAX_ERROR_METADATA_CHARS) -> str:
    """``message`` with its middle cut out when gRPC's encoding of it would pass ``limit``
    characters (a longer status message makes a client fail the call with "Stream removed")."""
    if _encoded_chars(message) <= limit:
        return message
    half = (limit - 48) // 2
    head = _prefix_within(message, half)
    tail = _prefix_within(message[::-1], half)[::-1]
    return f"{head} [... {len(message) - len(head) - len(tail)} characters cut ...] {tail}"


def abort_with(context: grpc.ServicerContext, err: ParamServeError) -> NoReturn:
    """Ends the RPC with err's status code; the client re-raises the same class."""
    trailers = [(ERROR_METADATA_KEY, type(err).__name__)]
    if err.variable:
        trailers.append((ERROR_VARIABLE_METADATA_KEY, metadata_value(err.variable)))
    context.set_trailing_metadata(tuple(trailers))
    context.abort(getattr(grpc.StatusCode, err.code.value), bounded_details(err.message))
    raise AssertionError("unreachable: context.abort raises")


def _abort_internal(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    log.exception("internal error in %s", method)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "InternalError"),))
    context.abort(grpc.StatusCode.INTERNAL, bounded_details(f"internal error in {method}: {type(exc).__name__}: {exc}"))


def _as_paramserve_error(exc: Exception) -> ParamServeError | None:
    """The client-caused problems that reach the boundary as Python's own errors."""
    if isinstance(exc, MemoryError):
        return MessageTooLargeError(
            "the server ran out of memory for this request; send smaller requests, or give the server more memory"
        )
    if isinstance(exc, RecursionError):
        return InvalidRequestError("the request nests too deeply to be read; flatten it")
    return None


def boundary_error(method: str, exc: Exception) -> ParamServeError:
    """The typed error a surprise in ``method`` becomes at a boundary other than gRPC's (the data
    plane): a known client-caused problem, else InternalError (logged with its traceback)."""
    known = _as_paramserve_error(exc)
    if known is not None:
        return known
    log.error("internal error in %s", method, exc_info=exc)
    return InternalError(bounded_details(f"internal error in {method}: {type(exc).__name__}: {exc}"))


def unary_boundary(method: Callable[..., _T]) -> Callable[..., _T]:
    """Wraps a servicer method that returns one response."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> _T:
        try:
            return method(self, request, context)
        except ParamServeError as err:
            abort_with(context, err)
        except Exception as exc:
            if _is_abort(exc, context):
                raise
            known = _as_paramserve_error(exc)
            if known is not None:
                abort_with(context, known)
            _abort_internal(context, method.__name__, exc)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


def stream_boundary(method: Callable[..., Iterator[_T]]) -> Callable[..., Iterator[_T]]:
    """Wraps a servicer method that yields a response stream."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[_T]:
        try:
            yield from method(self, request, context)
        except ParamServeError as err:
            abort_with(context, err)
        except Exception as exc:
            if _is_abort(exc, context):
                raise
            known = _as_paramserve_error(exc)
            if known is not None:
                abort_with(context, known)
            _abort_internal(context, method.__name__, exc)

    return wrapper


def _is_abort(exc: Exception, context: grpc.ServicerContext) -> bool:
    # context.abort() raises a plain Exception after setting the code; let it through.
    return context.code() not in (None, grpc.StatusCode.OK)


def parse(message_cls: type[_T], raw: bytes) -> _T:
    """Parses a request message; garbage becomes INVALID_ARGUMENT, not INTERNAL."""
    try:
        return message_cls.FromString(raw)  # type: ignore[attr-defined]
    except Exception as err:
        raise InvalidRequestError(f"malformed {message_cls.__name__} message ({len(raw)} bytes): {err}") from None
