"""The digits classifier the demo, the examples, the tests and the benchmarks share: an MLP
over scikit-learn's bundled digits dataset (no download), its train/test split, a worker's
endless shuffled batches and one asynchronous training step.

``paramserve demo`` (coordinator/commands/demo.py) trains it on a local cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserve.worker.resources import WorkerContext

__all__ = ["MLP", "digits_split", "train_step", "worker_batches"]


class MLP(nn.Module):
    """The demo's model: 64 pixels -> hidden -> 10 digits."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.output = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(F.relu(self.hidden(x)))


def digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train/test tensors from scikit-learn's bundled digits (no download)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features.astype(np.float32) / 16.0, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    return (
        torch.from_numpy(x_train),
        torch.from_numpy(y_train).long(),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test).long(),
    )


def worker_batches(
    context: WorkerContext, batch_size: int = 32, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Runs on a worker: endless shuffled batches of this worker's shard of the training set."""
    x_train, y_train, _, _ = digits_split(seed)
    shard = torch.arange(context.worker_index, len(x_train), context.num_workers)
    generator = torch.Generator().manual_seed(seed * 1000 + context.worker_index)
    while True:
        order = shard[torch.randperm(len(shard), generator=generator)]
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield x_train[rows], y_train[rows]


def train_step(batches: Iterator, model: nn.Module, optimizer) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One asynchronous step, run on a worker: pull, forward, backward, push."""
    x, y = next(batches)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()
