"""Per-worker resources: objects a worker creates once and closures then refer to.

A dataset iterator, say, cannot travel with every closure (it is neither
small nor picklable), so the coordinator sends a *function* that creates it
(``ResourceSpec``), and closures carry a ``PerWorkerResource`` reference in
its place. On the worker the reference unpickles to the object this worker
holds under that id. A worker that restarted holds nothing: the lookup raises
``ResourceMissingError`` and the coordinator resends the specs (TF's
ClusterCoordinator re-creates per-worker resources the same way).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from paramserve.psserver.runtime.devices import CPU


@dataclass(frozen=True)
class InputContext:
    """What an input function needs to build its pipeline's share of the data
    (tf.distribute's InputContext). Strategies pass one to dataset functions."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Raises ValueError when the global batch does not split evenly across replicas."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the {self.num_replicas_in_sync} "
                "replicas in sync: use a multiple of the replica count"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True, kw_only=True)
class WorkerContext(InputContext):
    """The InputContext of a per-worker dataset or resource function, plus which worker
    it runs on (e.g. to shard input by ``worker_index``), that worker's incarnation, and
    the device its closures compute on (``paramserve worker --device``): a per-worker
    dataset's batches are moved there for the closures; a resource function that builds
    tensors for them puts them there itself.

    As an InputContext it is TensorFlow's for parameter-server training: one input pipeline,
    id 0, one replica in sync (``(1, 0, 1)``). Each worker runs its own replica
    asynchronously and consumes whole batches, so ``get_per_replica_batch_size(B)`` is
    ``B`` and no pipeline is told to keep a fraction of the data; shuffle (or shard by
    ``worker_index`` / ``num_workers``) to give workers different examples.
    """

    worker_index: int
    num_workers: int
    incarnation: str
    device: torch.device = torch.device("cpu")

    @classmethod
    def for_worker(
        cls, worker_index: int, num_workers: int, incarnation: str, device: torch.device = CPU
    ) -> WorkerContext:
        """The context of worker ``worker_index`` of ``num_workers`` (input context ``(1, 0, 1)``)."""
        return cls(worker_index=worker_index, num_workers=num_workers, incarnation=incarnation, device=device)


class ResourceMissingError(Exception):
    """The closure refers to resources this worker does not hold (it restarted).

    Not a failure of the closure: the coordinator resends the resources and
    retries. ``resource_ids`` lists every missing one found.
    """

    def __init__(self, *resource_ids: str):
        super().__init__(*resource_ids)
        self.resource_ids = tuple(resource_ids)

    @property
    def resource_id(self) -> str:
        return self.resource_ids[0] if self.resource_ids else ""

    def __str__(self) -> str:
        return f"this worker holds no resource {', '.join(map(repr, self.resource_ids))}; it must be sent again"


@dataclass(frozen=True)
class PerWorkerResource:
    """A reference to a per-worker resource; pickles as its id, never as its value.

    The coordinator hands these to users (``create_per_worker_dataset``) and
    they pass them as closure arguments; each worker substitutes its own object.
    """

    resource_id: str

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return resolve_resource, (self.resource_id,)


class _MissingResource:
    """Stands in for a missing resource while a closure is unpickled, so that every
    missing id is found in one pass; the closure never runs with it."""

    def __init__(self, resource_id: str):
        self.resource_id = resource_id

    def __repr__(self) -> str:
        return f"<missing resource {self.resource_id!r}>"


class _Scope:
    def __init__(self, resources: Mapping[str, object]):
        self.resources = resources
        self.missing: list[str] | None = None


_state = threading.local()


def resolve_resource(resource_id: str) -> object:
    """This worker's object for ``resource_id`` (what a PerWorkerResource unpickles to).

    Raises ResourceMissingError when the worker does not hold it, and
    RuntimeError outside a worker closure (there is no worker to ask).
    """
    scope: _Scope | None = getattr(_state, "scope", None)
    if scope is None:
        raise RuntimeError(
            f"per-worker resource {resource_id!r} was unpickled outside a worker closure; "
            "pass it to ClusterCoordinator.schedule() instead of using it directly"
        )
    if resource_id in scope.resources:
        return scope.resources[resource_id]
    if scope.missing is not None:
        scope.missing.append(resource_id)
        return _MissingResource(resource_id)
    raise ResourceMissingError(resource_id)


@contextlib.contextmanager
def using_resources(resources: Mapping[str, object]) -> Iterator[None]:
    """Makes ``resources`` the ones ``resolve_resource`` sees in this thread."""
    previous = getattr(_state, "scope", None)
    _state.scope = _Scope(resources)
    try:
        yield
    finally:
        _state.scope = previous


@contextlib.contextmanager
def using_worker_context(context: WorkerContext) -> Iterator[None]:
    """Makes ``context`` the one ``current_worker_context`` returns in this thread while a
    closure, or the resource functions it needs, run on this worker."""
    previous = getattr(_state, "worker", None)
    _state.worker = context
    try:
        yield
    finally:
        _state.worker = previous


def current_worker_context() -> WorkerContext | None:
    """The WorkerContext of the closure running in this thread; None outside one (the coordinator)."""
    context: WorkerContext | None = getattr(_state, "worker", None)
    return context


def experimental_get_current_worker_index() -> int:
    """The index of the worker that runs the current closure (TF's
    ``tf.distribute.experimental.coordinator.experimental_get_current_worker_index``): call it
    inside a function ``ClusterCoordinator.schedule`` runs, or a dataset function
    ``create_per_worker_dataset`` runs, e.g. to shard input by worker.

    Raises RuntimeError anywhere else: the coordinator is no worker.
    """
    context = current_worker_context()
    if context is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() was called outside a closure running on a worker: call it "
            "inside a function passed to ClusterCoordinator.schedule() or create_per_worker_dataset()"
        )
    return context.worker_index


def select_for_worker(values: tuple[Any, ...]) -> Any:
    """This worker's value of one-value-per-worker ``values`` (what a PerWorkerValues sent with a
    closure unpickles to on a worker): ``values[worker_index]``.

    Raises RuntimeError outside a worker closure, IndexError when there are fewer values than
    the worker's index needs.
    """
    index = experimental_get_current_worker_index()
    if index >= len(values):
        raise IndexError(
            f"worker {index} got a PerWorkerValues of {len(values)} values: give one value per worker "
            "(ClusterCoordinator.num_workers)"
        )
    return values[index]


@contextlib.contextmanager
def collecting_missing() -> Iterator[list[str]]:
    """Inside ``using_resources``: missing ids are collected into the yielded list
    instead of raising at the first, so one reply names all of them."""
    scope: _Scope | None = getattr(_state, "scope", None)
    if scope is None:
        raise RuntimeError("collecting_missing() needs an enclosing using_resources()")
    previous, scope.missing = scope.missing, []
    try:
        yield scope.missing
    finally:
        scope.missing = previous
