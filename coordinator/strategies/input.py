"""Distributed input: global batches split into per-replica batches, on each replica's device.

``DistributedDataset`` wraps anything that yields *batches* (a DataLoader, an
IterableDataset of batches, a list of tensors...). Each global batch, a tensor
or a structure of tensors whose first dimension is the batch, is split along dim 0
with ``torch.tensor_split`` into one part per replica.

A batch that does not divide evenly (usually the last one) follows
``InputOptions.partial_batch``:
- ``"split"`` (default, as TF): uneven parts; each replica in turn takes up to
  ``ceil(size / replicas)`` examples, so the last replicas get fewer or none (5 over 4
  replicas: 2, 2, 1, 0; ``replica_bounds``). Pass the real ``global_batch_size`` to
  ``compute_average_loss`` for such batches, or the replicas' default
  (per-replica size x replicas) mis-scales the loss.
- ``"drop"``: the batch is skipped (like ``DataLoader(drop_last=True)``).
- ``"error"``: ValueError naming the batch.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserve.coordinator import nest
from paramserve.coordinator.strategies.distributed_values import regroup
from paramserve.worker.resources import InputContext

_PARTIAL_POLICIES = ("split", "drop", "error")


@dataclass(frozen=True)
class InputOptions:
    """How distributed input treats short batches and device placement.

    Args:
        partial_batch: "split" (uneven parts, some possibly empty), "drop", or "error".
        move_to_device: copy each replica's part to its device (prefetch) while iterating.
    """

    partial_batch: str = "split"
    move_to_device: bool = True

    def __post_init__(self) -> None:
        if self.partial_batch not in _PARTIAL_POLICIES:
            raise ValueError(f"partial_batch must be one of {_PARTIAL_POLICIES}, got {self.partial_batch!r}")


class DistributedDataset:
    """Iterates a dataset of global batches as per-replica batches (nests of PerReplica).

    Args:
        dataset: an iterable of batches (DataLoader, IterableDataset, list...). A map-style
            Dataset of single examples is refused: batch it with a DataLoader first.
        devices: one device per replica of this process.
        num_input_pipelines, input_pipeline_id: with several pipelines (workers), this one
            takes every ``num_input_pipelines``-th batch starting at ``input_pipeline_id``.
        options: InputOptions (short batches, device placement).
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        devices: Sequence[torch.device],
        *,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        options: InputOptions | None = None,
    ):
        _check_batched(dataset)
        if not devices:
            raise ValueError("DistributedDataset needs at least one replica device")
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {input_pipeline_id} is outside 0..{num_input_pipelines - 1}: "
                "pass the id of this worker's pipeline"
            )
        self.dataset = dataset
        self.devices = tuple(devices)
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.options = options or InputOptions()

    def __iter__(self) -> Iterator[Any]:
        shard = itertools.islice(iter(self.dataset), self.input_pipeline_id, None, self.num_input_pipelines)
        for index, batch in enumerate(shard):
            parts = split_batch(batch, len(self.devices), self.options.partial_batch, index)
            if parts is None:
                continue
            if self.options.move_to_device:
                parts = [nest.to_device(p, d) for p, d in zip(parts, self.devices)]
            yield regroup(parts)

    def __len__(self) -> int:
        """Batches this pipeline yields (counted before dropping any short batch)."""
        total = len(self.dataset)  # type: ignore[arg-type]  # TypeError for unsized datasets, as len() should
        return len(range(self.input_pipeline_id, total, self.num_input_pipelines))


class DistributedDatasetsFromFunction:
    """Per-replica batches from ``dataset_fn(input_context)``, called once per local pipeline.

    Each pipeline's dataset yields *per-replica* batches; consecutive elements go to that
    pipeline's replicas in turn (as TF). When a pipeline runs out in the middle of a
    step, the replicas left without an element get an empty (0-row) batch shaped like
    the last element ("split"), the step is dropped ("drop"), or ValueError ("error").
    """

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        input_contexts: Sequence[InputContext],
        devices: Sequence[torch.device],
        options: InputOptions | None = None,
    ):
        if not input_contexts or len(devices) % len(input_contexts):
            raise ValueError(
                f"{len(devices)} replicas cannot be shared evenly by {len(input_contexts)} input pipelines: "
                "give each pipeline the same number of replicas"
            )
        self.devices = tuple(devices)
        self.options = options or InputOptions()
        self.datasets = [dataset_fn(context) for context in input_contexts]

    def __iter__(self) -> Iterator[Any]:
        per_pipeline = len(self.devices) // len(self.datasets)
        iterators = [iter(d) for d in self.datasets]
        for step in itertools.count():
            parts: list[Any] = []
            for it in iterators:
                parts.extend(itertools.islice(it, per_pipeline))
            if not parts:
                return
            if len(parts) < len(self.devices):
                padded = self._short_step(parts, step)
                if padded is None:
                    return
                parts = padded
            if self.options.move_to_device:
                parts = [nest.to_device(p, d) for p, d in zip(parts, self.devices)]
            yield regroup(parts)

    def _short_step(self, parts: list[Any], step: int) -> list[Any] | None:
        if self.options.partial_batch == "drop":
            return None
        if self.options.partial_batch == "error":
            raise ValueError(
                f"step {step} has {len(parts)} per-replica batches for {len(self.devices)} replicas: make "
                "every pipeline yield a multiple of its replica count, or use InputOptions(partial_batch='split')"
            )
        empty = nest.map_structure(lambda x: x[:0] if isinstance(x, torch.Tensor) else x, parts[-1])
        return parts + [empty] * (len(self.devices) - len(parts))


def replica_bounds(size: int, num_replicas: int) -> list[int]:
    """Where a batch of ``size`` is cut between replicas, as TensorFlow cuts it: each replica takes
    up to ``ceil(size / num_replicas)`` examples in turn, so a short last batch leaves the last
    replicas short or empty (5 over 4 replicas: 2, 2, 1, 0), never spreads the shortfall."""
    share = -(-size // num_replicas)
    return [min(share * replica, size) for replica in range(1, num_replicas)]


def split_batch(batch: Any, num_replicas: int, partial_batch: str = "split", index: int = 0) -> list[Any] | None:
    """One structure per replica from a global batch; None when the batch is to be dropped.

    Raises:
        ValueError: tensors of the batch disagree on the batch size, or the batch does not
            divide and ``partial_batch`` is "error".
    """
    sizes = {leaf.shape[0] for leaf in nest.flatten(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(
            f"batch {index} mixes batch sizes {sorted(sizes)}: every tensor's first dimension must be the batch"
        )
    size = sizes.pop() if sizes else 0
    if size % num_replicas:
        if partial_batch == "drop":
            return None
        if partial_batch == "error":
            raise ValueError(
                f"batch {index} has {size} examples, which do not split evenly across {num_replicas} replicas: "
                "use DataLoader(drop_last=True), a global batch size that is a multiple of the replica count, "
                "or InputOptions(partial_batch='split')"
            )

    bounds = replica_bounds(size, num_replicas)

    def part(leaf: Any, replica: int) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return torch.tensor_split(leaf, bounds, dim=0)[replica]
        return leaf

    return [nest.map_structure(functools.partial(part, replica=r), batch) for r in range(num_replicas)]


def _check_batched(dataset: Any) -> None:
    if not hasattr(dataset, "__iter__"):
        raise TypeError(
            f"{type(dataset).__name__} is not iterable over batches (a map-style Dataset yields single "
            "examples): wrap it as DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE) first"
        )
