"""A model with an embedding table and a parameter-server strategy that dials nothing: for unit
tests of what a strategy decides before any call (variables, optimizers, bad input)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from paramserve.coordinator import ClusterSpec, ParameterServerStrategy, ShardedEmbedding

CLUSTER = ClusterSpec(parameter_servers=("127.0.0.1:1",), workers=("127.0.0.1:2",))
"""Addresses nothing listens on: every check these tests make happens before a call."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        self.table = ShardedEmbedding(100, 4)


def undialled_strategy() -> Iterator[ParameterServerStrategy]:
    """A fixture's body: a ParameterServerStrategy on CLUSTER, closed afterwards."""
    strategy = ParameterServerStrategy(CLUSTER)
    yield strategy
    strategy.close()
