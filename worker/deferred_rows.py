"""Lookups that travel together: a ShardedEmbedding's rows are read when they are first used.

A model written with one ``ShardedEmbedding`` per feature (as a TensorFlow user ports
``tf.keras.layers.Embedding``) calls its tables one after the other. If each call waited for its
own exchange, a step would pay one round trip per table, in sequence: eight tables, eight. So a
lookup does not read its rows when it is called. ``ShardedEmbedding.forward`` returns
``PendingRows``, a tensor that knows its shape and dtype and holds no values yet, and notes the
lookup in the thread's open ``LookupBatch``. The first operation that needs the values of any
pending rows (``torch.cat`` of them all, typically) reads every lookup noted so far in one call of
the access's ``lookup``: one exchange per parameter server for every table, as
``ShardedEmbeddingCollection`` does for the tables it holds. The operation then runs on the real
rows, so autograd records their use and their gradients are pushed as before.

What a pending tensor answers without being read: its shape (``shape``, ``size()``, ``dim()``,
``ndim``, ``numel()``, ``len()``) and ``dtype``. Everything else, its ``device`` included, reads
it (and every lookup of its batch) first.

- A batch is closed, and the next lookup opens a new one, when it is read and when the step's
  optimizer pushes (``close_open_batch``): rows looked up and never used are never read, and no
  lookup of one step is read with the next step's.
- A lookup that fails (an id outside its table, a server that refuses) raises from the first
  operation on any tensor of its batch, inside the closure, as the call itself would have.
- Code that bypasses torch's ``__torch_function__`` (a C extension reading the data pointer)
  reaches ``__torch_dispatch__``, which raises and names the fix (``rows.resolve()``).
- Reading is per thread: a worker runs one closure per thread, and each batch keeps the access it
  was noted with, so rows resolve with the access of the closure that looked them up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["FusedRange", "LookupBatch", "PendingRows", "close_open_batch", "pending_rows", "resolved"]

Lookup = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
"""How a batch reads its rows: ``VariableAccess.lookup`` (table: indices -> table: rows)."""


class FusedRange(NamedTuple):
    """Where a table stored as a row range of a shared variable lies in it (its ids are its own)."""

    offset: int
    """Its first row in the variable."""
    rows: int
    name: str
    """The table, as its errors name it (its place in its model)."""


_SHAPE_ONLY: frozenset[Any] = frozenset(
    {
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__len__,
    }
)
"""What a pending tensor answers from its shape and dtype, without being read."""


class LookupBatch:
    """Lookups noted since the batch opened, read together by ``read`` (once)."""

    def __init__(self, lookup: Lookup, owner: object):
        self._lookup = lookup
        self.owner = owner
        """What the batch reads through (the access): a lookup through another opens a new batch."""
        self._pending: list[PendingRows] = []
        self.closed = False

    def note(self, rows: PendingRows) -> None:
        if self.closed:
            raise RuntimeError("this lookup batch was read already: note the lookup in a new one")
        self._pending.append(rows)

    def read(self) -> None:
        """Reads every noted lookup in one ``lookup`` call (the lookups of one table merged into
        one, their indices concatenated) and gives each pending tensor its rows; on failure each
        keeps the error, raised when it is used."""
        self.closed = True
        _forget_open(self)
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_table: dict[str, list[PendingRows]] = {}
        for rows in pending:
            by_table.setdefault(rows.table, []).append(rows)
        try:
            found = self._lookup({table: _variable_rows(group) for table, group in by_table.items()})
            for table, group in by_table.items():
                pieces = found[table].split([r.lookup_ids.numel() for r in group])
                for rows, piece in zip(group, pieces):
                    rows.settle(piece.reshape(*rows.lookup_ids.shape, *piece.shape[1:]), None)
        except BaseException as err:
            for rows in pending:
                if not rows.settled:
                    rows.settle(None, err)
            raise


def _variable_rows(group: list[PendingRows]) -> torch.Tensor:
    """The rows of one variable that ``group``'s lookups read, concatenated: each lookup's ids
    as they are, or, for tables stored as row ranges of one variable (``fused``), checked
    against their own table's size and moved by its offset, for every table at once. Raises
    IndexError naming the first id outside its table and the table."""
    ids = torch.cat([r.lookup_ids.reshape(-1) for r in group])
    if group[0].fused is None:
        return ids
    counts = torch.tensor([r.lookup_ids.numel() for r in group], device=ids.device)
    ranges = [r.fused for r in group if r.fused is not None]
    offsets = torch.tensor([f.offset for f in ranges], device=ids.device).repeat_interleave(counts)
    limits = torch.tensor([f.rows for f in ranges], device=ids.device).repeat_interleave(counts)
    outside = (ids < 0) | (ids >= limits)
    if bool(outside.any()):
        position = int(outside.nonzero()[0, 0])
        table = ranges[int(torch.searchsorted(counts.cumsum(0), position, right=True))]
        raise IndexError(
            f"id {int(ids[position])} is outside the rows [0, {table.rows}) of ShardedEmbedding {table.name!r}"
        )
    return ids.to(torch.int64) + offsets


class PendingRows(torch.Tensor):
    """The rows of one lookup, read with the rest of its batch when first used (module docstring).
    ``resolve()`` returns the real rows."""

    table: str
    lookup_ids: torch.Tensor
    fused: FusedRange | None
    """A fused table's range, its ids its own; None: the ids are the variable's rows."""
    _batch: LookupBatch
    _rows: torch.Tensor | None
    _error: BaseException | None
    settled: bool

    @staticmethod
    def __new__(
        cls,
        batch: LookupBatch,
        table: str,
        indices: torch.Tensor,
        dim: int,
        dtype: torch.dtype,
        fused: FusedRange | None = None,
    ) -> PendingRows:
        wrapper = torch.Tensor._make_wrapper_subclass(cls, (*indices.shape, dim), dtype=dtype, device=indices.device)
        wrapper.table, wrapper.lookup_ids, wrapper.fused, wrapper._batch = table, indices, fused, batch
        wrapper._rows, wrapper._error, wrapper.settled = None, None, False
        return wrapper

    def __init__(self, *args: Any, **kwargs: Any):  # __new__ took them
        super().__init__()

    def settle(self, rows: torch.Tensor | None, error: BaseException | None) -> None:
        """Gives the lookup its rows (or the error reading them raised)."""
        self._rows, self._error, self.settled = rows, error, True

    def resolve(self) -> torch.Tensor:
        """The real rows (reading the batch if it was not read yet)."""
        if not self.settled:
            self._batch.read()
        if self._error is not None:
            raise self._error
        assert self._rows is not None
        return self._rows

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:  # torch's own handling: the wrapper's metadata, nothing read
            return super().__torch_function__(func, types, args, kwargs)
        return func(*resolved(args), **{key: resolved(value) for key, value in kwargs.items()})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        raise RuntimeError(
            f"{func} reached the rows of a ShardedEmbedding lookup before they were read (it bypasses "
            "torch's __torch_function__); call .resolve() on the lookup's result first"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.resolve())


def resolved(value: Any) -> Any:
    """``value`` with every pending tensor in it (in lists and tuples too) replaced by its rows."""
    if isinstance(value, PendingRows):
        return value.resolve()
    if isinstance(value, (list, tuple)):
        return type(value)(resolved(item) for item in value)
    return value


_open = threading.local()


def pending_rows(
    lookup: Lookup,
    owner: object,
    table: str,
    indices: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    fused: FusedRange | None = None,
) -> PendingRows:
    """The rows of ``table`` for ``indices``, noted in this thread's open batch for ``owner`` (a
    new one when there is none, or it reads through another owner) and read with it. ``fused``:
    ``table`` stores this lookup's table as that range of rows, and ``indices`` are the table's own."""
    batch: LookupBatch | None = getattr(_open, "batch", None)
    if batch is None or batch.closed or batch.owner is not owner:
        batch = LookupBatch(lookup, owner)
        _open.batch = batch
    rows = PendingRows(batch, table, indices.detach(), dim, dtype, fused)
    batch.note(rows)
    return rows


def close_open_batch() -> None:
    """Ends this thread's open batch (a step's push): later lookups are read in a new one. Its
    lookups still read, together, when one of them is used."""
    batch: LookupBatch | None = getattr(_open, "batch", None)
    if batch is not None:
        batch.closed = True
        _open.batch = None


def _forget_open(batch: LookupBatch) -> None:
    if getattr(_open, "batch", None) is batch:
        _open.batch = None
