"""Which embedding tables a torch.optim optimizer built in ``strategy.scope()`` trains.

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

from collections.abc import Collection, Iterable, MutableMapping

from torch import nn

from paramserve.worker.dynamic_embedding import DynamicEmbedding
from paramserve.worker.variables import ServerOptimizer, ShardedEmbedding

__all__ = ["hand_over", "tables_of_whole_models"]


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
