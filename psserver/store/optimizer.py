"""Optimizer updates of one shard, computed by torch.optim itself.

A parameter server applies the gradients it receives with the optimizer the
variable was created with. Rather than re-implement the update rules, a
:class:`ShardOptimizer` wraps the shard's value in a ``torch.nn.Parameter``
and calls ``step()`` of the real ``torch.optim`` class, so a dense push
computes exactly what ``torch.optim`` computes on one process.

Row-sparse pushes (embedding gradients) are applied *lazily*: only the rows a
push touches are read and written, so a push costs O(rows pushed), not
O(rows in the shard). The touched rows of the value and of every row-shaped
optimizer slot are gathered into a temporary parameter and temporary state,
one step of the same torch optimizer runs on them, and the results are
scattered back. Consequences, which are the usual lazy-update semantics:

* Duplicate rows in one push are summed first, like a coalesced
  ``torch.sparse_coo_tensor`` gradient.
* Rows a push does not touch are not changed at all: no momentum decay, no
  weight decay, no moment decay for them (dense torch.optim would decay
  them). For Adam this is exactly ``torch.optim.SparseAdam`` (up to where
  ``eps`` enters the denominator, a difference far below 1e-6); for Adagrad
  exactly torch's sparse-gradient Adagrad; for plain SGD exactly SGD.
* Per-shard state that is not row-shaped (Adam's ``step``, NAdam's
  ``mu_product``) is shared by all rows and advances once per sparse push,
  as SparseAdam's step count does.
* A row-shaped slot that does not exist yet is created as zeros for the
  whole shard before the touched rows are written. That is torch's own
  initial value for every allowed optimizer except SGD's momentum buffer,
  which torch starts at the first gradient; with ``dampening=0`` (the
  default) both give the same update.

Dense pushes to several shards of one spec run as one ``step()`` over all of
them (:class:`GroupedSteps`): with the for-loop implementation forced below,
that computes bit for bit what one step per shard computes, at one call's
overhead instead of one per shard.

Only CPU-friendly, deterministic code paths are used: the server sets
``foreach=False``, ``capturable=False``, ``differentiable=False`` and
``fused=False`` itself, and rejects a spec that asks for any of them.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    ShapeMismatchError,
)
from paramserve.psserver.protocol.optimizer_spec import (
    OptimizerSpec,
    build_torch_optimizer,
    hyperparameter_names,
    optimizer_parameters,
)
from paramserve.psserver.protocol.tensors import strictly_increasing

__all__ = ["GroupedSteps", "ShardOptimizer", "check_optimizer", "check_slots", "warm_up"]


@dataclass(frozen=True)
class _SlotLayout:
    value_shaped: bool  # same shape as the parameter (row-shaped when it has rows)
    shape: tuple[int, ...]  # for a value-shaped slot: the probe's shape, not the shard's
    dtype: torch.dtype


@functools.lru_cache(maxsize=256)
def _slot_layout(
    spec: OptimizerSpec, row_shape: tuple[int, ...], scalar: bool, dtype: torch.dtype
) -> Mapping[str, _SlotLayout]:
    """The state torch keeps for a parameter after one step: names, shapes, dtypes.

    Found by stepping the real optimizer once on a tiny parameter (two rows
    of ``row_shape``, or a 0-d one), so it follows whatever torch version is
    installed rather than a table that could go stale.
    """
    probe = torch.nn.Parameter(torch.zeros(() if scalar else (2, *row_shape), dtype=dtype))
    try:
        optimizer = build_torch_optimizer(spec, [probe])
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
    except (RuntimeError, NotImplementedError) as exc:
        raise DtypeMismatchError(f"optimizer {spec.name} cannot update a {dtype} variable: {exc}") from None
    except Exception as exc:
        raise InvalidRequestError(
            f"invalid arguments for optimizer {spec.name}: a trial step failed with {type(exc).__name__}: {exc}"
        ) from None
    state = optimizer.state[probe]
    return MappingProxyType(
        {
            key: _SlotLayout(tuple(slot.shape) == tuple(probe.shape), tuple(slot.shape), slot.dtype)
            for key, slot in state.items()
            if isinstance(slot, Tensor)
        }
    )


def _layout_for(spec: OptimizerSpec, value: Tensor) -> Mapping[str, _SlotLayout]:
    return _slot_layout(spec, tuple(value.shape[1:]), value.dim() == 0, value.dtype)


def _check_slot(key: str, slot: Any, layout: _SlotLayout, value: Tensor) -> None:
    if not isinstance(slot, Tensor):
        raise InvalidRequestError(f"optimizer slot {key!r} must be a tensor, got {type(slot).__name__}")
    if slot.dtype != layout.dtype:
        raise DtypeMismatchError(f"optimizer slot {key!r} has dtype {slot.dtype}; expected {layout.dtype}")
    expected = tuple(value.shape) if layout.value_shaped else layout.shape
    if tuple(slot.shape) != expected:
        raise ShapeMismatchError(f"optimizer slot {key!r} has shape {tuple(slot.shape)}; expected {expected}")


def check_slots(spec: OptimizerSpec, value: Tensor, slots: Mapping[str, Tensor]) -> None:
    """Raises unless ``slots`` is empty or exactly the state torch keeps for ``value`` under ``spec``.

    All-or-nothing, because torch initialises its state only when there is
    none: a partial state would make its next step fail.
    """
    if not slots:
        return
    layout = _layout_for(spec, value)
    if set(slots) != set(layout):
        raise InvalidRequestError(
            f"optimizer {spec.name} keeps the slots {sorted(layout)} for this variable; got {sorted(slots)}. "
            "Pass all of them (as saved by a checkpoint) or none"
        )
    for key, slot in slots.items():
        _check_slot(key, slot, layout[key], value)


def check_optimizer(spec: OptimizerSpec, value: Tensor, slots: Mapping[str, Tensor]) -> None:
    """Raises as ShardOptimizer(spec, value, slots) would, building nothing of the shard's size:
    a bad spec, a value it cannot update, or slots that are not the state it keeps."""
    spec.validate()
    _check_floating(value)
    _layout_for(spec, value)  # a trial step on a scratch tensor: settings torch checks only when stepping
    check_slots(spec, value, slots)


def _check_floating(value: Tensor) -> None:
    if not value.is_floating_point():
        raise DtypeMismatchError(f"an optimizer updates floating-point variables only; this one is {value.dtype}")


def _within(rows: Tensor, count: int) -> bool:
    low, high = torch.aminmax(rows)
    return int(low) >= 0 and int(high) < count


def _step_rows(spec: OptimizerSpec, steps: Sequence[RowStep]) -> None:
    """One torch.optim step of ``spec`` over gathered rows (one shard's or several), scattered back."""
    optimizer = _row_optimizer(spec)
    group = optimizer.param_groups[0]
    group["params"] = [step.param for step in steps]
    optimizer.state.clear()
    for step in steps:
        optimizer.state[step.param] = step.state
    try:
        step_without_profiling(optimizer)
        for step in steps:
            step.owner.scatter_rows(step, optimizer.state[step.param])
    finally:
        group["params"] = []  # the rows are temporary: hold none of them between steps
        optimizer.state.clear()


def step_without_profiling(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the wrapper torch.optim puts around every step (a profiler
    range and the global step hooks, which a server never registers): on a server that steps
    small shards thousands of times a second the range cost about 5% of its CPU. The wrapped
    step (functools.wraps' ``__wrapped__``) still sets the grad mode; where torch wraps it
    otherwise, this falls back to ``step()``."""
    unwrapped = getattr(type(optimizer).step, "__wrapped__", None)
    if unwrapped is None or not getattr(type(optimizer).step, "hooked", False):
        optimizer.step()
        return
    unwrapped(optimizer)


_row_optimizers = threading.local()
_ROW_OPTIMIZERS_KEPT = 16
"""Row-step optimizers each data-plane thread keeps, by spec (a spec changes with the learning rate)."""


def _row_optimizer(spec: OptimizerSpec) -> torch.optim.Optimizer:
    """A torch optimizer of ``spec`` whose parameter group a row step fills with its gathered
    rows and empties after: building one per step (torch.optim's constructor, and the state it
    initialises only to be replaced) cost more than a small shard's update. One per thread,
    since data-plane threads step different shards at once."""
    kept: OrderedDict[OptimizerSpec, torch.optim.Optimizer] | None = getattr(_row_optimizers, "by_spec", None)
    if kept is None:
        kept = _row_optimizers.by_spec = OrderedDict()
    optimizer = kept.get(spec)
    if optimizer is None:
        optimizer = build_torch_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
        optimizer.param_groups[0]["params"] = []
        optimizer.state.clear()
        kept[spec] = optimizer
        while len(kept) > _ROW_OPTIMIZERS_KEPT:
            kept.popitem(last=False)
    kept.move_to_end(spec)
    return optimizer


def row_state(spec: OptimizerSpec, dim: int, dtype: torch.dtype) -> dict[str, tuple[bool, Tensor]]:
    """The state ``spec`` keeps for a parameter of rows of ``dim``, as a fresh optimizer has it:
    name -> (row-shaped, one row's initial value or the whole shared tensor). What torch makes
    in its constructor (Adagrad's ``initial_accumulator_value``) is taken from it, the rest
    (made at the first step) starts at zeros, as the row step above assumes."""
    layout = _slot_layout(spec, (dim,), False, dtype)
    probe = torch.nn.Parameter(torch.zeros((1, dim), dtype=dtype))
    made = build_torch_optimizer(spec, [probe]).state.get(probe, {})
    state = {}
    for key, slot in layout.items():
        if slot.value_shaped:
            initial = made[key][0].clone() if key in made else torch.zeros(dim, dtype=slot.dtype)
        else:
            initial = made[key].clone() if key in made else torch.zeros(slot.shape, dtype=slot.dtype)
        state[key] = (slot.value_shaped, initial)
    return state


def step_gathered(spec: OptimizerSpec, param: torch.nn.Parameter, state: dict[str, Any]) -> dict[str, Any]:
    """One step of ``spec`` on a temporary parameter (gathered rows, its ``grad`` set) with its
    state; returns the state after the step (``param`` is updated in place). The row step of
    ``ShardOptimizer.apply_rows``, for rows gathered from elsewhere (dynamic tables)."""
    optimizer = _row_optimizer(spec)
    group = optimizer.param_groups[0]
    group["params"] = [param]
    optimizer.state.clear()
    optimizer.state[param] = state
    try:
        step_without_profiling(optimizer)
        return dict(optimizer.state[param])
    finally:
        group["params"] = []
        optimizer.state.clear()


def updated_spec(spec: OptimizerSpec, values: Mapping[str, Any]) -> OptimizerSpec:
    """``spec`` with hyperparameters ``values`` (e.g. ``{"lr": 0.01}``), validated: the check a
    change of a dense variable's and a dynamic table's optimizer share.

    Raises InvalidRequestError for no values, an unknown key or a bad value.
    """
    if not isinstance(values, Mapping) or not values:
        raise InvalidRequestError('no hyperparameters given; pass e.g. {"lr": 0.01}')
    known = hyperparameter_names(spec.name)
    for key in values:
        if key not in known:
            raise InvalidRequestError(f"optimizer {spec.name} has no hyperparameter {key!r}; it has {', '.join(known)}")
    updated = spec.with_kwargs(values)
    updated.validate()
    return updated


def same_state_layout(spec: OptimizerSpec, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    """Raises InvalidRequestError when the slots a changed ``spec`` keeps (``after``, by name) are
    not those it kept (``before``): existing state cannot change its layout."""
    if set(before) != set(after):
        raise InvalidRequestError(
            f"changing these hyperparameters of {spec.name} changes its state from slots "
            f"{sorted(before)} to {sorted(after)}; create a new variable instead"
        )


@dataclass(eq=False)
class RowStep:
    """One shard's share of a row-sparse step, between ShardOptimizer.gather_rows and
    scatter_rows: the touched rows as a temporary parameter (with its gradient) and state."""

    owner: ShardOptimizer
    unique: Tensor
    param: torch.nn.Parameter
    state: dict[str, Any]


class ShardOptimizer:
    """Applies one torch.optim optimizer to one shard's value, in place.

    Not thread-safe: the owning shard's lock serialises every call.
    """

    def __init__(
        self, spec: OptimizerSpec, value: Tensor, slots: Mapping[str, Tensor] | None = None, *, copy_slots: bool = True
    ):
        """Wraps ``value`` (updated in place, not copied). Raises InvalidRequestError,
        DtypeMismatchError or ShapeMismatchError for a bad spec, dtype or slots. ``copy_slots``:
        False when the caller hands the slots over (nobody else holds them): they are kept as
        they are instead of copied."""
        check_optimizer(spec, value, slots or {})
        self._spec = spec
        # Parameter shares value's storage: step() updates the shard itself.
        self._param = torch.nn.Parameter(value.detach(), requires_grad=True)
        self._optimizer = build_torch_optimizer(spec, [self._param])
        if slots:
            self._replace_state(slots, copy=copy_slots)

    @property
    def spec(self) -> OptimizerSpec:
        """The spec in force, including hyperparameters changed since creation."""
        return self._spec

    @property
    def value(self) -> Tensor:
        """The shard's value (shares storage with the tensor passed in)."""
        return self._param.detach()

    def _state(self) -> dict[str, Any]:
        return self._optimizer.state[self._param]

    def _replace_state(self, slots: Mapping[str, Tensor], copy: bool = True) -> None:
        self._optimizer.state[self._param] = {
            key: slot.detach().clone() if copy else slot.detach() for key, slot in slots.items()
        }

    def _check_grad(self, grad: Tensor, shape: tuple[int, ...]) -> None:
        if grad.dtype != self._param.dtype:
            raise DtypeMismatchError(f"gradient has dtype {grad.dtype}; the shard is {self._param.dtype}")
        if tuple(grad.shape) != shape:
            raise ShapeMismatchError(f"gradient has shape {tuple(grad.shape)}; expected {shape}")

    def apply_dense(self, grad: Tensor) -> None:
        """One ``step()`` of the torch optimizer with ``grad`` as the whole shard's gradient."""
        self._check_grad(grad, tuple(self._param.shape))
        self._param.grad = grad.detach()
        try:
            step_without_profiling(self._optimizer)
        finally:
            self._param.grad = None

    def apply_rows(self, rows: Tensor, grad_rows: Tensor) -> None:
        """A lazy row-sparse step (see the module docstring): costs O(len(rows)).

        ``rows`` are int64 indices local to the shard (duplicates are summed);
        ``grad_rows[i]`` is the gradient of row ``rows[i]``.
        """
        _step_rows(self._spec, [self.gather_rows(rows, grad_rows)])

    def gather_rows(self, rows: Tensor, grad_rows: Tensor) -> RowStep:
        """The first half of ``apply_rows``: the touched rows of the value and of the row-shaped
        slots, as a temporary parameter (its gradient: ``grad_rows`` summed per row) and state
        for one step of this shard's optimizer. Raises as ``apply_rows`` does, changing nothing."""
        self._check_rows(rows)
        self._check_grad(grad_rows, (rows.shape[0], *self._param.shape[1:]))
        if strictly_increasing(rows):  # distinct rows, as a lookup's gradient arrives: nothing to sum
            unique, summed = rows, grad_rows.detach().clone()
        else:
            unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            summed = torch.zeros((unique.shape[0], *grad_rows.shape[1:]), dtype=grad_rows.dtype)
            summed.index_add_(0, inverse, grad_rows.detach())
        temporary = torch.nn.Parameter(self._param.detach().index_select(0, unique))
        temporary.grad = summed
        return RowStep(self, unique, temporary, self._gather_state(unique))

    def scatter_rows(self, step: RowStep, stepped: Mapping[str, Any]) -> None:
        """The second half: writes the stepped rows and state back into the shard."""
        self._param.detach().index_copy_(0, step.unique, step.param.detach())
        self._scatter_state(step.unique, stepped, step.param)

    def _check_rows(self, rows: Tensor) -> None:
        if self._param.dim() == 0:
            raise ShapeMismatchError("a 0-d variable has no rows; push its gradient dense")
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise InvalidRequestError(f"row indices must be 1-d int64, got {rows.dim()}-d {rows.dtype}")
        if rows.numel() and not _within(rows, self._param.shape[0]):
            raise IndexOutOfRangeError(f"row indices must be in [0, {self._param.shape[0]})")

    def _is_row_shaped(self, slot: Any) -> bool:
        return isinstance(slot, Tensor) and slot.shape == self._param.shape

    def _gather_state(self, unique: Tensor) -> dict[str, Any]:
        # Shared (non-row) state is cloned so that a failing step leaves ours intact.
        gathered: dict[str, Any] = {}
        for key, slot in self._state().items():
            if self._is_row_shaped(slot):
                gathered[key] = slot.index_select(0, unique)
            elif isinstance(slot, Tensor):
                gathered[key] = slot.clone()
            else:
                gathered[key] = slot
        return gathered

    @property
    def holds_slots(self) -> bool:
        """Whether the optimizer's state exists (after its first step, or from its constructor):
        then writing a row step back allocates nothing and cannot fail halfway."""
        return bool(self._state())

    def _scatter_state(self, unique: Tensor, stepped: Mapping[str, Any], temporary: Tensor) -> None:
        state = self._state()
        for key, slot in stepped.items():
            if isinstance(slot, Tensor) and slot.dim() >= 1 and slot.shape == temporary.shape:
                if not self._is_row_shaped(state.get(key)):
                    state[key] = torch.zeros_like(self._param.detach())
                state[key].index_copy_(0, unique, slot)
            else:
                state[key] = slot

    def snapshot(self, rows: Tensor | None = None) -> Callable[[], None]:
        """What a step may change, copied: returns the function that puts it back.

        ``rows`` (a row-sparse step's local rows): only those rows of the value and of
        row-shaped slots are copied, so undoing an embedding update costs O(rows), not
        O(table). The state's key set is restored too (a first step creates the slots).
        """
        value = self._param.detach()
        state = self._state()
        if rows is None:
            saved_value = value.clone()
            saved_state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}

            def undo() -> None:
                value.copy_(saved_value)
                self._optimizer.state[self._param] = saved_state

            return undo
        unique = torch.unique(rows)
        saved_rows = value.index_select(0, unique)
        row_slots = {k: v.index_select(0, unique) for k, v in state.items() if self._is_row_shaped(v)}
        other = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items() if k not in row_slots}

        def undo_rows() -> None:
            value.index_copy_(0, unique, saved_rows)
            current = self._state()
            restored = dict(other)
            for key, saved in row_slots.items():
                current[key].index_copy_(0, unique, saved)
                restored[key] = current[key]
            self._optimizer.state[self._param] = restored

        return undo_rows

    def slots(self) -> dict[str, Tensor]:
        """Copies of the optimizer state tensors, by torch's state key ("exp_avg", "step", ...)."""
        return {key: slot.detach().clone() for key, slot in self._state().items() if isinstance(slot, Tensor)}

    def load_slots(self, slots: Mapping[str, Tensor]) -> None:
        """Replaces the optimizer state with copies of ``slots`` (all of them, or none to reset).

        Raises (changing nothing) when ``slots`` does not match what torch keeps.
        """
        check_slots(self._spec, self._param, slots)
        if slots:
            self._replace_state(slots)
        else:
            self._optimizer = build_torch_optimizer(self._spec, [self._param])

    def with_hyperparameters(self, values: Mapping[str, Any]) -> OptimizerSpec:
        """The spec after ``values`` are applied, validated; changes nothing.

        Raises InvalidRequestError for an unknown key, a bad value, or a change
        that would alter the optimizer's existing state (e.g. turning on
        ``amsgrad`` after Adam has stepped): create a new variable for that.
        """
        updated = updated_spec(self._spec, values)
        # Without state torch creates whatever the new spec needs; a rate alone never changes the
        # slots (checking costs a trial step: a scheduler may set a rate every step).
        if self._state() and set(values) != {"lr"}:
            same_state_layout(self._spec, _layout_for(self._spec, self._param), _layout_for(updated, self._param))
        return updated

    def set_hyperparameters(self, values: Mapping[str, Any]) -> None:
        """Applies ``values`` (e.g. ``{"lr": 0.01}``) from the next step on; all or nothing."""
        updated = self.with_hyperparameters(values)
        group = self._optimizer.param_groups[0]
        for key in values:
            group[key] = updated.kwargs[key]
        self._spec = updated


@functools.lru_cache(maxsize=256)
def in_place_sgd_rate(spec: OptimizerSpec) -> float | None:
    """``lr`` when ``spec`` is SGD without momentum, weight decay or maximize, else None.

    Such a step is torch's own ``value.add_(grad, alpha=-lr)``, keeps no state, and allocates
    nothing: a group of shards is stepped with one ``torch._foreach_add_`` (the same kernel per
    shard, so the values are bit for bit torch.optim.SGD's) without torch.optim's per-step
    machinery, and, since an in-place add of checked shapes cannot fail halfway, without the
    copies a push takes to undo a failed step."""
    if spec.name != "SGD":
        return None
    defaults = {
        key: value for key, value in optimizer_parameters("SGD").items() if value is not inspect.Parameter.empty
    }
    settings = {**defaults, **spec.kwargs}
    if settings.get("momentum") or settings.get("weight_decay") or settings.get("maximize"):
        return None
    lr = settings.get("lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


class GroupedSteps:
    """Steps several shards' optimizers of one spec as a single ``torch.optim`` step.

    torch.optim's per-call overhead (hooks, profiler ranges, grad mode) costs far more
    than the update of a small shard, and a push touches every shard of a model on this
    server. A group optimizer holds the shards' own parameters and, for each step, their
    own live state dicts, so the shards' optimizers stay the single source of truth (a
    restore or a new spec just means another group). Groups are cached by their shards and
    specs (LRU); the caller holds every member shard's lock while stepping.
    """

    def __init__(self, capacity: int = 64):
        self._capacity = capacity
        self._groups: OrderedDict[tuple[Any, ...], torch.optim.Optimizer] = OrderedDict()
        self._lock = threading.Lock()

    def apply_dense(self, optimizers: Sequence[ShardOptimizer], grads: Sequence[Tensor]) -> None:
        """``optimizers[i].apply_dense(grads[i])`` for all i, as one step (all share one spec)."""
        rate = in_place_sgd_rate(optimizers[0].spec)
        if rate is not None:
            for optimizer, grad in zip(optimizers, grads):
                optimizer._check_grad(grad, tuple(optimizer._param.shape))
            torch._foreach_add_([optimizer.value for optimizer in optimizers], list(grads), alpha=-rate)
            return
        if len(optimizers) == 1:
            optimizers[0].apply_dense(grads[0])
            return
        for optimizer, grad in zip(optimizers, grads):
            optimizer._check_grad(grad, tuple(optimizer._param.shape))
        group = self._group(optimizers)
        params = [optimizer._param for optimizer in optimizers]
        for optimizer, param, grad in zip(optimizers, params, grads):
            group.state[param] = optimizer._state()  # the shard's own state dict, updated in place
            param.grad = grad.detach()
        try:
            step_without_profiling(group)
        finally:
            for param in params:
                param.grad = None

    def apply_rows(self, optimizers: Sequence[ShardOptimizer], rows: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """``optimizers[i].apply_rows(rows[i], grads[i])`` for all i (all share one spec), as one
        torch.optim step over the gathered rows of every shard: a recommendation model's push
        touches a shard of each of its tables, and torch.optim's per-call overhead would cost
        more than their updates. With the for-loop implementation forced, each shard's rows
        are computed exactly as its own step computes them; shared per-shard state (a step
        count) is each shard's own. Raises as apply_rows does, before any shard changes."""
        _step_rows(optimizers[0].spec, [o.gather_rows(r, g) for o, r, g in zip(optimizers, rows, grads)])

    def __len__(self) -> int:
        return len(self._groups)

    def clear(self) -> None:
        """Forgets every group (they hold their shards' tensors): after shards are deleted or replaced."""
        with self._lock:
            self._groups.clear()

    def _group(self, optimizers: Sequence[ShardOptimizer]) -> torch.optim.Optimizer:
        spec = optimizers[0].spec
        key = (spec, *optimizers)
        with self._lock:
            group = self._groups.get(key)
            if group is not None:
                self._groups.move_to_end(key)
                return group
        group = build_torch_optimizer(spec, [optimizer._param for optimizer in optimizers])
        with self._lock:
            self._groups[key] = group
            while len(self._groups) > self._capacity:
                self._groups.popitem(last=False)
        return group


def warm_up() -> None:
    """Runs one torch.optim step on a scratch tensor. torch imports much of itself lazily at
    the first optimizer step of a process (about 2 s of CPU on a 2-core machine): paid here, at
    start-up, before the server reports healthy, it does not land on the first push or on the
    restore of a restarted server (the coordinator's recovery time)."""
    scratch = torch.nn.Parameter(torch.zeros(1))
    scratch.grad = torch.zeros(1)
    torch.optim.SGD([scratch], lr=0.0).step()
