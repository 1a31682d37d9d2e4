"""How a variable is cut into shards along axis 0, and where the shards live.

Every function here is a pure decision: it reads a shape and a dtype and
returns a number or a list, so the coordinator, the servers and the tests all
agree on the layout without talking to each other. The partitioners follow
tf.distribute.experimental.partitioners (same arguments, same results), with
``torch.dtype`` in place of ``tf.DType``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "RowRange",
    "split_rows",
    "place_shards",
]


class Partitioner(Protocol):
    """Decides how many shards a variable of ``shape`` and ``dtype`` gets along axis 0."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int: ...


def _require_positive(name: str, value: int, fix: str) -> None:
    # bool is an int subclass; True shards is a caller bug, not 1 shard.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; {fix}")


def _num_rows(shape: Sequence[int]) -> int:
    """Rows along axis 0; a 0-d variable counts as one unsplittable row."""
    return int(shape[0]) if len(shape) else 1


def _total_bytes(shape: Sequence[int], dtype: torch.dtype, bytes_per_string: int) -> int:
    # torch has no string dtype; bytes_per_string is kept for TF parity and
    # only applies if a future dtype reports no item size.
    itemsize = dtype.itemsize or bytes_per_string
    return math.prod(int(dim) for dim in shape) * itemsize


class FixedShardsPartitioner:
    """``num_shards`` shards, but never more shards than rows (and at least one)."""

    def __init__(self, num_shards: int):
        _require_positive("num_shards", num_shards, "pass the number of shards, e.g. num_shards=2")
        self.num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return max(1, min(self.num_shards, _num_rows(shape)))

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

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        total = _total_bytes(shape, dtype, self.bytes_per_string)
        wanted = -(-total // self.min_shard_bytes)  # ceil without floats
        return max(1, min(self.max_shards, _num_rows(shape), wanted))

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

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = _num_rows(shape)
        if rows == 0:
            return 1
        bytes_per_row = _total_bytes(shape, dtype, self.bytes_per_string) // rows
        rows_per_shard = max(1, self.max_shard_bytes // bytes_per_row) if bytes_per_row else rows
        shards = -(-rows // rows_per_shard)
        if self.max_shards is not None:
            shards = min(self.max_shards, shards)
        return max(1, shards)

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"


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
