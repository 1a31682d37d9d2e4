"""The one conversion of layouts and the cluster context to and from the wire (psserver.convert)."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import ParamServeError
from paramserve.psserver.protocol.partition import split_rows
from paramserve.psserver.protocol.types import ClusterContext, ShardPlacement, VariableLayout


def layout(name: str, shape: tuple[int, ...], shards: int, servers: int) -> VariableLayout:
    if not shape:
        return VariableLayout(name, shape, torch.float32, (ShardPlacement(0, 0, 0, 0),))
    ranges = split_rows(shape[0], shards)
    return VariableLayout(
        name,
        shape,
        torch.float32,
        tuple(ShardPlacement(i, i % servers, r.start, r.stop - r.start) for i, r in enumerate(ranges)),
    )


@pytest.fixture
def cluster() -> ClusterContext:
    layouts = [layout("w", (10, 3), 3, 2), layout("b", (3,), 1, 2), layout("scale", (), 1, 2)]
    return ClusterContext(("10.0.0.1:2222", "10.0.0.2:2222"), {each.name: each for each in layouts}, generation=2)


def test_cluster_context_round_trips_through_the_wire(cluster):
    message = convert.cluster_to_proto(cluster)

    assert list(message.parameter_servers) == list(cluster.parameter_servers)
    assert sum(len(v.shards) for v in message.variables) == 5
    assert convert.cluster_from_proto(message) == cluster
    assert convert.cluster_from_proto(message).fingerprint == cluster.fingerprint


def test_fingerprints_differ_when_anything_moves(cluster):
    moved = dict(cluster.layouts)
    w = moved["w"]
    moved["w"] = VariableLayout(
        w.name, w.shape, w.dtype, (*w.shards[:-1], ShardPlacement(2, 1, 7, 3))
    )  # last shard moves
    assert ClusterContext(cluster.parameter_servers, moved).fingerprint != cluster.fingerprint
    assert ClusterContext(cluster.parameter_servers[::-1], cluster.layouts).fingerprint != cluster.fingerprint
    assert ClusterContext(cluster.parameter_servers, cluster.layouts, 3).fingerprint != cluster.fingerprint


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.variables[0].shards[0].__setattr__("server", 5),  # no such server
        lambda m: m.variables[0].shards[0].__setattr__("row_start", 1),  # rows not covered from 0
        lambda m: m.variables[0].shards[1].__setattr__("index", 7),  # shards out of order
        lambda m: m.variables[0].shards.pop(),  # rows missing
        lambda m: m.variables[0].__setattr__("dtype", "complex1024"),  # unknown dtype
        lambda m: m.variables[0].__setattr__("name", ""),  # no name
        lambda m: m.variables.append(m.variables[0]),  # a variable twice
        lambda m: m.__setattr__("generation", -1),
    ],
    ids=["server", "row_start", "index", "missing_rows", "dtype", "name", "twice", "generation"],
)
def test_malformed_cluster_contexts_are_refused_on_the_way_in(cluster, mutate):
    message = convert.cluster_to_proto(cluster)
    mutate(message)
    with pytest.raises(ParamServeError):
        convert.cluster_from_proto(message)
