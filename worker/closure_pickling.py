"""How a closure travels from the coordinator to a worker: pickled with cloudpickle, its
distributed parameters by reference.

A parameter marked as a variable (``worker.layers.mark_variable``: one created inside
``ParameterServerStrategy.scope()``) pickles as a *reference* (name, shape, dtype), never as
its data; the worker resolves it through the ``VariableAccess`` of the closure it runs
(``loads_closure``) to a local ``nn.Parameter`` that it fills from the servers before the
step runs. Modules travel without the empty hook dicts the worker recreates anyway.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any

import cloudpickle
import torch
from torch import nn

from paramserve.worker.layers import ShardedEmbedding, VariableAccess, current_access, using_access, variable_name

__all__ = ["dumps_closure", "loads_closure"]


def _resolve_parameter(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return current_access().parameter(name, shape, dtype)


_REFILLED_MODULE_ATTRIBUTES = frozenset(
    {
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_backward_pre_hooks",
        "_non_persistent_buffers_set",
    }
)
"""Attributes that ``nn.Module.__setstate__`` recreates, empty, when a pickled module lacks them."""


_PLAIN_MODULE_CLASSES: dict[int, tuple[object, bool]] = {}


def _pickles_plainly(cls: object) -> bool:
    """Whether a module class pickles by nn.Module's own protocol (no reduce or state methods
    of its own), which leaves its state to ``nn.Module.__setstate__``. Cached by class."""
    known = _PLAIN_MODULE_CLASSES.get(id(cls))
    if known is not None and known[0] is cls:
        return known[1]
    plain = bool(
        getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
        and getattr(cls, "__reduce__", None) is object.__reduce__
        and getattr(cls, "__getstate__", None) in _DICT_STATES
        and getattr(cls, "__setstate__", None) is nn.Module.__setstate__
    )
    _PLAIN_MODULE_CLASSES[id(cls)] = (cls, plain)
    return plain


_DICT_STATES = (nn.Module.__getstate__, ShardedEmbedding.__getstate__)
"""``__getstate__`` methods that return nn.Module's state dict (ShardedEmbedding's drops its
``home``): a module with one of them is rebuilt as nn.Module.__setstate__ would."""


def _trimmed_module(module: nn.Module) -> tuple[Any, ...]:
    """``module``'s state less the empty hook dicts ``nn.Module.__setstate__`` would recreate:
    a module carries about 13 of them, most of the objects a closure pickles (a 3-layer MLP:
    89 of 122), paid at every schedule()."""
    state = {
        k: v
        for k, v in module.__getstate__().items()
        if not (k in _REFILLED_MODULE_ATTRIBUTES and isinstance(v, (dict, set)) and not v)
    }
    return _rebuild_module, (type(module), state)


def _rebuild_module(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    """What ``nn.Module.__setstate__`` makes of ``state`` (the class's own, see _pickles_plainly),
    written straight into the instance's dict: its refill goes through ``Module.__setattr__``,
    which costs more on the worker than the trimming saves on the coordinator."""
    module = cls.__new__(cls)
    fresh: dict[str, Any] = {k: OrderedDict() for k in _REFILLED_MODULE_ATTRIBUTES}
    fresh["_non_persistent_buffers_set"] = set()
    fresh["_is_full_backward_hook"] = None
    module.__dict__.update(fresh)
    module.__dict__.update(state)
    return module


class _ClosurePickler(cloudpickle.Pickler):
    """cloudpickle that sends distributed parameters by reference, and modules without the empty
    hook dicts the worker recreates."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = variable_name(obj)
            if name is not None:
                return _resolve_parameter, (name, tuple(obj.shape), obj.dtype)
        elif isinstance(obj, nn.Module) and _pickles_plainly(type(obj)):
            return _trimmed_module(obj)
        return super().reducer_override(obj)


def dumps_closure(obj: Any) -> bytes:
    """Serialises a closure (function, args, kwargs) for a worker.

    Raises TypeError naming what cannot be sent (a lock, an open file, a generator...); an
    object that refuses to be sent with an error of its own (a RuntimeError saying why, as an
    optimizer with step hooks does under parameter servers) raises that error as it is.
    """
    buffer = io.BytesIO()
    try:
        _ClosurePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except RuntimeError:
        raise
    except Exception as err:
        raise TypeError(
            f"cannot send this to a worker: {type(err).__name__}: {err}. Closures and their "
            "arguments must be picklable by cloudpickle (no locks, open files, generators, "
            "or CUDA streams); create such things on the worker, e.g. with "
            "ClusterCoordinator.create_per_worker_dataset"
        ) from err
    return buffer.getvalue()


def loads_closure(payload: bytes, access: VariableAccess) -> Any:
    """Deserialises a closure, resolving distributed parameters through ``access``."""
    with using_access(access):
        return cloudpickle.loads(payload)
