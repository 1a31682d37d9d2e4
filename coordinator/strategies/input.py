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

``InputOptions`` also carries TensorFlow's fields: ``experimental_fetch_to_device`` (False
leaves the batches on the CPU), ``experimental_replication_mode`` (``InputReplicationMode``:
PER_REPLICA calls a dataset function once per replica), ``experimental_place_dataset_on_device``
(the dataset function and its iteration run with the replica's device as torch's default
device) and ``experimental_per_replica_buffer_size`` (elements copied to a GPU ahead of the
step). Iterating a distributed dataset gives a ``DistributedIterator`` (``iterators``), with
``get_next()``, ``get_next_as_optional()`` and ``element_spec``. A ``DatasetCreator`` wraps a
dataset function for ``fit`` and ``ClusterCoordinator.create_per_worker_dataset``.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserve.coordinator import nest
from paramserve.coordinator.strategies.distributed_values import regroup
from paramserve.coordinator.strategies.iterators import DistributedIterator
from paramserve.worker.resources import InputContext

_PARTIAL_POLICIES = ("split", "drop", "error")


class InputReplicationMode(enum.Enum):
    """Whom a dataset function feeds (TF's ``tf.distribute.InputReplicationMode``): every
    replica of a worker (PER_WORKER, called once per worker) or one replica (PER_REPLICA,
    called once per replica)."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """How distributed input treats short batches and device placement (TF's ``tf.distribute.InputOptions``).

    Args:
        partial_batch: "split" (uneven parts, some possibly empty), "drop", or "error".
        move_to_device: paramserve's name of ``experimental_fetch_to_device``; give one of them.
        experimental_fetch_to_device: copy each replica's part to its device while iterating
            (default True); False leaves the batches where the dataset made them (the CPU).
        experimental_replication_mode: an ``InputReplicationMode`` (or its name); PER_REPLICA
            calls ``distribute_datasets_from_function``'s function once per replica, each with
            its own InputContext; ``experimental_distribute_dataset`` refuses it.
        experimental_place_dataset_on_device: the dataset function and its iteration run with
            the replica's device as torch's default device, so the tensors it makes are born
            there; only with PER_REPLICA and ``experimental_fetch_to_device=False``.
        experimental_per_replica_buffer_size: elements copied to the replicas' GPUs ahead of the
            one in use (0: none); on CPU replicas nothing is read ahead.

    Raises ValueError for an unknown ``partial_batch`` or replication mode, a negative buffer
    size, ``move_to_device`` contradicting ``experimental_fetch_to_device``, and the
    combinations TensorFlow refuses: ``experimental_place_dataset_on_device`` without
    PER_REPLICA, or with ``experimental_fetch_to_device``.
    """

    partial_batch: str = "split"
    move_to_device: bool | None = None
    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        if self.partial_batch not in _PARTIAL_POLICIES:
            raise ValueError(f"partial_batch must be one of {_PARTIAL_POLICIES}, got {self.partial_batch!r}")
        fetch = _fetch_to_device(self.move_to_device, self.experimental_fetch_to_device)
        object.__setattr__(self, "move_to_device", fetch)
        object.__setattr__(self, "experimental_fetch_to_device", fetch)
        object.__setattr__(self, "experimental_replication_mode", _replication_mode(self.experimental_replication_mode))
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"experimental_per_replica_buffer_size must be an int >= 0 (0: no prefetch), got {size!r}")
        _check_placement(self)

    @property
    def per_replica(self) -> bool:
        """Whether a dataset function is called once per replica (PER_REPLICA)."""
        return self.experimental_replication_mode is InputReplicationMode.PER_REPLICA


def _fetch_to_device(move: bool | None, fetch: bool | None) -> bool:
    if move is not None and fetch is not None and bool(move) != bool(fetch):
        raise ValueError(
            f"move_to_device={move!r} and experimental_fetch_to_device={fetch!r} disagree: they are one "
            "setting (paramserve's and TensorFlow's name); give one of them"
        )
    chosen = fetch if fetch is not None else move
    return True if chosen is None else bool(chosen)


def _replication_mode(mode: Any) -> InputReplicationMode:
    try:
        return mode if isinstance(mode, InputReplicationMode) else InputReplicationMode(str(mode).upper())
    except ValueError:
        raise ValueError(
            f"experimental_replication_mode must be InputReplicationMode.PER_WORKER or PER_REPLICA, got {mode!r}"
        ) from None


def _check_placement(options: InputOptions) -> None:
    if options.experimental_place_dataset_on_device and not options.per_replica:
        raise ValueError(
            "experimental_place_dataset_on_device=True needs experimental_replication_mode="
            "InputReplicationMode.PER_REPLICA: a dataset placed on a device feeds that device's replica only"
        )
    if options.experimental_place_dataset_on_device and options.experimental_fetch_to_device:
        raise ValueError(
            "experimental_place_dataset_on_device=True cannot be combined with experimental_fetch_to_device=True "
            "under PER_REPLICA (the dataset is on the device already): pass experimental_fetch_to_device=False"
        )


def check_per_worker(options: InputOptions | None, where: str) -> None:
    """Refuses PER_REPLICA where input is read per worker (``where`` names the call), as
    TensorFlow does: NotImplementedError."""
    if options is not None and options.per_replica:
        raise NotImplementedError(
            f"InputReplicationMode.PER_REPLICA is not supported by {where}: it is supported by "
            "distribute_datasets_from_function of MirroredStrategy (and OneDevice, CentralStorage); "
            "use InputReplicationMode.PER_WORKER here"
        )


def pipeline_contexts(
    contexts: Sequence[InputContext], num_local_replicas: int, options: InputOptions
) -> list[InputContext]:
    """The InputContext of each call of a dataset function: ``contexts`` (one per worker
    pipeline) under PER_WORKER; under PER_REPLICA each pipeline's replicas get one of their own,
    numbered across every pipeline (TF's ``(num_replicas, replica, num_replicas_in_sync)``)."""
    if not options.per_replica or not contexts:
        return list(contexts)
    per_pipeline = num_local_replicas // len(contexts)
    return [
        InputContext(
            num_input_pipelines=context.num_input_pipelines * per_pipeline,
            input_pipeline_id=context.input_pipeline_id * per_pipeline + replica,
            num_replicas_in_sync=context.num_replicas_in_sync,
        )
        for context in contexts
        for replica in range(per_pipeline)
    ]


def prefetch_depth(options: InputOptions, devices: Sequence[torch.device]) -> int:
    """How many elements a distributed iterator reads ahead: the per-replica buffer size where
    elements reach a GPU (copied there, or made there), none where every replica is a CPU
    (nothing to overlap there, and reading ahead would only hold batches longer)."""
    on_device = options.experimental_fetch_to_device or options.experimental_place_dataset_on_device
    accelerated = any(torch.device(device).type != "cpu" for device in devices)
    return options.experimental_per_replica_buffer_size if on_device and accelerated else 0


class DistributedDataset:
    """Iterates a dataset of global batches as per-replica batches (nests of PerReplica).

    Args:
        dataset: an iterable of batches (DataLoader, IterableDataset, list...). A map-style
            Dataset of single examples is refused: batch it with a DataLoader first.
        devices: one device per replica of this process.
        num_input_pipelines, input_pipeline_id: with several pipelines (workers), this one
            takes every ``num_input_pipelines``-th batch starting at ``input_pipeline_id``.
        options: InputOptions (short batches, device placement).

    ``iter()`` gives a DistributedIterator. Raises NotImplementedError for PER_REPLICA options
    (a dataset of global batches is split per worker: pass a dataset function to
    ``distribute_datasets_from_function`` instead).
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
        check_per_worker(options, "experimental_distribute_dataset")
        self.dataset = dataset
        self.devices = tuple(devices)
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.options = options or InputOptions()

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._elements(), prefetch_depth(self.options, self.devices))

    def _elements(self) -> Iterator[Any]:
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
    """Per-replica batches from ``dataset_fn(input_context)``, called once per local pipeline
    (once per local replica under ``InputReplicationMode.PER_REPLICA``, see ``pipeline_contexts``).

    Each pipeline's dataset yields *per-replica* batches; consecutive elements go to that
    pipeline's replicas in turn (as TF). When a pipeline runs out in the middle of a
    step, the replicas left without an element get an empty (0-row) batch shaped like
    the last element ("split"), the step is dropped ("drop"), or ValueError ("error").
    ``iter()`` gives a DistributedIterator.
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
        contexts = pipeline_contexts(input_contexts, len(self.devices), self.options)
        self._homes = self._pipeline_devices(len(contexts))
        self.datasets = [_on_device(home, dataset_fn, context) for home, context in zip(self._homes, contexts)]

    def _pipeline_devices(self, pipelines: int) -> list[torch.device | None]:
        """Where each pipeline's dataset is made and read: its replica's device with
        ``experimental_place_dataset_on_device`` (one replica per pipeline), else nowhere in particular."""
        if not self.options.experimental_place_dataset_on_device:
            return [None] * pipelines
        return list(self.devices)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._elements(), prefetch_depth(self.options, self.devices))

    def _elements(self) -> Iterator[Any]:
        per_pipeline = len(self.devices) // len(self.datasets)
        iterators = [_read_on(home, iter(d)) for home, d in zip(self._homes, self.datasets)]
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


def _on_device(device: torch.device | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with ``device`` as torch's default device when given."""
    if device is None:
        return fn(*args)
    with torch.device(device):
        return fn(*args)


def _read_on(device: torch.device | None, iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator``'s elements, each read with ``device`` as torch's default device when given
    (a generator's tensors are made while it is read, not when it is created)."""
    if device is None:
        return iterator
    return iter(functools.partial(_on_device, device, next, iterator, _END), _END)


_END = object()


class DatasetCreator:
    """A dataset function with the options to distribute it by (TF's
    ``tf.keras.utils.experimental.DatasetCreator``), for ``fit`` under any strategy and for
    ``ClusterCoordinator.create_per_worker_dataset``: called with an InputContext (a
    WorkerContext on parameter-server workers), it returns ``dataset_fn``'s dataset.

    Args:
        dataset_fn: ``fn(input_context) -> iterable of batches``.
        input_options: the InputOptions in-process strategies distribute it by (None: defaults).

    Raises TypeError for a ``dataset_fn`` that is not callable or ``input_options`` that are
    not InputOptions; calling it raises TypeError when the function returns no iterable.
    """

    def __init__(self, dataset_fn: Callable[..., Iterable[Any]], input_options: InputOptions | None = None):
        if not callable(dataset_fn):
            raise TypeError(f"DatasetCreator's dataset_fn must be callable, got {type(dataset_fn).__name__}")
        if input_options is not None and not isinstance(input_options, InputOptions):
            raise TypeError(
                f"DatasetCreator's input_options must be InputOptions, got {type(input_options).__name__}: "
                "pass InputOptions(...) or None"
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, *args: Any, **kwargs: Any) -> Iterable[Any]:
        dataset = self.dataset_fn(*args, **kwargs)
        if not isinstance(dataset, Iterable):
            raise TypeError(
                f"the dataset_fn of a DatasetCreator returned a {type(dataset).__name__}: return an iterable "
                "of batches (a DataLoader, a generator...)"
            )
        return dataset

    def __repr__(self) -> str:
        return f"DatasetCreator({self.dataset_fn!r})"


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
