"""One shard as the store holds it, and the checks that requests against shards pass.

``Shard`` is one shard's live state (its value, optimizer, version and idempotency window)
under a lock of its own; ``build_shard`` makes one from a ``ShardState``, checked by
``check_state``, as a private copy. Every check here is pure: it reads a ``ShardState``, a
``Shard`` or a request's rows and values and raises the typed error, changing nothing, so that
the store can validate a whole request before it changes anything.

Apart from store.py, which keeps the catalog of shards, the order their locks are taken in and
the push and read protocols; a checkpoint checks the states it restores (``check_state``)
without the store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    NonFiniteGradientError,
    ParamServeError,
    ShapeMismatchError,
)
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.tensors import DTYPE_NAMES, check_shape, dtype_name
from paramserve.psserver.protocol.types import ShardInfo, ShardRef, ShardState
from paramserve.psserver.store.idempotency import IdempotencyWindow
from paramserve.psserver.store.optimizer import ShardOptimizer, check_optimizer

__all__ = [
    "Shard",
    "about",
    "all_finite",
    "all_locked",
    "build_shard",
    "check_finite",
    "check_replaceable",
    "check_restorable",
    "check_rows",
    "check_state",
    "check_variables_agree",
    "is_int",
]


def is_int(value: Any) -> bool:
    """An int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


@contextlib.contextmanager
def about(variable: str) -> Iterator[None]:
    """Names ``variable`` in errors raised by code that does not know it."""
    try:
        yield
    except ParamServeError as error:
        if error.variable is None:
            error.variable = variable
        raise


# ---------------------------------------------------------------------------
# Validation of created shards (pure: reads a ShardState, changes nothing)


def _check_ref(ref: Any) -> None:
    if not isinstance(ref, ShardRef):
        raise InvalidRequestError(f"expected a ShardRef, got {type(ref).__name__}")
    if not isinstance(ref.variable, str) or not ref.variable:
        raise InvalidRequestError("a variable needs a non-empty name")
    if not is_int(ref.shard) or ref.shard < 0:
        raise InvalidRequestError(f"shard index must be an int >= 0, got {ref.shard!r}")


def _check_value(value: Any) -> None:
    if not isinstance(value, Tensor):
        raise InvalidRequestError(f"a shard's value must be a tensor, got {type(value).__name__}")
    if value.dtype not in DTYPE_NAMES:
        dtype_name(value.dtype)  # raises DtypeMismatchError naming the supported dtypes
    if value.device.type != "cpu" or value.is_sparse:
        raise InvalidRequestError(f"a shard's value must be a dense CPU tensor, got {value.layout} on {value.device}")


def _check_placement(state: ShardState) -> None:
    """The shard's rows must lie inside the variable and its row shape match."""
    variable_shape, shape = tuple(state.variable_shape), tuple(state.value.shape)
    check_shape(variable_shape, "variable_shape")
    if not is_int(state.row_start) or state.row_start < 0:
        raise InvalidRequestError(f"row_start must be an int >= 0, got {state.row_start!r}")
    if not variable_shape:
        if shape or state.row_start:
            raise ShapeMismatchError(
                f"a 0-d variable is one 0-d shard at row 0; got shape {shape} at row {state.row_start}"
            )
        return
    if len(shape) != len(variable_shape) or shape[1:] != variable_shape[1:]:
        raise ShapeMismatchError(
            f"shard shape {shape} does not fit variable shape {variable_shape}: all but the first dimension must match"
        )
    if state.row_start + shape[0] > variable_shape[0]:
        raise InvalidRequestError(
            f"shard rows [{state.row_start}, {state.row_start + shape[0]}) exceed "
            f"the variable's {variable_shape[0]} rows"
        )


def _check_history(state: ShardState) -> None:
    if not is_int(state.version) or state.version < 0:
        raise InvalidRequestError(f"version must be an int >= 0, got {state.version!r}")
    if not all(isinstance(key, str) for key in state.applied_keys):
        raise InvalidRequestError("applied_keys must be strings")


class Shard:
    """One shard's live state. ``version``, ``window`` and the tensors change only under ``lock``."""

    def __init__(self, state: ShardState, value: Tensor, optimizer: ShardOptimizer | None, capacity: int):
        self.lock = threading.Lock()
        self.ref = state.ref
        self.variable_shape = tuple(int(dim) for dim in state.variable_shape)
        self.row_start = int(state.row_start)
        self.value = value
        self.optimizer = optimizer
        self.version = int(state.version)
        self.window = IdempotencyWindow.from_keys(state.applied_keys, capacity)

    @property
    def spec(self) -> OptimizerSpec | None:
        return self.optimizer.spec if self.optimizer else None

    def info(self) -> ShardInfo:
        with self.lock:
            return ShardInfo(
                self.ref,
                self.variable_shape,
                self.row_start,
                tuple(self.value.shape),
                self.value.dtype,
                self.spec,
                self.version,
            )

    def same_layout(self, other: Shard) -> bool:
        """Whether ``other`` describes this shard (so creating it again is a no-op)."""
        return (
            self.variable_shape == other.variable_shape
            and self.row_start == other.row_start
            and self.value.shape == other.value.shape
            and self.value.dtype == other.value.dtype
            and self.spec == other.spec
        )

    def export(self) -> ShardState:
        with self.lock:
            return self.state()

    def state(self) -> ShardState:
        """``export`` for a caller that holds the lock already."""
        return ShardState(
            self.ref,
            self.variable_shape,
            self.row_start,
            self.value.clone(),
            self.spec,
            self.optimizer.slots() if self.optimizer else {},
            self.version,
            self.window.keys(),
        )


def check_state(state: ShardState) -> None:
    """Raises unless ``state`` is a well-formed shard: its ref, value, rows inside
    the variable, version and keys (the optimizer and slots are checked by
    :class:`ShardOptimizer`)."""
    if not isinstance(state, ShardState):
        raise InvalidRequestError(f"expected a ShardState, got {type(state).__name__}")
    _check_ref(state.ref)
    with about(state.ref.variable):
        _check_value(state.value)
        _check_placement(state)
        _check_history(state)


def check_restorable(state: ShardState) -> None:
    """Raises as ``build_shard`` would for ``state``, copying and building nothing: a restore
    checks every shard this way before any server takes one."""
    check_state(state)
    with about(state.ref.variable):
        if state.optimizer is None:
            if state.slots:
                raise InvalidRequestError("optimizer slots were given for a variable without an optimizer")
            return
        if not isinstance(state.optimizer, OptimizerSpec):
            raise InvalidRequestError(f"optimizer must be an OptimizerSpec, got {type(state.optimizer).__name__}")
        check_optimizer(state.optimizer, state.value, state.slots)


def build_shard(state: ShardState, capacity: int, *, owned: bool = False) -> Shard:
    """A validated shard of ``state``; raises without side effects. The store owns its tensors:
    a caller's buffer may be read-only or reused, so it is copied, unless ``owned`` says the
    tensors are the store's to keep (received or filled for this request, held by no one else):
    then a shard takes them as they are, so creating or restoring it needs no second copy."""
    check_restorable(state)
    with about(state.ref.variable):
        if owned and state.value.is_contiguous():
            value = state.value.detach()
        else:
            value = state.value.detach().clone(memory_format=torch.contiguous_format)
        if state.optimizer is None:
            return Shard(state, value, None, capacity)
        return Shard(state, value, ShardOptimizer(state.optimizer, value, state.slots, copy_slots=not owned), capacity)


def check_variables_agree(shards: Sequence[Shard]) -> None:
    """All shards of one variable in a request must agree on its shape and dtype."""
    seen: dict[str, Shard] = {}
    refs: set[ShardRef] = set()
    for shard in shards:
        if shard.ref in refs:
            raise InvalidRequestError(f"shard {shard.ref} appears twice in one request", variable=shard.ref.variable)
        refs.add(shard.ref)
        first = seen.setdefault(shard.ref.variable, shard)
        if (first.variable_shape, first.value.dtype) != (shard.variable_shape, shard.value.dtype):
            raise ShapeMismatchError(
                f"shards disagree on the variable: {first.variable_shape} {first.value.dtype} vs "
                f"{shard.variable_shape} {shard.value.dtype}",
                variable=shard.ref.variable,
            )


def check_replaceable(variable: str, restored: Sequence[Shard], live: Sequence[Shard]) -> None:
    """Raises unless ``restored`` may replace the ``live`` shards of ``variable`` on this server."""
    if not live:
        return
    first, new = live[0], restored[0]
    if first.variable_shape != new.variable_shape:
        raise ShapeMismatchError(
            f"the restore gives the variable shape {new.variable_shape}, this server holds it as "
            f"{first.variable_shape}; delete the variable first to restore another shape",
            variable=variable,
        )
    if first.value.dtype != new.value.dtype:
        raise DtypeMismatchError(
            f"the restore gives the variable dtype {new.value.dtype}, this server holds it as {first.value.dtype}; "
            "delete the variable first to restore another dtype",
            variable=variable,
        )
    left = sorted(s.ref.shard for s in live if s.ref not in {r.ref for r in restored})
    if left:
        raise InvalidRequestError(
            f"the restore gives shards {sorted(s.ref.shard for s in restored)} of the variable but this server "
            f"also holds shards {left}: restore all of a variable's shards on a server at once (its layout "
            "must not change), or delete the variable first",
            variable=variable,
        )


# ---------------------------------------------------------------------------
# Checks of reads and pushes, and holding several shards' locks


def _bad_index(rows: Tensor, num_rows: int) -> int | None:
    """The first row index outside ``[0, num_rows)``, or None."""
    if not rows.numel():
        return None
    low, high = torch.aminmax(rows)
    if int(low) >= 0 and int(high) < num_rows:  # the usual case, in one pass
        return None
    bad = rows[(rows < 0) | (rows >= num_rows)]
    return int(bad[0]) if bad.numel() else None


def check_rows(rows: Any, shard: Shard) -> None:
    if not isinstance(rows, Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
        got = f"{rows.dim()}-d {rows.dtype}" if isinstance(rows, Tensor) else type(rows).__name__
        raise InvalidRequestError(f"row indices must be a 1-d int64 tensor, got {got}")
    if shard.value.dim() == 0:
        raise ShapeMismatchError("a 0-d variable has no rows; read or push it whole")
    num_rows = shard.value.shape[0]
    bad = _bad_index(rows, num_rows)
    if bad is not None:
        raise IndexOutOfRangeError(
            f"row index {bad} is out of range for shard {shard.ref.shard}, which has rows [0, {num_rows}) "
            f"(local indices; the shard starts at variable row {shard.row_start})"
        )


def check_finite(shard: Shard, values: Tensor) -> None:
    if not all_finite(values):
        raise NonFiniteGradientError(f"gradient for shard {shard.ref.shard} holds NaN or Inf")


@contextlib.contextmanager
def all_locked(shards: Sequence[Shard]) -> Iterator[None]:
    """Holds every shard's lock, taken in the order given (callers sort), released in reverse.
    (An ExitStack costs several times more per lock, on every step.)"""
    taken: list[threading.Lock] = []
    try:
        for shard in shards:
            shard.lock.acquire()
            taken.append(shard.lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release()


def all_finite(values: Tensor) -> bool:
    """True when no element is NaN or Inf.

    A sum is finite only if every element is (NaN and Inf propagate), and
    summing is ~15x cheaper than an element-wise scan; only a non-finite sum
    (which a sum overflowing from finite values also gives) needs the exact scan.
    """
    if not values.is_floating_point() or values.numel() == 0:
        return True
    if bool(torch.isfinite(values.sum(dtype=torch.float64 if values.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(values).all())
