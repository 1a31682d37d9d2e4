"""A DLRM-shaped recommendation model and synthetic Criteo-like click data.

The workload parameter servers exist for: a few dense layers over many embedding tables, ids
that follow a power law (a few items are seen constantly, most rarely). One definition serves
the recommendation benchmark, the example and the tests, so that what is measured is what is
tested.

The data is generated, not downloaded: 13 dense features and one id per categorical feature,
each id drawn from a Zipf distribution over its table and scrambled across the table's rows
(hot ids land on every shard, as hashed ids do). A click's probability comes from a hidden
model (a weight per dense feature, an effect per id), so a model can learn it and its AUC
says how well.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from paramserve.worker.layers import ShardedEmbedding

DENSE_FEATURES = 13
"""Criteo's integer features."""
SPARSE_FEATURES = 26
"""Criteo's categorical features: one embedding table each."""
EMBEDDING_DIM = 16
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""The 26 categorical features' cardinalities in Criteo's Kaggle display-advertising data."""
ZIPF_EXPONENT = 1.05
"""How skewed the ids are: close to what click logs show (a handful of ids in most rows)."""
_SCRAMBLE = 1_000_003
"""A prime: ``rank * _SCRAMBLE % rows`` is a permutation of the rows unless ``rows`` is its multiple."""


@dataclass(frozen=True)
class ClickBatch:
    """One batch: ``dense`` [B, 13] float, ``ids`` [B, tables] int64 (a column per table),
    ``clicked`` [B] float (0 or 1)."""

    dense: torch.Tensor
    ids: torch.Tensor
    clicked: torch.Tensor

    def features(self) -> dict[str, torch.Tensor]:
        """The ids by feature name (``c0``, ``c1``, ...): what an embedding collection takes."""
        return {feature_name(i): self.ids[:, i] for i in range(self.ids.shape[1])}


def feature_name(index: int) -> str:
    return f"c{index}"


def zipf_ids(rows: int, count: int, generator: torch.Generator, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """``count`` ids in ``[0, rows)``: ranks drawn from a Zipf law truncated at ``rows`` (by
    inverting its continuous CDF), then scrambled so the hot ids spread over the table."""
    uniform = torch.rand(count, generator=generator, dtype=torch.float64)
    power = 1.0 - exponent
    ranks = torch.floor(((rows**power - 1.0) * uniform + 1.0) ** (1.0 / power)).to(torch.int64) - 1
    ranks.clamp_(0, rows - 1)
    if rows % _SCRAMBLE == 0:
        return ranks
    return ranks * _SCRAMBLE % rows


class ClickData:
    """Synthetic click batches for tables of ``table_rows`` rows; ``seed`` fixes the hidden
    model (shared by every worker), ``stream`` the draws (one per worker, so workers see
    different examples of the same task)."""

    def __init__(self, table_rows: Sequence[int], batch_size: int = 256, seed: int = 0):
        self.table_rows = tuple(int(r) for r in table_rows)
        self.batch_size = batch_size
        hidden = torch.Generator().manual_seed(seed)
        self._dense_weight = torch.randn(DENSE_FEATURES, generator=hidden) / math.sqrt(DENSE_FEATURES)
        self._seed = seed

    def _id_effect(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The hidden effect of an id: a fixed pseudo-random value in [-1, 1) per (table, id),
        computed, not stored, so a 10M-row table costs nothing to describe."""
        mixed = (ids * 2_654_435_761 + (table + 1) * 40_503 + self._seed * 97) % 65_521
        return mixed.to(torch.float32) / 32_760.5 - 1.0

    def batch(self, generator: torch.Generator) -> ClickBatch:
        n = self.batch_size
        dense = torch.randn(n, DENSE_FEATURES, generator=generator)
        ids = torch.stack([zipf_ids(rows, n, generator) for rows in self.table_rows], dim=1)
        logit = dense @ self._dense_weight
        for table in range(len(self.table_rows)):
            logit = logit + self._id_effect(table, ids[:, table]) * (2.0 / math.sqrt(len(self.table_rows)))
        clicked = (torch.rand(n, generator=generator) < torch.sigmoid(logit)).to(torch.float32)
        return ClickBatch(dense, ids, clicked)

    def batches(self, stream: int, count: int) -> list[ClickBatch]:
        """``count`` batches of draw stream ``stream``: the same every time it is asked."""
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + stream + 1)
        return [self.batch(generator) for _ in range(count)]

    def cycle(self, stream: int, count: int) -> Iterator[ClickBatch]:
        """``batches(stream, count)`` over and over: a benchmark's endless input at no cost."""
        fixed = self.batches(stream, count)
        while True:
            yield from fixed


def criteo_rows(cap: int) -> list[int]:
    """Criteo's 26 table sizes, each capped at ``cap`` rows (a model that fits a given machine)."""
    return [min(cap, rows) for rows in CRITEO_KAGGLE_ROWS]


class WorkerClicks:
    """A per-worker dataset function (``ClusterCoordinator.create_per_worker_dataset``): each
    worker cycles through ``count`` fixed batches of its own draw stream (its worker index). A
    class, so it travels to workers by reference with its settings."""

    def __init__(self, table_rows: Sequence[int], batch_size: int = 256, count: int = 200):
        self.table_rows = list(table_rows)
        self.batch_size = batch_size
        self.count = count

    def __call__(self, context: Any) -> Iterator[ClickBatch]:
        return ClickData(self.table_rows, self.batch_size).cycle(context.worker_index, self.count)


def mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


EmbeddingsFactory = Callable[[Mapping[str, int], int], nn.Module]
"""Builds the model's embedding tables from (rows by feature name, dimension): a module whose
forward takes ids by feature name and returns their rows by feature name."""


class LocalEmbeddings(nn.Module):
    """The tables as one process holds them: ``nn.Embedding(sparse=True)`` each, the form a
    torch user trains with a sparse-aware optimizer (Adagrad, SparseAdam, SGD)."""

    def __init__(self, rows: Mapping[str, int], dim: int):
        super().__init__()
        self.tables = nn.ModuleDict({name: nn.Embedding(n, dim, sparse=True) for name, n in rows.items()})

    def forward(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.tables[name](feature) for name, feature in ids.items()}


class PerFeatureEmbeddings(nn.Module):
    """The tables on the servers as a TensorFlow user ports ``tf.keras.layers.Embedding``: one
    ``ShardedEmbedding`` per feature, each called on its own (build it in a strategy's scope).
    Their lookups still travel together: each returns rows read when first used (here by the
    model's ``torch.cat``), all in one exchange per server (worker.deferred_rows)."""

    def __init__(self, rows: Mapping[str, int], dim: int):
        super().__init__()
        self.tables = nn.ModuleDict({name: ShardedEmbedding(n, dim) for name, n in rows.items()})

    def forward(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.tables[name](feature) for name, feature in ids.items()}


class DLRM(nn.Module):
    """Bottom MLP over the dense features, an embedding per categorical feature, their
    concatenation, top MLP to one logit (DLRM with concatenation as its interaction)."""

    def __init__(
        self,
        table_rows: Sequence[int],
        embeddings: EmbeddingsFactory = LocalEmbeddings,
        dim: int = EMBEDDING_DIM,
        bottom: Sequence[int] = (64,),
        top: Sequence[int] = (64,),
    ):
        super().__init__()
        rows = {feature_name(i): int(n) for i, n in enumerate(table_rows)}
        self.bottom = mlp((DENSE_FEATURES, *bottom, dim), last_activation=True)
        self.embeddings = embeddings(rows, dim)
        self.top = mlp(((len(rows) + 1) * dim, *top, 1), last_activation=False)
        self.features = tuple(rows)

    def forward(self, dense: torch.Tensor, ids: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rows = self.embeddings(ids)
        joined = torch.cat([self.bottom(dense), *(rows[name] for name in self.features)], dim=1)
        return self.top(joined).squeeze(1)


def click_loss(model: nn.Module, batch: ClickBatch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch.dense, batch.features()), batch.clicked)


def train_clicks(batches: Iterator[ClickBatch], model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """One training step on the next batch; its loss. A closure a ClusterCoordinator schedules
    as is (``batches``: a per-worker dataset's iterator)."""
    optimizer.zero_grad()
    loss = click_loss(model, next(batches))
    loss.backward()
    optimizer.step()
    return loss.detach()


def auc(scores: torch.Tensor, clicked: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` (logits or probabilities) for ``clicked``
    (torchmetrics' binary AUROC)."""
    return float(binary_auroc(scores.reshape(-1).float(), clicked.reshape(-1).to(torch.int64)))
