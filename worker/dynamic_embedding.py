"""``DynamicEmbedding``: an embedding table keyed by any int64 id, grown and shrunk by the
parameter servers (psserver/store/dynamic_table.py), as the user's torch code sees it.

Unlike ShardedEmbedding it has no number of rows: an id's row is made on the servers when the
id has been looked up ``admit_after`` times, and evicted when it was not updated within its
time to live, or to keep a server under its cap. A lookup of an id without a row reads the
table's default row (zeros, or one shared row) and its gradient is dropped by the servers.
Lookups and pushes travel as any table's (one exchange per server; gradients summed per id).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig
from paramserve.worker.layers import VariableAccess, active_registry, current_access

__all__ = ["DynamicEmbedding"]


class DynamicEmbedding(nn.Module):
    """An embedding table of rows of ``embedding_dim`` keyed by any int64 id, living on the
    parameter servers, partitioned across them by ``splitmix64(id) % servers``.

    Create it inside ``ParameterServerStrategy.scope()``; the strategy's optimizer (e.g.
    ``strategy.optimizer(torch.optim.Adagrad, lr=0.05)``: SGD, Adam, Adagrad... with torch.optim's
    per-row semantics, as SparseAdam and sparse Adagrad) updates only the rows a step touched.

    Args:
        embedding_dim: the rows' dimension.
        name: the table's name on the servers (default: its place in the model).
        initializer: "normal" (mean 0, std ``init_std``), "uniform" (±``init_std``), "zeros":
            a row's initial value depends on its id and ``seed`` only, so an evicted row comes
            back as it first was.
        admit_after: an id gets its own row at its N-th lookup; before, it reads ``default_row``
            ("zeros", or "shared": one row of the initializer, never trained) and no gradient
            is kept for it. Sightings are counted in a fixed-size sketch per server
            (``admission_width`` counters; an estimate may be high, never low).
        ttl_steps / ttl_seconds: rows not updated within this many of the table's steps (pushes
            applied to its shard on that server) or seconds are evicted by a sweep every tenth
            of the TTL; an evicted id starts again as unseen.
        max_rows / max_bytes: per server; admitting past the cap first evicts the least recently
            used rows (at least 1/32 of the cap at a time).

    ``forward(ids)`` takes integer ids of any shape (DtypeMismatchError for floats) and returns
    ``ids.shape + (embedding_dim,)``.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        name: str | None = None,
        dtype: torch.dtype = torch.float32,
        initializer: str = "normal",
        init_std: float = 1.0,
        seed: int = 0,
        admit_after: int = 1,
        default_row: str = "zeros",
        ttl_steps: int | None = None,
        ttl_seconds: float | None = None,
        max_rows: int | None = None,
        max_bytes: int | None = None,
        admission_width: int | None = None,
    ):
        super().__init__()
        if name is not None and (not isinstance(name, str) or not name.strip() or name != name.strip()):
            raise ValueError(
                f"DynamicEmbedding name must be a non-empty string without surrounding spaces, got {name!r}"
            )
        low = -init_std if initializer == "uniform" else 0.0
        self.config = DynamicTableConfig(
            dim=embedding_dim,
            dtype=dtype,
            initializer=initializer,
            init_a=low,
            init_b=init_std,
            seed=seed,
            admit_after=admit_after,
            default_row=default_row,
            ttl_steps=ttl_steps,
            ttl_seconds=ttl_seconds,
            max_rows=max_rows,
            max_bytes=max_bytes,
            admission_width=admission_width,
        )
        try:
            self.config.validate()
        except Exception as err:
            raise ValueError(f"DynamicEmbedding: {err}") from None
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.requested_name = name
        self.variable = name or ""
        """The table's name on the servers, once a strategy adopted it (its ``home`` is then set)."""
        self.home: VariableAccess | None = None
        """The coordinator's access (set by its strategy); not pickled."""
        registry = active_registry()
        if registry is not None:
            registry.register_table(self)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "home": None}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.variable:
            raise RuntimeError("this DynamicEmbedding was not created inside strategy.scope()")
        return current_access(self.home).lookup_dynamic(self.variable, ids, self.embedding_dim, self.dtype)

    def adopted(self) -> bool:
        """Whether a strategy on this process has made the table its variable."""
        return self.home is not None

    def extra_repr(self) -> str:
        return f"{self.variable!r}, dim={self.embedding_dim}, admit_after={self.config.admit_after}"
