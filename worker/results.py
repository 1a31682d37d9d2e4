"""How a closure's outcome travels back to the coordinator: its value, or its error classified.

Results are pickled as values (tensors as raw bytes on the host, without autograd history);
an exception becomes a ``ClosureFailure`` whose structured fields (missing resources, a failed
parameter server) the coordinator's failure policy reads. Apart from worker.core because it is
the contract of what the coordinator unpickles and decides on, not of how closures run.
``_result_tensor`` is pickled by reference (it rebuilds result tensors on the coordinator).
"""

from __future__ import annotations

import io
import pickle
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from torch import nn

from paramserve.psserver.protocol.errors import DeadlineExceededError, ServerUnavailableError, VariableNotFoundError
from paramserve.psserver.protocol.tensors import DTYPE_NAMES, as_byte_view, dtype_from_name, tensor_from_buffer
from paramserve.worker.resources import ResourceMissingError


@dataclass(frozen=True)
class ClosureFailure:
    type: str = ""
    message: str = ""
    traceback: str = ""
    pickled: bytes = b""
    missing_resources: tuple[str, ...] = ()
    """Not a failure of the closure: resend these resources and retry."""
    parameter_server: str = ""
    """Set when a parameter server, not the user's code, failed: it is unreachable, or it lacks a
    variable the cluster context places on it (it restarted and lost its state)."""
    needs_cluster: bool = False
    """Not a failure of the closure: the worker does not hold the cluster context the request
    names (it restarted); resend the request with it."""
    cancelled: bool = False
    """The coordinator cancelled the closure (CancelClosures) before it finished: it stopped
    before its next push or step and pushes no more."""
    group_failed: bool = False
    """Not a failure of the closure: hybrid training's dense group broke under it (GroupFailed);
    it runs again once the coordinator has formed the group anew."""


class GroupFailed(RuntimeError):
    """Hybrid training's dense all-reduce group broke (a member died or did not answer in time):
    not the closure's fault; it runs again once the coordinator has formed the group anew."""


class ClosureCancelled(Exception):
    """Raised inside a running closure at its next push or step once the coordinator cancelled
    it: the closure stops there, so nothing it computes afterwards reaches the servers."""


# ---------------------------------------------------------------- results and errors


def _tensor_as_value(obj: Any) -> Any:
    """How a result tensor travels, or NotImplemented for anything else: tensors lose their
    autograd history (a loss has a grad_fn), and a GPU worker's tensors travel as host tensors
    (the coordinator may have no GPU). A dense tensor of a wire dtype travels as its raw bytes,
    dtype and shape (torch's own pickling writes a small archive per tensor, several times
    slower for a loss)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.layout == torch.strided and obj.dtype in DTYPE_NAMES:
            return _result_tensor, (bytes(as_byte_view(obj)), DTYPE_NAMES[obj.dtype], tuple(obj.shape))
        if obj.device.type != "cpu":
            return obj.detach().to("cpu").__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if obj.requires_grad or isinstance(obj, nn.Parameter):
            return obj.detach().clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return NotImplemented


class _ValuePickler(cloudpickle.Pickler):
    """Results as values (``_tensor_as_value``), anything cloudpickle can send."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = _tensor_as_value(obj)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


class _PlainValuePickler(pickle.Pickler):
    """Results as values with the standard library's C pickler: several times cheaper than
    cloudpickle for the common result (a loss, a dict of metrics). It refuses what must travel
    by value (functions and classes it cannot find by name), and then cloudpickle sends it."""

    def reducer_override(self, obj: Any) -> Any:
        return _tensor_as_value(obj)


def _result_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuilds a result tensor sent by _ValuePickler (runs on the coordinator)."""
    return tensor_from_buffer(bytearray(data), dtype_from_name(dtype), shape)


def dumps_value(value: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _PlainValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()
    except Exception:
        buffer = io.BytesIO()
    _ValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def closure_failure(exc: BaseException) -> ClosureFailure:
    """What the coordinator learns about an exception raised while running a closure."""
    cancelled = _in_chain(exc, ClosureCancelled)
    if cancelled is not None:
        return ClosureFailure(type=_qualified_name(cancelled), message=str(cancelled), cancelled=True)
    broken = _in_chain(exc, GroupFailed)
    if broken is not None:
        return ClosureFailure(type=_qualified_name(broken), message=str(broken), group_failed=True)
    missing = _in_chain(exc, ResourceMissingError)
    if missing is not None:
        return ClosureFailure(
            type=_qualified_name(missing), message=str(missing), missing_resources=missing.resource_ids
        )
    server_error = _in_chain(exc, (ServerUnavailableError, DeadlineExceededError))
    if server_error is None:
        lost = _in_chain(exc, VariableNotFoundError)  # every variable asked for is in the cluster context
        server_error = lost if lost is not None and lost.server else None
    return ClosureFailure(
        type=_qualified_name(exc),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        pickled=_pickled_exception(exc),
        parameter_server=(server_error.server or "unknown") if server_error is not None else "",
    )


def _in_chain(exc: BaseException, types: type | tuple[type, ...]) -> Any:
    """``exc`` or the first exception it was raised from / during that is one of ``types``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _pickled_exception(exc: BaseException) -> bytes:
    """The exception when it survives a round trip (many custom exceptions do not), else b""."""
    try:
        payload = dumps_value(exc)
        cloudpickle.loads(payload)
        return payload
    except Exception:
        return b""


def _qualified_name(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"
