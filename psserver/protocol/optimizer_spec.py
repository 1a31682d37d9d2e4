"""What an optimizer is on the wire: a torch.optim class name and its keyword arguments.

Every process speaks :class:`OptimizerSpec` (the strategy builds one from the user's optimizer,
the client sends it, the server builds its shard's optimizer from it), so it lives in the
vocabulary every process shares, apart from the server's update code (``store.optimizer``).
A spec is checked against torch itself: the names and arguments torch accepts, and one step
on a probe with the arguments given.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from paramserve.psserver.protocol.errors import (
    InvalidRequestError,
)

__all__ = [
    "IMPLEMENTATION_FLAGS",
    "OPTIMIZER_NAMES",
    "OptimizerSpec",
    "build_torch_optimizer",
    "building_server_optimizer",
    "optimizer_parameters",
]

OPTIMIZER_NAMES: tuple[str, ...] = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
)
"""The torch.optim classes a variable may be created with (a whitelist: names are looked up, never evaluated)."""

# Implementation switches the server owns. A client may only pass the value
# the server uses anyway (False or None).
IMPLEMENTATION_FLAGS: dict[str, bool] = {
    "foreach": False,
    "fused": False,
    "capturable": False,
    "differentiable": False,
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name not in OPTIMIZER_NAMES:
        raise InvalidRequestError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return getattr(torch.optim, name)


@functools.cache
@functools.cache
def optimizer_parameters(name: str) -> dict[str, Any]:
    """The keyword arguments of torch.optim.<name> besides ``params``, with their defaults
    (``inspect.Parameter.empty`` for none)."""
    parameters = inspect.signature(optimizer_class(name).__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name not in ("self", "params")}


def _arguments(name: str) -> tuple[str, ...]:
    """The keyword arguments of torch.optim.<name> besides ``params``."""
    return tuple(optimizer_parameters(name))


def hyperparameter_names(name: str) -> tuple[str, ...]:
    return tuple(arg for arg in _arguments(name) if arg not in IMPLEMENTATION_FLAGS)


def _freeze(value: Any) -> Any:
    # JSON has lists only; torch wants tuples (betas), and a frozen spec must not share mutable lists.
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item) for item in value)
    if isinstance(value, Mapping):
        raise InvalidRequestError(f"optimizer arguments are numbers, booleans or lists; got an object {dict(value)!r}")
    return value


def _thaw(value: Any) -> Any:
    return [_thaw(item) for item in value] if isinstance(value, tuple) else value


def _check_scalar(key: str, value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) >= 1 << 63:  # JSON's integers are unbounded; math.isfinite overflows on them
            raise InvalidRequestError(f"optimizer argument {key!r} is too large ({len(str(abs(value)))} digits)")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequestError(f"optimizer argument {key!r} must be finite, got {value!r}")
        return
    raise InvalidRequestError(
        f"optimizer argument {key!r} must be a number, boolean, null or list of numbers, got {type(value).__name__}"
    )


def _check_argument(name: str, key: str, value: Any) -> None:
    if key not in _arguments(name):
        raise InvalidRequestError(
            f"optimizer {name} has no argument {key!r}; its arguments are {', '.join(hyperparameter_names(name))}"
        )
    if key in IMPLEMENTATION_FLAGS and value not in (None, False):
        raise InvalidRequestError(
            f"optimizer argument {key!r}={value!r} is not supported: the parameter server chooses the "
            f"implementation itself (deterministic single-tensor CPU kernels); drop {key!r}"
        )
    for item in value if isinstance(value, tuple) else (value,):
        _check_scalar(key, item)


@dataclass(frozen=True)
class OptimizerSpec:
    """A torch.optim class name and its keyword arguments, as sent on the wire.

    ``kwargs`` is frozen on construction (lists become tuples, e.g. ``betas``),
    so specs built from JSON and from Python compare equal. Construction only
    checks the structure; :meth:`validate` checks it against torch.
    """

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidRequestError(f"optimizer name must be a string, got {self.name!r}")
        if not isinstance(self.kwargs, Mapping):
            raise InvalidRequestError(f"optimizer kwargs must be a JSON object, got {self.kwargs!r}")
        frozen = {str(key): _freeze(self.kwargs[key]) for key in sorted(self.kwargs, key=str)}
        object.__setattr__(self, "kwargs", MappingProxyType(frozen))

    def __hash__(self) -> int:
        return hash((self.name, tuple(self.kwargs.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        return (OptimizerSpec, (self.name, dict(self.kwargs)))

    def with_kwargs(self, values: Mapping[str, Any]) -> OptimizerSpec:
        """This spec with ``values`` replacing its arguments of those names (not validated)."""
        return OptimizerSpec(self.name, {**self.kwargs, **values})

    def to_json(self) -> str:
        """``kwargs`` as a JSON object with sorted keys (the wire's ``kwargs_json``)."""
        try:
            plain = {key: _thaw(value) for key, value in self.kwargs.items()}
            return json.dumps(plain, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"optimizer {self.name} arguments are not JSON: {exc}") from None

    @classmethod
    def from_json(cls, name: str, kwargs_json: str) -> OptimizerSpec:
        """Parses and validates a spec from the wire; "" means no arguments.

        Raises InvalidRequestError for malformed JSON, an unknown name or bad arguments.
        """
        try:
            kwargs = json.loads(kwargs_json) if kwargs_json else {}
        except ValueError as exc:
            raise InvalidRequestError(f"optimizer {name} kwargs_json is not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise InvalidRequestError(f"optimizer {name} kwargs_json must be a JSON object, got {kwargs_json!r}")
        spec = cls(name, kwargs)
        spec.validate()
        return spec

    def validate(self) -> None:
        """Raises InvalidRequestError unless torch.optim.<name>(**kwargs) would be built and used here."""
        optimizer_class(self.name)
        for key, value in self.kwargs.items():
            _check_argument(self.name, key, value)
        _validated_by_torch(self)


_building = threading.local()


def building_server_optimizer() -> bool:
    """True while this thread builds an optimizer of the server's own (for a shard, or to check a
    spec). A strategy scope that captures the optimizers user code builds skips these."""
    return getattr(_building, "depth", 0) > 0


def build_torch_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer for ``spec`` with the server's implementation flags forced."""
    arguments = _arguments(spec.name)
    kwargs: dict[str, Any] = {key: value for key, value in spec.kwargs.items() if key not in IMPLEMENTATION_FLAGS}
    kwargs.update({key: value for key, value in IMPLEMENTATION_FLAGS.items() if key in arguments})
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        return optimizer_class(spec.name)(params, **kwargs)
    finally:
        _building.depth -= 1


@functools.lru_cache(maxsize=256)
def _validated_by_torch(spec: OptimizerSpec) -> None:
    # torch checks ranges (lr >= 0, 0 <= beta < 1, nesterov needs momentum, ...);
    # its message is the most precise one we can give.
    # One step on a probe as well: some arguments (betas=[0.9]) fail only when torch uses them,
    # with whatever error that gives (IndexError, OverflowError, ...).
    probe = torch.nn.Parameter(torch.zeros(2))
    try:
        optimizer = build_torch_optimizer(spec, [probe])
        probe.grad = torch.ones(2)
        optimizer.step()
    except Exception as exc:
        raise InvalidRequestError(f"invalid arguments for optimizer {spec.name}: {type(exc).__name__}: {exc}") from None
