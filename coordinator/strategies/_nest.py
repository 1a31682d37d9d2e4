"""Nested structures of tensors (tuples, namedtuples, lists, dicts): the few operations
strategies need to split inputs and regroup per-replica results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from paramserve.coordinator.strategies.values import PerReplica


def map_structure(fn: Callable[[Any], Any], nest: Any) -> Any:
    """Applies ``fn`` to every leaf, keeping the containers' types."""
    if isinstance(nest, tuple) and hasattr(nest, "_fields"):  # namedtuple
        return type(nest)(*(map_structure(fn, v) for v in nest))
    if isinstance(nest, (tuple, list)):
        return type(nest)(map_structure(fn, v) for v in nest)
    if isinstance(nest, dict):
        return type(nest)((k, map_structure(fn, v)) for k, v in nest.items())
    return fn(nest)


def flatten(nest: Any) -> list[Any]:
    """The leaves, in the order ``map_structure`` visits them."""
    leaves: list[Any] = []
    map_structure(leaves.append, nest)
    return leaves


def to_device(nest: Any, device: torch.device) -> Any:
    """Every tensor leaf moved to ``device`` (asynchronously when the copy allows it)."""
    return map_structure(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, nest)


def regroup(per_replica: Sequence[Any]) -> Any:
    """Turns one nest per replica into one nest whose differing leaves are PerReplica.

    Leaves that are the same object on every replica stay plain (as TF merges them);
    with one replica the nest itself is returned."""
    if len(per_replica) == 1:
        return per_replica[0]
    first = per_replica[0]
    if all(v is first for v in per_replica):
        return first
    same_type = all(type(v) is type(first) for v in per_replica)
    if same_type and isinstance(first, (tuple, list)) and all(len(v) == len(first) for v in per_replica):
        columns = [regroup([v[i] for v in per_replica]) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    if same_type and isinstance(first, dict) and all(v.keys() == first.keys() for v in per_replica):
        return type(first)((k, regroup([v[k] for v in per_replica])) for k in first)
    return PerReplica(list(per_replica))
