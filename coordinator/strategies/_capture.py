"""What a strategy's scope sees being built, and how built objects get redirected per replica.

- ``recording_modules``: torch's global registration hooks report every module
  that gets a parameter, buffer or submodule while the scope is open (in the
  scope's own thread); the roots are the user's models.
- ``capturing_optimizers``: while a scope is open, ``torch.optim.Optimizer.__init__``
  reports each optimizer built in that thread (``OPTIMIZER_INIT``, a SharedHook:
  patched while any scope is open, restored when the last one closes).
- ``link_module`` / ``redirect_optimizer`` + ``link_optimizer``: the object's class
  becomes a subclass whose calls go to the current replica's copy (modules) or to
  the strategy's step (optimizers: the merge of replicas, or a push to parameter
  servers). The user keeps using the very objects they built. ``unlink`` restores
  the user's class; a strategy's ``close()`` does it for everything it linked.

Every strategy that captures what its scope builds uses these, and nothing else.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from paramserve.coordinator.strategies._process_hooks import SharedHook
from paramserve.coordinator.strategies._replicas import replica_of, replica_thread
from paramserve.coordinator.strategies.base import Strategy
from paramserve.psserver.protocol.optimizer_spec import building_server_optimizer

LINK = "_paramserve_link"
"""Instance attribute holding the link of a distributed module or optimizer."""


# ------------------------------------------------------------------ modules built in scope


@dataclass
class ScopeRecord:
    """Modules the scope's thread built, and which of them became children of others."""

    thread: int
    modules: dict[int, nn.Module] = field(default_factory=dict)
    children: set[int] = field(default_factory=set)

    def saw_module(self, module: nn.Module) -> None:
        if threading.get_ident() == self.thread:
            self.modules.setdefault(id(module), module)

    def roots(self) -> list[nn.Module]:
        return [m for key, m in self.modules.items() if key not in self.children]


@contextlib.contextmanager
def recording_modules(place_on: torch.device | None = None) -> Iterator[ScopeRecord]:
    """Records modules built in this thread while open (see ScopeRecord.roots).

    With ``place_on``, each parameter and buffer such a module registers moves to that device
    as it is registered, so what the constructor does next (initialisation, tied weights) and
    an optimizer built in the scope (eager state, e.g. Adagrad's) already see it there. Only
    module state moves: no default device is set, so the rest of the scope's code (input
    pipelines above all) builds its tensors where it always would."""
    record = ScopeRecord(threading.get_ident())

    def on_parameter(module: nn.Module, name: str, parameter: nn.Parameter | None) -> nn.Parameter | None:
        record.saw_module(module)
        if place_on is None or parameter is None or threading.get_ident() != record.thread:
            return None
        return _placed_parameter(parameter, place_on)

    def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
        record.saw_module(module)
        if place_on is None or buffer is None or threading.get_ident() != record.thread:
            return None
        return buffer.to(place_on) if buffer.device != place_on else None

    def on_submodule(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        record.saw_module(module)
        if submodule is not None and threading.get_ident() == record.thread:
            record.children.add(id(submodule))

    # torch documents these hooks as "-> None or new parameter/buffer" but types them "-> None".
    handles = [
        module_hooks.register_module_parameter_registration_hook(cast(Callable[..., None], on_parameter)),
        module_hooks.register_module_buffer_registration_hook(cast(Callable[..., None], on_buffer)),
        module_hooks.register_module_module_registration_hook(on_submodule),
    ]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _placed_parameter(parameter: nn.Parameter, device: torch.device) -> nn.Parameter | None:
    """Moves ``parameter`` to ``device`` in place (the same object: a tied module or an optimizer
    may already hold it), as ``Module.to`` does; a new Parameter only where torch cannot swap
    the data in place (another kind of tensor, e.g. meta). None: nothing to replace."""
    if parameter.device == device or nn.parameter.is_lazy(parameter):
        return None  # lazy parameters have no data yet: the scope's exit moves the module
    moved = parameter.detach().to(device)
    try:
        parameter.data = moved
    except RuntimeError:  # set_data refuses tensors of another kind
        return nn.Parameter(moved, requires_grad=parameter.requires_grad)
    return None


# ------------------------------------------------------------------ optimizers built in scope

_local = threading.local()


def _sinks() -> list[Callable[[torch.optim.Optimizer], None]]:
    sinks = getattr(_local, "sinks", None)
    if sinks is None:
        sinks = _local.sinks = []
    return sinks


def _patch_optimizer_init() -> Callable[[], None]:
    original = torch.optim.Optimizer.__init__

    def capturing_init(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        sinks = _sinks()
        # Only the thread whose scope is open captures (other threads are untouched), and only
        # what user code builds: the parameter-server library's own optimizers are not captured.
        if sinks and not building_server_optimizer():
            sinks[-1](self)

    torch.optim.Optimizer.__init__ = capturing_init  # type: ignore[method-assign]

    def restore() -> None:
        torch.optim.Optimizer.__init__ = original  # type: ignore[method-assign]

    return restore


OPTIMIZER_INIT = SharedHook("torch.optim.Optimizer.__init__", _patch_optimizer_init)
"""Reports each optimizer built in a thread whose scope is open; installed while any scope is open."""


@contextlib.contextmanager
def capturing_optimizers(on_create: Callable[[torch.optim.Optimizer], None]) -> Iterator[None]:
    """Calls ``on_create(optimizer)`` for every optimizer this thread builds while open."""
    lease = OPTIMIZER_INIT.acquire()
    _sinks().append(on_create)
    try:
        yield
    finally:
        _sinks().pop()
        lease.release()


# ------------------------------------------------------------------ redirection


class ModuleLink:
    """The modules each replica uses in place of one module the user built."""

    def __init__(self, strategy: Strategy, replicas: tuple[nn.Module, ...]):
        self.strategy = strategy
        self.replicas = replicas

    def current_replica(self) -> int | None:
        """This thread's replica id when it runs a replica of the owning strategy."""
        replica = replica_of(self.strategy)
        if replica is None or getattr(_local, "unredirected", False):
            return None
        return replica

    def target(self, module: nn.Module) -> nn.Module:
        replica = self.current_replica()
        return module if replica is None else self.replicas[replica]


@contextlib.contextmanager
def unredirected() -> Iterator[None]:
    """In this thread, the user's modules are themselves again, even inside a replica: for
    strategy code that updates the user's (central) module from a replica thread."""
    previous = getattr(_local, "unredirected", False)
    _local.unredirected = True
    try:
        yield
    finally:
        _local.unredirected = previous


class OptimizerLink(Protocol):
    """What a strategy does for the optimizer methods that touch every replica (or the servers)."""

    def step(self, closure: Callable[[], Any] | None) -> Any: ...

    def zero_grad(self, set_to_none: bool) -> None: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group added after the scope closed: onto every replica's optimizer too (or refused
        where it could never train)."""

    def pickled_as(self) -> Any:
        """What the optimizer becomes when pickled (e.g. sent to a worker); None: a plain
        copy of the user's optimizer."""


def _same(value: Any) -> Any:
    return value


def _rebuild(cls: Any, state: dict[str, Any]) -> Any:
    """Unpickles/deep-copies a linked object as a plain object of the user's class."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


_classes: dict[tuple[str, type], type] = {}
_classes_lock = threading.Lock()


def _cached(kind: str, cls: type[Any], build: Callable[[type[Any]], type]) -> type:
    with _classes_lock:
        if (kind, cls) not in _classes:
            _classes[(kind, cls)] = build(cls)
        return _classes[(kind, cls)]


def _module_target(module: nn.Module) -> nn.Module:
    link = object.__getattribute__(module, "__dict__").get(LINK)
    return module if link is None else link.target(module)


_BROADCAST_METHODS = ("train", "zero_grad", "load_state_dict", "requires_grad_")
"""Module methods that, called outside the replicas, apply to every replica's copy too."""


def _build_module_class(cls: Any) -> type:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        target = _module_target(self)
        if target is self:
            return cls.__call__(self, *args, **kwargs)
        return target(*args, **kwargs)

    get = cls.__getattribute__

    def __getattribute__(self: nn.Module, name: str) -> Any:
        # Inside replica r every attribute (parameters(), .weight, submodules) is replica r's,
        # so that code reaching into the model also computes on that replica's copy.
        # Outside replica threads (the common case) this is one thread-local read. This runs
        # for every attribute a module call touches: ModuleLink.target, inlined.
        strategy = getattr(replica_thread, "strategy", None)
        if strategy is None or name[:2] == "__":
            return get(self, name)
        link = object.__getattribute__(self, "__dict__").get(LINK)
        if link is None or link.strategy is not strategy or getattr(_local, "unredirected", False):
            return get(self, name)
        target = link.replicas[replica_thread.replica]
        if target is self:
            return get(self, name)
        return getattr(target, name)

    def broadcasting(name: str) -> Callable[..., Any]:
        base = getattr(cls, name)

        def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            result = base(self, *args, **kwargs)
            link: ModuleLink = object.__getattribute__(self, "__dict__")[LINK]
            if link.current_replica() is None:
                for other in link.replicas:
                    if other is not self:
                        getattr(other, name)(*args, **kwargs)
            return result

        method.__name__ = name
        method.__doc__ = base.__doc__
        return method

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        state = {k: v for k, v in object.__getattribute__(self, "__dict__").items() if k != LINK}
        return (_rebuild, (cls, state))

    namespace: dict[str, Any] = {
        "__call__": __call__,
        "__getattribute__": __getattribute__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_paramserve_base": cls,
    }
    namespace.update({name: broadcasting(name) for name in _BROADCAST_METHODS})
    return type(cls.__name__, (cls,), namespace)


def link_module(module: nn.Module, link: ModuleLink) -> None:
    """Redirects ``module`` (calls and attributes) to ``link``'s replica copies inside replicas."""
    module.__dict__[LINK] = link
    module.__class__ = _cached("module", type(module), _build_module_class)


def is_linked(obj: object) -> bool:
    return LINK in getattr(obj, "__dict__", {})


def base_class(obj: object) -> type[Any]:
    """The user's class of a linked object."""
    return getattr(type(obj), "_paramserve_base", type(obj))


def _build_optimizer_class(cls: Any) -> type:
    def link_of(self: torch.optim.Optimizer) -> OptimizerLink:
        link = self.__dict__.get(LINK)
        if link is None:
            raise RuntimeError(
                f"this {cls.__name__} was built in a strategy scope that has not closed (or that failed): "
                "leave the `with strategy.scope():` block before training"
            )
        return link

    def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        return link_of(self).step(closure)

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        link_of(self).zero_grad(set_to_none)

    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        link_of(self).load_state_dict(state_dict)

    def state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
        link = self.__dict__.get(LINK)
        return cls.state_dict(self) if link is None else link.state_dict()

    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        link = self.__dict__.get(LINK)  # none yet: in scope (torch's own __init__ adds the first groups)
        if link is None:
            cls.add_param_group(self, param_group)
        else:
            link.add_param_group(param_group)

    def __reduce_ex__(self: torch.optim.Optimizer, protocol: Any) -> Any:
        link = self.__dict__.get(LINK)
        stand_in = link.pickled_as() if link is not None else None
        if stand_in is not None:
            # Its steps run where the closure carrying it goes; torch's LR scheduler asks whether
            # one ran before its own first step (else it warns of a skipped first rate).
            self.__dict__["_opt_called"] = True
            return (_same, (stand_in,))
        return (_rebuild, (cls, cls.__getstate__(self)))

    return type(
        cls.__name__,
        (cls,),
        {
            "step": step,
            "zero_grad": zero_grad,
            "load_state_dict": load_state_dict,
            "state_dict": state_dict,
            "add_param_group": add_param_group,
            "__reduce_ex__": __reduce_ex__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_paramserve_base": cls,
        },
    )


def redirect_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Makes ``step``/``zero_grad``/``load_state_dict`` go to the link set later by ``link_optimizer``.
    Done when the optimizer is built, before an LR scheduler can wrap its ``step``."""
    optimizer.__class__ = _cached("optimizer", type(optimizer), _build_optimizer_class)


def link_optimizer(optimizer: torch.optim.Optimizer, link: OptimizerLink) -> None:
    optimizer.__dict__[LINK] = link


def unlink(obj: nn.Module | torch.optim.Optimizer) -> None:
    """Undoes ``link_module`` / ``redirect_optimizer``: the object is of the user's class again."""
    obj.__dict__.pop(LINK, None)
    obj.__class__ = base_class(obj)
