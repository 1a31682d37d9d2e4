"""How a variable is cut into shards along axis 0, and where the shards live.

Every function here is a pure decision: it reads a shape and a dtype and
returns a number or a list, so the coordinator, the servers and the tests all
agree on the layout without talking to each other. The partitioners follow
tf.distribute.experimental.partitioners (same arguments, same results: called as
``partitioner(shape, dtype, axis=0)`` they return the number of partitions of every
axis, e.g. ``[2, 1]``), with ``torch.dtype`` in place of ``tf.DType``. A partitioner of
the user's own is any callable ``(shape, dtype)`` returning such a list (TensorFlow's
form) or one number of shards; ``shard_count`` reads either and refuses anything else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "RowRange",
    "split_rows",
    "place_shards",
    "shard_count",
]


class Partitioner(Protocol):
    """Decides how a variable of ``shape`` and ``dtype`` is partitioned (TF's
    ``tf.distribute.experimental.partitioners.Partitioner``; subclass it, or pass any callable).

    Returns the number of partitions of every axis (``[shards, 1, ...]``: only the first
    axis may be partitioned), or, paramserve's shorter form, the number of shards along axis 0.
    """

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> Sequence[int] | int: ...


def _require_positive(name: str, value: int, fix: str) -> None:
    # bool is an int subclass; True shards is a caller bug, not 1 shard.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; {fix}")


def _axis_length(shape: Sequence[int], axis: int) -> int:
    """Slices along ``axis``; a 0-d variable counts as one unsplittable row along axis 0.
    Raises ValueError for an axis the shape does not have."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < max(len(shape), 1):
        raise ValueError(
            f"axis {axis!r} is not an axis of shape {tuple(shape)}: pass 0..{max(len(shape), 1) - 1} (0: the rows)"
        )
    return int(shape[axis]) if len(shape) else 1


def _partitions(shape: Sequence[int], axis: int, count: int) -> list[int]:
    """TF's result: one entry per axis (one for a 0-d variable), ``count`` at ``axis``, 1 elsewhere."""
    result = [1] * max(len(shape), 1)
    result[axis] = count
    return result


def _total_bytes(shape: Sequence[int], dtype: torch.dtype, bytes_per_string: int) -> int:
    # torch has no string dtype; bytes_per_string is kept for TF parity and
    # only applies if a future dtype reports no item size.
    itemsize = dtype.itemsize or bytes_per_string
    return math.prod(int(dim) for dim in shape) * itemsize


class FixedShardsPartitioner:
    """``num_shards`` partitions along ``axis``, but never more than its slices (and at least one)."""

    def __init__(self, num_shards: int):
        _require_positive("num_shards", num_shards, "pass the number of shards, e.g. num_shards=2")
        self.num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        """The partitions of every axis of ``shape``, e.g. ``[2, 1]``. Raises ValueError for a bad axis."""
        return _partitions(shape, axis, max(1, min(self.num_shards, _axis_length(shape, axis))))

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class MinSizePartitioner:
    """As many shards as possible, up to ``max_shards``, of about ``min_shard_bytes`` each.

    Matches TF's MinSizePartitioner exactly, including its rounding: the
    count is ``ceil(total_bytes / min_shard_bytes)`` (TF's
    ``min_max_variable_partitioner``), capped by ``max_shards`` and the row
    count, and at least 1.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        _require_positive("min_shard_bytes", min_shard_bytes, "pass a size in bytes, e.g. 256 << 10")
        _require_positive("max_shards", max_shards, "pass the most shards a variable may get, e.g. the servers")
        _require_positive("bytes_per_string", bytes_per_string, "pass an estimate of one string's size, e.g. 16")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        """The partitions of every axis of ``shape``, e.g. ``[2, 1]``. Raises ValueError for a bad axis."""
        slices = _axis_length(shape, axis)
        total = _total_bytes(shape, dtype, self.bytes_per_string)
        wanted = -(-total // self.min_shard_bytes)  # ceil without floats
        return _partitions(shape, axis, max(1, min(self.max_shards, slices, wanted)))

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"


class MaxSizePartitioner:
    """As few shards as keep each under ``max_shard_bytes`` (capped by ``max_shards``).

    A single row larger than ``max_shard_bytes`` still gets a shard of its
    own: shards never split a row.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _require_positive("max_shard_bytes", max_shard_bytes, "pass a size in bytes, e.g. 64 << 20")
        if max_shards is not None:
            _require_positive("max_shards", max_shards, "pass None for no limit, or the most shards allowed")
        _require_positive("bytes_per_string", bytes_per_string, "pass an estimate of one string's size, e.g. 16")
        self.max_shard_bytes = max_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        """The partitions of every axis of ``shape``, e.g. ``[2, 1]``. Raises ValueError for a bad axis."""
        rows = _axis_length(shape, axis)
        if rows == 0:
            return _partitions(shape, axis, 1)
        bytes_per_row = _total_bytes(shape, dtype, self.bytes_per_string) // rows
        rows_per_shard = max(1, self.max_shard_bytes // bytes_per_row) if bytes_per_row else rows
        shards = -(-rows // rows_per_shard)
        if self.max_shards is not None:
            shards = min(self.max_shards, shards)
        return _partitions(shape, axis, max(1, shards))

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"


def shard_count(partitioner: Partitioner | None, shape: Sequence[int], dtype: torch.dtype) -> int:
    """How many shards along axis 0 a variable of ``shape`` gets from ``partitioner``
    (None: one). The result is capped by the rows, as TensorFlow caps it, and is at least 1.

    Reads TensorFlow's result (``[shards, 1, ...]``) or one number of shards. Raises
    TypeError for a result of another type, ValueError for a list partitioning another
    axis than the first, an empty list, or a count below 1.
    """
    if partitioner is None:
        return 1
    result = partitioner(shape, dtype)
    rows = int(shape[0]) if len(shape) else 1
    return max(1, min(_first_axis_partitions(result, partitioner, tuple(shape)), rows))


def _first_axis_partitions(result: object, partitioner: object, shape: tuple[int, ...]) -> int:
    where = f"variable_partitioner {partitioner!r} returned {result!r} for shape {shape}"
    counts = _counts(result)
    if counts is None:
        raise TypeError(
            f"{where}: return a list with the partitions of every axis, e.g. [2, 1] "
            "(TensorFlow's form), or one int, the shards along the first axis"
        )
    if not counts or counts[0] < 1 or any(count != 1 for count in counts[1:]):
        raise ValueError(
            f"{where}: only the first axis is partitioned; return [shards, 1, ...] with shards >= 1 "
            "and 1 for every other axis"
        )
    return counts[0]


def _counts(result: object) -> list[int] | None:
    """The partition counts of a partitioner's result; None when it is no int nor list of ints."""
    if _is_count(result):
        return [result]
    if isinstance(result, (list, tuple)):
        counts = [count for count in result if _is_count(count)]
        return counts if len(counts) == len(result) else None
    return None


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a variable along axis 0."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def split_rows(num_rows: int, num_shards: int) -> list[RowRange]:
    """Contiguous row ranges, one per shard, covering ``[0, num_rows)``.

    The first ``num_rows % num_shards`` shards get one extra row (TF's
    convention), so shard sizes differ by at most one. Raises ValueError if
    ``num_shards`` exceeds the rows (other than one shard for zero rows).
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    _require_positive("num_shards", num_shards, "use a partitioner to choose it")
    if num_shards > max(num_rows, 1):
        raise ValueError(f"num_shards={num_shards} exceeds num_rows={num_rows}; use at most {max(num_rows, 1)} shards")
    base, extra = divmod(num_rows, num_shards)
    ranges: list[RowRange] = []
    start = 0
    for index in range(num_shards):
        stop = start + base + (1 if index < extra else 0)
        ranges.append(RowRange(start, stop))
        start = stop
    return ranges


def place_shards(num_shards: int, num_servers: int, first_server: int) -> list[int]:
    """The server index of each shard: round-robin from ``first_server % num_servers``.

    Callers rotate ``first_server`` per variable so that the first shards of
    many small variables do not all land on server 0.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 0:
        raise ValueError(f"num_shards must be a non-negative int, got {num_shards!r}")
    _require_positive("num_servers", num_servers, "start at least one parameter server")
    if isinstance(first_server, bool) or not isinstance(first_server, int):
        raise ValueError(f"first_server must be an int, got {first_server!r}")
    first = first_server % num_servers
    return [(first + index) % num_servers for index in range(num_shards)]
