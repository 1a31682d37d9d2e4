"""Nested structures (tuples, namedtuples, lists, dicts, sets): the one walker the coordinator uses.

Strategies split inputs and move them to devices with it, the ClusterCoordinator
finds per-worker resources in a closure's arguments and fetches RemoteValues in a
result structure with it. Containers keep their types (an OrderedDict stays one,
a namedtuple stays that namedtuple); anything else is a leaf.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["flatten", "map_structure", "to_device"]


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Applies ``fn`` to every leaf, keeping the containers' types. A container that
    contains itself is a leaf where it recurs (no infinite recursion)."""
    return _map(fn, structure, set())


def _map(fn: Callable[[Any], Any], structure: Any, active: set[int]) -> Any:
    if not isinstance(structure, (tuple, list, set, frozenset, dict)) or id(structure) in active:
        return fn(structure)
    active.add(id(structure))
    try:
        if isinstance(structure, tuple) and hasattr(structure, "_fields"):  # namedtuple
            return type(structure)(*(_map(fn, v, active) for v in structure))
        if isinstance(structure, dict):
            mapped = copy.copy(structure)  # keeps the mapping's type (OrderedDict, defaultdict...)
            for key, value in structure.items():
                mapped[key] = _map(fn, value, active)
            return mapped
        return type(structure)(_map(fn, v, active) for v in structure)
    finally:
        active.discard(id(structure))


def flatten(structure: Any) -> list[Any]:
    """The leaves, in the order ``map_structure`` visits them."""
    leaves: list[Any] = []

    def collect(leaf: Any) -> Any:
        leaves.append(leaf)
        return leaf

    map_structure(collect, structure)
    return leaves


def to_device(structure: Any, device: torch.device) -> Any:
    """Every tensor leaf moved to ``device`` (a leaf already there is itself), also the tensors
    in the fields of a dataclass leaf (a batch class, e.g. recommendation.ClickBatch), which
    comes back as a new instance of its class when a field moved.

    Copies to a GPU are asynchronous (from pinned memory; ordered before any later use on the
    device's current stream); copies to the host wait for their data, which the host would
    otherwise read before it arrives."""
    non_blocking = torch.device(device).type == "cuda"

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(device, non_blocking=non_blocking)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            return _dataclass_to_device(leaf, device)
        return leaf

    return map_structure(move, structure)


def _dataclass_to_device(instance: Any, device: torch.device) -> Any:
    """``instance`` with its fields moved (``to_device``); itself when nothing moved. Fields not
    taken by ``__init__`` are carried over as they are (``dataclasses.replace`` would reset them)."""
    fields = dataclasses.fields(instance)
    changes = {}
    for f in fields:
        if f.init:
            value = getattr(instance, f.name)
            moved = to_device(value, device)
            if moved is not value:
                changes[f.name] = moved
    if not changes:
        return instance
    moved_instance = dataclasses.replace(instance, **changes)
    for f in fields:
        if not f.init and hasattr(instance, f.name):
            object.__setattr__(moved_instance, f.name, getattr(instance, f.name))
    return moved_instance
