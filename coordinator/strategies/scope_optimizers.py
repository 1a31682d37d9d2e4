"""What a torch.optim optimizer built in ``strategy.scope()`` declares to the parameter servers.

Its parameter groups (``declarations``): each group's own options (a learning rate, a weight
decay of its own: the usual "no decay on biases", or a rate per part of a model), not only the
optimizer's defaults, become the servers' optimizer for that group's variables, so the servers
apply what the same optimizer would apply locally. Options about how a step runs locally
(``LOCAL_ONLY_OPTIONS``) are left to the servers. A rate set on a group later, as a torch LR
scheduler does on the coordinator, reaches the servers too (``watch_rates``).

The embedding tables it trains:

A ``ShardedEmbedding`` or ``DynamicEmbedding`` is not an ``nn.Parameter`` (its rows live only on
the parameter servers), so ``model.parameters()`` leaves it out, and an optimizer built the
usual way, ``torch.optim.Adagrad(model.parameters(), lr=...)``, would hold the model's dense
layers only: its tables would compute gradients every step and never be updated, silently. In
TensorFlow an optimizer over ``model.trainable_variables`` updates the embeddings too. So an
optimizer that holds *every* parameter of a model also trains that model's tables that no
optimizer trains yet (``tables_of_whole_models``), with its first group's options and rate;
one built from part of a model (``model.top.parameters()``) trains only what it holds. A later
``strategy.optimizer(..., params=[table])``, or one for every variable without its own, takes
such a table over (``hand_over``), so no table is ever pushed by two optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserve.worker.dynamic_embedding import DynamicEmbedding
from paramserve.worker.layers import ServerOptimizer, ShardedEmbedding

__all__ = [
    "LOCAL_ONLY_OPTIONS",
    "adopt",
    "GroupDeclaration",
    "RateWatchingGroup",
    "declarations",
    "hand_over",
    "show_rate",
    "tables_of_whole_models",
    "watch_rates",
]

LOCAL_ONLY_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""torch.optim options about how a step runs locally; the servers choose their own."""


@dataclass
class GroupDeclaration:
    """One param group of an in-scope optimizer, as the servers get it."""

    group: Mapping[str, Any]
    """The optimizer's own param group (where a scheduler writes its rate)."""
    params: list[Any]
    """Its parameters, and for the first group the tables the optimizer takes."""
    options: dict[str, Any]


def adopt(
    optimizer: torch.optim.Optimizer,
    declare: Callable[[list[Any], dict[str, Any]], ServerOptimizer],
    models: Iterable[tuple[str, nn.Module]],
    untrained: Collection[str],
    apply_rate: Callable[[Sequence[str], float], None],
) -> tuple[ServerOptimizer, list[str]]:
    """The ServerOptimizer ``optimizer`` stands for: ``declare(params, options)`` for each of
    its ``declarations``, in one optimizer that steps them all in one push, the groups' rates
    watched (``watch_rates``); and the tables it took. Its home and owner are the first
    declaration's (the strategy's)."""
    declared, tables = declarations(optimizer.param_groups, optimizer.defaults, models, untrained)
    parts = [declare(d.params, d.options) for d in declared]
    names = [name for part in parts for name in part.variables]
    first = parts[0]
    linked = ServerOptimizer(names, first.spec_name, declared[0].options, home=first.home, owner=first.owner)
    watch_rates(optimizer, [(d, p.variables) for d, p in zip(declared, parts)], linked, apply_rate)
    return linked, tables


def declarations(
    groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
    models: Iterable[tuple[str, nn.Module]],
    untrained: Collection[str],
) -> tuple[list[GroupDeclaration], list[str]]:
    """What an optimizer with these param groups and defaults declares, one entry per non-empty
    group; the tables it takes (``tables_of_whole_models``) join its first group (its options,
    its rate), and are returned too."""
    declared = [
        GroupDeclaration(g, params, server_options(g, defaults)) for g in groups if (params := list(g["params"]))
    ]
    tables = tables_of_whole_models([p for d in declared for p in d.params], models, untrained)
    if declared:
        declared[0].params += tables
    return declared, tables


def server_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``options`` (a param group, or the defaults) the servers apply: the
    optimizer's own constructor options (``defaults`` names them; a group also holds keys a
    scheduler adds, such as ``initial_lr``), set, and not only local."""
    return {k: options[k] for k in defaults if k not in LOCAL_ONLY_OPTIONS and options.get(k) is not None}


class RateWatchingGroup(dict[str, Any]):
    """A param group that calls ``changed(lr)`` when its ``"lr"`` is set to another value: a
    torch LR scheduler (or the user) writes ``group["lr"]`` on the coordinator, and only the
    servers can apply it."""

    def __init__(self, group: Mapping[str, Any], changed: Callable[[float], None]):
        super().__init__(group)
        self._changed = changed

    def __setitem__(self, key: str, value: Any) -> None:
        before = self.get(key)
        super().__setitem__(key, value)
        if key == "lr" and value != before:
            self._changed(float(value))


def watch_rates(
    optimizer: torch.optim.Optimizer,
    declared: Sequence[tuple[GroupDeclaration, Sequence[str]]],
    linked: ServerOptimizer,
    apply: Callable[[Sequence[str], float], None],
) -> None:
    """Makes each declared group of ``optimizer`` (with the variables declared for it) a
    RateWatchingGroup: a rate set on it reaches the servers (``apply(names, lr)``) for those of
    its variables ``linked`` (the optimizer's ServerOptimizer) still steps (a table handed over
    to another optimizer keeps that one's rate); the first group's is the rate
    ``strategy.learning_rate`` reports (``linked.spec_kwargs``)."""
    for position, (declaration, names) in enumerate(declared):
        index = next(i for i, g in enumerate(optimizer.param_groups) if g is declaration.group)

        def changed(lr: float, names: Sequence[str] = tuple(names), first: bool = position == 0) -> None:
            apply([name for name in names if name in linked.variables], lr)
            if first:
                linked.spec_kwargs["lr"] = lr

        optimizer.param_groups[index] = RateWatchingGroup(declaration.group, changed)


def show_rate(optimizer: Any, linked: ServerOptimizer, lr: float) -> None:
    """A rate the servers apply now (``strategy.set_learning_rate``) is what ``optimizer``
    shows too: ``linked.spec_kwargs`` and, for a torch optimizer built in scope, every param
    group's ``"lr"``, as under the other strategies (written past RateWatchingGroup: the
    servers have it already)."""
    linked.spec_kwargs["lr"] = lr
    for group in getattr(optimizer, "param_groups", ()):
        dict.__setitem__(group, "lr", lr)


def tables_of_whole_models(
    held: Iterable[nn.Parameter], models: Iterable[tuple[str, nn.Module]], untrained: Collection[str]
) -> list[str]:
    """The tables (variable names) of each model in ``models`` ((prefix, module) pairs, as the
    strategy keeps them) whose every parameter is in ``held``, among the ``untrained`` ones (no
    optimizer trains them yet); in model order, once each. A model without parameters (a table
    on its own) is never whole-held."""
    ids = {id(p) for p in held}
    names: dict[str, None] = {}
    for _, model in models:
        own = list(model.parameters())
        if not own or any(id(p) not in ids for p in own):
            continue
        for module in model.modules():
            if isinstance(module, (ShardedEmbedding, DynamicEmbedding)) and module.variable in untrained:
                names[module.variable] = None
    return list(names)


def hand_over(taken: MutableMapping[str, ServerOptimizer], declared: Iterable[str]) -> None:
    """Another optimizer was declared for ``declared``: each table among them that an in-scope
    optimizer took (``taken``: table -> that optimizer) is released by it and forgotten."""
    for name in declared:
        if name in taken:
            taken.pop(name).release(name)
