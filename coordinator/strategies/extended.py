"""``strategy.extended``: tf.distribute.StrategyExtended, the API for distribution-aware algorithms
beyond the Strategy API: where replicas compute and variables live, reductions to chosen
devices, and updates applied to every copy of a variable.

Every strategy's ``extended`` is a StrategyExtended; what differs between strategies (the copies a
variable has, how values reduce, which devices) each strategy answers itself through the methods
``Strategy`` declares for it ("what StrategyExtended asks" in base.py: ``variable_copies``,
``reduce_to_devices``, ``worker_devices``...), so this module holds only what every strategy shares.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from paramserve.coordinator import nest
from paramserve.coordinator.strategies.base import DefaultStrategy, ReduceOp, Strategy, adopt_global_scope
from paramserve.coordinator.strategies.cross_device_ops import as_device
from paramserve.coordinator.strategies.distributed_values import (
    DistributedValue,
    Mirrored,
    PerReplica,
    regroup,
)

Destinations = str | torch.device | torch.Tensor | DistributedValue | Sequence[str | torch.device]


class StrategyExtended:
    """tf.distribute.StrategyExtended for one strategy (``strategy.extended``). It refers to its
    strategy weakly, as TensorFlow's does, so it keeps no strategy alive."""

    experimental_require_static_shapes: bool = False
    """Whether the strategy needs static shapes (in TensorFlow only TPUs do): never here."""

    def __init__(self, strategy: Strategy):
        self._ref = weakref.ref(strategy)

    @property
    def _strategy(self) -> Strategy:
        strategy = self._ref()
        if strategy is None:
            raise RuntimeError(
                "this StrategyExtended's strategy was garbage-collected: use a live strategy's .extended"
            )
        adopt_global_scope(strategy)
        return strategy

    # ------------------------------------------------------------------ devices

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this process's replicas compute on, by name ("cpu:0", "cuda:1"; a name
        works wherever torch takes a device).

        Raises:
            RuntimeError: the strategy has none here (the default strategy, as in TensorFlow).
        """
        return self._strategy.worker_devices()

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices this process keeps variables on, by name: every replica's under
        OneDevice and Mirrored, the parameter device under CentralStorage.

        Raises:
            RuntimeError: the strategy has none here (the default strategy, as in TensorFlow).
        """
        return self._strategy.parameter_devices()

    # ------------------------------------------------------------------ variables

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a variable of this strategy: a parameter or buffer of a module built
        in its scope (or a replica's copy of one), or a SyncOnReadVariable it owns. Under the
        default strategy: a variable no strategy owns. A module's variables count from the exit
        of the scope that built it (when paramserve distributes it); a tensor built outside any
        module is not a variable here: False."""
        return self._strategy.owns_variable(v)

    def value_container(self, value: Any) -> Any:
        """The variable (or module) that ``value``, one replica's copy of it, belongs to; any
        other value is its own container. ``value`` is always among
        ``strategy.experimental_local_results(value_container(value))``."""
        return self._strategy.value_container(value)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside go where ``colocate_with_variable`` is. Every in-process
        strategy places all the variables its scope creates alike (where they were built, on the
        one device, on every replica, or on the parameter device), so colocation holds by
        construction. A scope distributes what it built when it exits, so a variable built
        earlier in the same scope is not yet this strategy's: only another strategy's is refused.

        Raises:
            ValueError: ``colocate_with_variable`` belongs to another strategy.
            NotImplementedError: the strategy places variables by another rule (a parameter
                server strategy's partitioner), which the message names.
        """
        strategy = self._strategy
        refused = strategy.colocation_refusal()
        if refused is not None:
            raise NotImplementedError(refused)
        if not strategy.owns_variable(colocate_with_variable) and not DefaultStrategy().owns_variable(
            colocate_with_variable
        ):
            raise ValueError(
                f"colocate_vars_with got a variable of another strategy: under {type(strategy).__name__} pass one "
                f"created in {type(strategy).__name__}.scope()"
            )
        yield

    # ------------------------------------------------------------------ reductions

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Destinations) -> Any:
        """Reduces ``value`` (a distributed value, or a variable of this strategy) across the
        replicas to ``destinations``: a device ("cpu", "cuda:0", "/gpu:0"), a list of devices, a
        distributed value or a variable (its copies' devices). Returns a detached tensor on a
        single destination device, a Mirrored with one copy per device for several.
        Cross-replica context only; under a multi-process strategy a collective.

        Raises:
            RuntimeError: called inside ``run`` (use ``get_replica_context().all_reduce`` there).
            ValueError: SUM of a value that is not per-replica, or a destination that is not a device.
        """
        strategy = self._strategy
        strategy.require_cross_replica("strategy.extended.reduce_to", "get_replica_context().all_reduce")
        if isinstance(value, torch.Tensor):
            copies = strategy.variable_copies(value)
            value = Mirrored(copies) if len(copies) > 1 else value
        return strategy.reduce_to_devices(ReduceOp(reduce_op), value, destination_devices(strategy, destinations))

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Destinations]]
    ) -> list[Any]:
        """``reduce_to`` of each ``(value, destinations)`` pair, in order."""
        return [self.reduce_to(reduce_op, value, destinations) for value, destinations in value_destination_pairs]

    # ------------------------------------------------------------------ updates

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(copy, *args, **kwargs)`` on every copy of ``var``: each replica's under
        MirroredStrategy, the central parameter once under CentralStorageStrategy (its replicas'
        copies are refreshed from it), the variable itself elsewhere. A Mirrored argument gives
        each copy its own component, and plain tensors are moved to the copy's device. ``fn``
        runs in cross-replica context, without autograd (an update, as an optimizer step is).

        Inside ``run`` it is a merge point (``merge_call``): every replica must call it, and
        copy r is updated with replica r's arguments, which must agree for the copies to stay equal.

        Returns:
            group=True: ``fn``'s results merged, a Mirrored where the copies' results differ (for
            one copy: its result). group=False: each leaf a tuple of one result per copy.

        Raises:
            ValueError: under several replicas, ``var`` is not a variable of this strategy; or an
                argument is a PerReplica value (reduce it first: ``reduce_to``, ``all_reduce``).
        """
        strategy = self._strategy
        args, kwargs = tuple(args), dict(kwargs or {})
        context = strategy.current_replica()
        if context is None:
            return _update(strategy, var, fn, args, kwargs, group)

        def merge_fn(merging: Strategy, /, *merged_args: Any, **merged_kwargs: Any) -> Any:
            # Replica 0's closure runs (as in TensorFlow): its var, read through a module inside the
            # replica, is replica 0's copy, whose container is the variable.
            container = merging.value_container(var)
            return _update(merging, container, fn, _as_mirrored(merged_args), _as_mirrored(merged_kwargs), group)

        return context.merge_call(merge_fn, args, kwargs)

    def __repr__(self) -> str:
        strategy = self._ref()
        return f"StrategyExtended({type(strategy).__name__ if strategy is not None else 'collected'})"


_extended: weakref.WeakKeyDictionary[Strategy, StrategyExtended] = weakref.WeakKeyDictionary()
_extended_lock = threading.Lock()


def extended_of(strategy: Strategy) -> StrategyExtended:
    """``strategy.extended``: one StrategyExtended per strategy, made at the first access."""
    with _extended_lock:
        extended = _extended.get(strategy)
        if extended is None:
            extended = _extended[strategy] = StrategyExtended(strategy)
        return extended


def destination_devices(strategy: Strategy, destinations: Destinations) -> list[torch.device]:
    """The devices ``destinations`` names (see ``StrategyExtended.reduce_to``).

    Raises:
        ValueError: a destination that is none of a device, a list of devices, a distributed
            value or a tensor; a device name that does not parse or is not on this machine.
    """
    if isinstance(destinations, (str, torch.device)):
        return [as_device(destinations)]
    if isinstance(destinations, DistributedValue):
        return [torch.as_tensor(v).device for v in destinations.values]
    if isinstance(destinations, torch.Tensor):
        return [torch.as_tensor(c).device for c in strategy.variable_copies(destinations)]
    if (
        isinstance(destinations, Sequence)
        and destinations
        and all(isinstance(d, (str, torch.device)) for d in destinations)
    ):
        return [as_device(d) for d in destinations]
    raise ValueError(
        f"destinations must be a device ('cpu', 'cuda:0', '/gpu:0'), a non-empty list of them, a distributed "
        f"value or a variable; got {destinations!r}"
    )


def _update(
    strategy: Strategy, var: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], group: bool
) -> Any:
    """``update`` in cross-replica context: ``fn`` on each copy, then the strategy's follow-up."""
    if strategy.num_replicas_in_sync > 1 and not strategy.owns_variable(var):
        name = type(strategy).__name__
        raise ValueError(
            f"{name}.extended.update() changes every copy of a variable created in {name}.scope() (a parameter or "
            f"buffer of a module built there, or a SyncOnReadVariable); a {type(var).__name__} that is not one has "
            "one copy only: build it in the scope, or change it directly"
        )
    copies = strategy.variable_copies(var)
    results = []
    with torch.no_grad(), strategy.cross_replica_context():
        for i, copy in enumerate(copies):
            device = copy.device if isinstance(copy, torch.Tensor) else None
            results.append(
                fn(copy, *_for_copy(args, i, len(copies), device), **_for_copy(kwargs, i, len(copies), device))
            )
    strategy.after_update(var)
    merged = regroup(results, Mirrored)
    return merged if group else nest.map_structure(_per_copy, merged)


def _as_mirrored(structure: Any) -> Any:
    """Arguments merged across replicas: replica r's argument is copy r's (``update``'s promise)."""
    return nest.map_structure(lambda leaf: Mirrored(leaf.values) if type(leaf) is PerReplica else leaf, structure)


def _for_copy(structure: Any, copy: int, copies: int, device: torch.device | None) -> Any:
    """Copy ``copy``'s arguments: its component of each Mirrored value (the first one's when the
    value has another number of components), plain tensors moved to ``device``."""

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            raise ValueError(
                "update() got a PerReplica argument, which would update the copies of a variable differently: "
                "reduce it first (strategy.extended.reduce_to, or get_replica_context().all_reduce inside run)"
            )
        if isinstance(leaf, Mirrored):
            leaf = leaf.values[copy] if len(leaf.values) == copies else leaf.primary
        if isinstance(leaf, torch.Tensor) and device is not None:
            return leaf.to(device)
        return leaf

    return nest.map_structure(pick, structure)


def _per_copy(leaf: Any) -> tuple[Any, ...]:
    return tuple(leaf.values) if isinstance(leaf, DistributedValue) else (leaf,)
