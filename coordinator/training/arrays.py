"""In-memory inputs for ``fit(x, y, batch_size=...)``: tensors or NumPy arrays, as Keras takes them.

``ArrayData`` is both things a strategy may want: an iterable of global batches (in-process
strategies split each one across their replicas; every process of a multi-process strategy
shuffles alike, seeded the same) and a dataset function ``fn(context)`` for parameter-server
workers, which yields endless shuffled batches of the whole set (each worker in its own order).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["ArrayData", "as_tensor", "split_validation"]


def as_tensor(value: Any, what: str) -> Tensor:
    """``value`` (a tensor, a NumPy array or a nested list) as a tensor; integer class labels stay integers."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        array = value.astype(np.float32) if value.dtype == np.float64 else value
        return torch.from_numpy(np.ascontiguousarray(array))
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{what} must be a tensor or an array, got {type(value).__name__}: {err}") from None


def split_validation(
    x: Tensor, y: Tensor, fraction: float
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]:
    """Holds out the last ``fraction`` of the examples (before any shuffling, as Keras does)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation_split must be in [0, 1), got {fraction}")
    held = int(len(x) * fraction)
    if held == 0:
        return (x, y), None
    return (x[:-held], y[:-held]), (x[-held:], y[-held:])


class ArrayData:
    """Batches of ``(x[i], y[i])``: an iterable of global batches (one pass each time it is
    iterated, reshuffled when ``shuffle``) and, called with a context, endless batches."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} examples and y {len(y)}: give one target per example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(x) == 0:
            raise ValueError("x and y hold no example")
        self.x, self.y, self.batch_size, self.shuffle, self.seed = x, y, batch_size, shuffle, seed
        self._passes = 0

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = self._order(torch.Generator().manual_seed(self.seed + self._passes))
        self._passes += 1
        return self._batches(order)

    def __call__(self, context: Any = None) -> Iterator[tuple[Tensor, Tensor]]:
        """Endless batches on a parameter-server worker, in that worker's own shuffled order."""
        generator = torch.Generator().manual_seed(self.seed + 7919 * getattr(context, "worker_index", 0))
        while True:
            yield from self._batches(self._order(generator))

    def _order(self, generator: torch.Generator) -> Tensor:
        return torch.randperm(len(self.x), generator=generator) if self.shuffle else torch.arange(len(self.x))

    def _batches(self, order: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            yield self.x[rows], self.y[rows]
