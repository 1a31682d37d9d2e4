"""Distributed iterators: what ``iter()`` of a distributed dataset returns (TF's
``tf.distribute.DistributedIterator``).

Beside ``next()``, a ``DistributedIterator`` has TensorFlow's ``get_next()``,
``get_next_as_optional()`` (an ``OptionalElement``, never an exception at the end) and
``element_spec`` (the shapes and dtypes of its elements, as ``TensorSpec``). It may read
ahead (``read_ahead`` elements beyond the one returned): the strategies ask for that where
the elements are copied to a GPU, so the next element's copies overlap the current step
(``InputOptions.experimental_per_replica_buffer_size``). An error met while reading ahead
is raised when its element would have been returned, not before.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paramserve.coordinator import nest
from paramserve.coordinator.strategies.distributed_values import DistributedValue

__all__ = ["DistributedIterator", "OptionalElement", "TensorSpec", "element_spec"]


@dataclass(frozen=True)
class TensorSpec:
    """The type of one tensor of an element (TF's ``tf.TensorSpec``): its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    def is_compatible_with(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has this shape and dtype."""
        return tensor.shape == self.shape and tensor.dtype == self.dtype


def element_spec(element: Any) -> Any:
    """``element``'s structure with each tensor replaced by its TensorSpec, each distributed
    value by the same kind of value over its components' specs, and any other leaf by its type."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return TensorSpec(value.shape, value.dtype)
        if isinstance(value, DistributedValue):
            return type(value)([element_spec(component) for component in value.values])
        return type(value)

    return nest.map_structure(leaf, element)


_NOTHING = object()


class OptionalElement:
    """An element, or none at the end of the input (TF's ``tf.experimental.Optional``), as
    ``DistributedIterator.get_next_as_optional()`` returns it."""

    def __init__(self, value: Any = _NOTHING, spec: Any = None):
        self._value = value
        self._spec = element_spec(value) if value is not _NOTHING else spec

    @classmethod
    def from_value(cls, value: Any) -> OptionalElement:
        """An optional that holds ``value``."""
        return cls(value)

    @classmethod
    def empty(cls, element_spec: Any = None) -> OptionalElement:
        """An optional that holds nothing (of ``element_spec``, when known)."""
        return cls(_NOTHING, element_spec)

    def has_value(self) -> bool:
        """Whether there is an element."""
        return self._value is not _NOTHING

    def get_value(self) -> Any:
        """The element. Raises ValueError when there is none (check ``has_value()`` first)."""
        if self._value is _NOTHING:
            raise ValueError("this optional holds no element (the input is exhausted): check has_value() first")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The type of the element it holds or would hold (None when unknown)."""
        return self._spec

    def __repr__(self) -> str:
        return f"OptionalElement({'value' if self.has_value() else 'empty'})"


@dataclass(frozen=True)
class _Failure:
    """An error met while reading ahead, raised when its element's turn comes."""

    error: BaseException


class DistributedIterator(Iterator[Any]):
    """An iterator over a distributed dataset's elements (TF's ``tf.distribute.DistributedIterator``).

    ``elements`` yields the elements; ``read_ahead`` (>= 0) is how many it takes beyond the
    one returned. Raises ValueError for a negative ``read_ahead``.
    """

    def __init__(self, elements: Iterator[Any], read_ahead: int = 0):
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
        self._elements = elements
        self._read_ahead = read_ahead
        self._buffer: collections.deque[Any] = collections.deque()
        self._ended = False
        self._spec: Any = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        self._fill(1 + self._read_ahead)
        if not self._buffer:
            raise StopIteration
        item = self._buffer.popleft()
        if isinstance(item, _Failure):
            raise item.error
        self._fill(self._read_ahead)  # the next elements' copies start while this one is used
        return item

    def get_next(self) -> Any:
        """The next element. Raises StopIteration at the end of the input, as ``next()`` does (a
        scheduled function that lets it escape ends in ``OutOfRangeError`` on the coordinator)."""
        return next(self)

    def get_next_as_optional(self) -> OptionalElement:
        """The next element as an OptionalElement: empty at the end of the input, never an error for it."""
        try:
            return OptionalElement.from_value(next(self))
        except StopIteration:
            return OptionalElement.empty(self.element_spec)

    @property
    def element_spec(self) -> Any:
        """The type of the elements (``element_spec`` of the first one, read ahead if it was not
        read yet); None when the input has no element."""
        self._fill(1)
        return self._spec

    def _fill(self, size: int) -> None:
        while not self._ended and len(self._buffer) < size:
            try:
                item = next(self._elements)
            except StopIteration:
                self._ended = True
                return
            except Exception as error:  # raised in its turn: the elements before it come first
                self._buffer.append(_Failure(error))
                self._ended = True
                return
            if self._spec is None:
                self._spec = element_spec(item)
            self._buffer.append(item)
