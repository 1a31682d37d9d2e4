"""What a torch.optim optimizer built in ``strategy.scope()`` declares to the parameter servers.

Its parameter groups (``server_groups``): each group's own options (a learning rate, a weight
decay of its own: the usual "no decay on biases", or a rate per part of a model), not only the
optimizer's defaults, become the servers' optimizer for that group's variables, so the servers
apply what the same optimizer would apply locally. Options about how a step runs locally
(``LOCAL_ONLY_OPTIONS``) are left to the servers.

The embedding tables it trains:

A ``ShardedEmbedding`` or ``DynamicEmbedding`` is not an ``nn.Parameter`` (its rows live only on
the parameter servers), so ``model.parameters()`` leaves it out, and an optimizer built the
usual way, ``torch.optim.Adagrad(model.parameters(), lr=...)``, would hold the model's dense
layers only: its tables would compute gradients every step and never be updated, silently. In
TensorFlow an optimizer over ``model.trainable_variables`` updates the embeddings too. So an
optimizer that holds *every* parameter of a model also trains that model's tables that no
optimizer trains yet (``tables_of_whole_models``); one built from part of a model
(``model.top.parameters()``) trains only what it holds. A later ``strategy.optimizer(...,
params=[table])``, or one for every variable without its own, takes such a table over
(``hand_over``), so no table is ever pushed by two optimizers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from torch import nn

from paramserve.worker.dynamic_embedding import DynamicEmbedding
from paramserve.worker.variables import ServerOptimizer, ShardedEmbedding

__all__ = ["LOCAL_ONLY_OPTIONS", "declarations", "hand_over", "server_groups", "tables_of_whole_models"]

LOCAL_ONLY_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""torch.optim options about how a step runs locally; the servers choose their own."""


def declarations(
    groups: Sequence[Mapping[str, Any]],
    defaults: Mapping[str, Any],
    models: Iterable[tuple[str, nn.Module]],
    untrained: Collection[str],
) -> tuple[list[tuple[list[Any], dict[str, Any]]], list[str]]:
    """What an optimizer with these param groups and defaults declares: (parameters or table
    names, options) per group, then the tables it takes (``tables_of_whole_models``) with the
    defaults, last; and those tables."""
    declared: list[tuple[list[Any], dict[str, Any]]] = list(server_groups(groups, defaults))
    tables = tables_of_whole_models([p for params, _ in declared for p in params], models, untrained)
    if tables or not declared:
        declared.append((list(tables), server_options(defaults, defaults)))
    return declared, tables


def server_options(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``options`` (a param group, or the defaults) the servers apply: the
    optimizer's own constructor options (``defaults`` names them; a group also holds keys a
    scheduler adds, such as ``initial_lr``), set, and not only local."""
    return {k: options[k] for k in defaults if k not in LOCAL_ONLY_OPTIONS and options.get(k) is not None}


def server_groups(
    groups: Sequence[Mapping[str, Any]], defaults: Mapping[str, Any]
) -> list[tuple[list[nn.Parameter], dict[str, Any]]]:
    """Each non-empty param group as (its parameters, the options the servers apply to them)."""
    return [(list(g["params"]), server_options(g, defaults)) for g in groups if list(g["params"])]


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
