"""The worker's core: runs closures sent by the coordinator. Imports no grpc itself.

One closure runs at a time (a worker is one device). A closure's distributed
parameters are worker-wide ``nn.Parameter`` objects on the worker's device, filled
from the parameter servers before each step and lazily after each ``optimizer.step()``;
its gradients are pushed with idempotency keys derived from the closure id,
so a retried closure never updates a variable twice. How values cross between the
client's host tensors and a GPU is ``worker.transfers``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import threading
import time
import traceback
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import cloudpickle
import torch
from torch import nn

from paramserve.psserver.devices import CPU, computing_on
from paramserve.psserver.errors import (
    DeadlineExceededError,
    DtypeMismatchError,
    InvalidRequestError,
    ServerUnavailableError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from paramserve.psserver.tensors import DTYPE_NAMES, as_byte_view, dtype_from_name, tensor_from_buffer
from paramserve.psserver.types import (
    ClusterContext,
    PendingExchange,
    PullResult,
    PushSummary,
    RowGradient,
    ShardRef,
    VariableLayout,
)
from paramserve.worker.pipeline import PushPipeline
from paramserve.worker.resources import (
    ResourceMissingError,
    WorkerContext,
    collecting_missing,
    using_resources,
)
from paramserve.worker.transfers import HostTransfers, Transfers, transfers_for
from paramserve.worker.variables import (
    loads_closure,
    mark_variable,
    using_access,
    variable_name,
)

log = logging.getLogger(__name__)

_MAX_PS_CLIENTS = 4
"""Clients kept for distinct parameter-server address lists (a cluster whose servers
moved gets a new list; the oldest client is closed)."""


# ---------------------------------------------------------------- requests and outcomes


@dataclass(frozen=True)
class ResourceSpec:
    resource_id: str
    payload: bytes
    """cloudpickle of ``fn(ctx: WorkerContext) -> object``."""


@dataclass(frozen=True)
class ClosureRequest:
    closure_id: str
    payload: bytes
    """cloudpickle (variables.dumps_closure) of (function, args, kwargs)."""
    attempt: int = 0
    function_name: str = ""
    resources: tuple[ResourceSpec, ...] = ()
    cluster: ClusterContext | None = None
    """Where the variables live; None: not sent, the worker uses the one it holds under
    ``cluster_fingerprint`` (the coordinator sends a context once per worker and change)."""
    steps: int = 1
    """0 means 1."""
    worker_index: int = 0
    num_workers: int = 1
    cluster_fingerprint: str = ""
    max_value_age: float = 0.0
    """The first step may start from the values this worker's last push returned if they are at
    most this many seconds old (within a closure, each step starts from the previous step's)."""
    overlap_pushes: bool = False
    """A step's push stays in flight while the next step of this batch computes (worker.pipeline)."""


@dataclass(frozen=True)
class ClosureFailure:
    type: str = ""
    message: str = ""
    traceback: str = ""
    pickled: bytes = b""
    missing_resources: tuple[str, ...] = ()
    """Not a failure of the closure: resend these resources and retry."""
    parameter_server: str = ""
    """Set when a parameter server, not the user's code, failed: it is unreachable, or it lacks a
    variable the cluster context places on it (it restarted and lost its state)."""
    needs_cluster: bool = False
    """Not a failure of the closure: the worker does not hold the cluster context the request
    names (it restarted); resend the request with it."""


@dataclass(frozen=True)
class ClosureOutcome:
    """Exactly one of ``result`` (cloudpickle of the last return value) and ``error`` is set."""

    result: bytes | None
    error: ClosureFailure | None
    worker_incarnation: str
    resources_held: tuple[str, ...]
    pushes_applied: int
    pushes_duplicate: int
    seconds: float


@dataclass(frozen=True)
class WorkerInfo:
    incarnation: str
    pid: int
    resources_held: tuple[str, ...]
    closures_run: int
    """RunClosure requests handled, whatever their outcome."""


class VariableClient(Protocol):
    """What the worker needs of the parameter servers (ParameterServerClient; tests use a fake)."""

    def adopt_layouts(self, layouts: Mapping[str, VariableLayout]) -> None:
        """Uses these layouts (sent by the coordinator) instead of discovering them."""

    def pull(self, names: Sequence[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None) -> PullResult:
        """Whole variables, with the version each shard was read at; read into ``out``'s host
        tensors where it names the variable (a GPU worker's pinned buffers)."""

    def pull_rows(self, name: str, indices: torch.Tensor) -> PullResult:
        """Rows of a variable: shape ``indices.shape + variable.shape[1:]``."""

    def push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[PushSummary, PullResult]:
        """Applies gradients (host tensors) on the servers (at most once per shard for ``key``),
        then reads ``names`` as the servers hold them once the push is applied (into ``out``)."""

    def start_push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> PendingExchange:
        """``push_and_pull`` sent now, its replies read by the result's ``result()``."""

    def close(self) -> None: ...


ClientFactory = Callable[[tuple[str, ...]], VariableClient]
"""Makes the client of the parameter servers at these addresses."""


class ClosureObserver(Protocol):
    """Told about every closure run (the server's metrics implement it)."""

    def on_closure(self, request: ClosureRequest, outcome: ClosureOutcome) -> None: ...


# ---------------------------------------------------------------- local parameters


class LocalVariables:
    """The worker-wide local copies of distributed variables, on the worker's device, and how
    fresh they are.

    Worker-wide (not per closure) so that modules kept in per-worker resources,
    and closures scheduled again and again, reuse one parameter per variable.
    """

    def __init__(self, transfers: Transfers | None = None) -> None:
        self.transfers = transfers or HostTransfers()
        self.parameters: dict[str, nn.Parameter] = {}
        self.versions: dict[ShardRef, int] = {}
        self._fresh: set[str] = set()
        self._returned: set[str] = set()
        """Variables whose values the current step's pushes returned (read right after those
        pushes were applied): the next step may start from them instead of pulling."""
        self._returned_at = float("-inf")

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        existing = self.parameters.get(name)
        if existing is not None and tuple(existing.shape) == tuple(shape) and existing.dtype == dtype:
            return existing
        # New, or the variable was re-created with another shape or dtype.
        trainable = dtype.is_floating_point or dtype.is_complex
        parameter = nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device), requires_grad=trainable)
        mark_variable(parameter, name)
        self.parameters[name] = parameter
        self._fresh.discard(name)
        return parameter

    @property
    def device(self) -> torch.device:
        return self.transfers.device

    def pull_destinations(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """Where the client should pull ``names`` (see Transfers.pull_destinations)."""
        return self.transfers.pull_destinations({n: self.parameters[n] for n in names if n in self.parameters})

    def stale(self, names: Sequence[str]) -> list[str]:
        return [n for n in dict.fromkeys(names) if n not in self._fresh]

    def mark_stale(self, names: Sequence[str] | None = None) -> None:
        if names is None:
            self._fresh.clear()
        else:
            self._fresh.difference_update(names)

    def begin_step(self, keep_returned: bool) -> None:
        """A step starts: what the previous step's pushes returned stays fresh when
        ``keep_returned`` (they were read as the previous step ended); all else is stale."""
        self._fresh = self._returned if keep_returned else set()
        self._returned = set()

    def forget_returned(self) -> None:
        """Values read back by pushes are not to be reused (the variables were rewritten)."""
        self._returned = set()
        self._returned_at = float("-inf")

    def returned_within(self, seconds: float, now: float) -> bool:
        """Whether the last push returned values at most ``seconds`` ago."""
        return seconds > 0 and now - self._returned_at <= seconds

    def fill(self, pulled: PullResult, extra: Sequence[nn.Parameter] = (), *, returned_at: float | None = None) -> None:
        """Copies pulled values into the parameters in place (and into ``extra`` of the same names).
        ``returned_at``: the values came back from a push, at that (monotonic) time."""
        targets: dict[str, list[nn.Parameter]] = defaultdict(list)
        for parameter in [*self.parameters.values(), *extra]:
            name = variable_name(parameter)
            if name in pulled.tensors and all(parameter is not t for t in targets[name]):
                targets[name].append(parameter)
        copies = []
        for name, value in pulled.tensors.items():
            for parameter in targets[name]:
                _check_matches(name, parameter, value)
                copies.append((parameter, value))
        self.transfers.fill(copies)
        self.versions.update(pulled.versions)
        self._fresh.update(pulled.tensors)
        if returned_at is not None:
            self._returned.update(pulled.tensors)
            self._returned_at = returned_at

    def clear_grads(self) -> None:
        for parameter in self.parameters.values():
            parameter.grad = None

    def base_versions(self, names: Sequence[str]) -> dict[ShardRef, int]:
        wanted = set(names)
        return {ref: v for ref, v in self.versions.items() if ref.variable in wanted}


def _check_matches(name: str, parameter: torch.Tensor, value: torch.Tensor) -> None:
    if tuple(parameter.shape) != tuple(value.shape):
        raise ShapeMismatchError(
            f"the closure was built for shape {tuple(parameter.shape)}, the servers hold {tuple(value.shape)}",
            variable=name,
        )
    if parameter.dtype != value.dtype:
        raise DtypeMismatchError(
            f"the closure was built for {parameter.dtype}, the servers hold {value.dtype}", variable=name
        )


# ---------------------------------------------------------------- one closure's access


@dataclass
class _RowLookup:
    indices: torch.Tensor  # flat, global rows
    leaf: torch.Tensor  # shape: the lookup's indices.shape + row_shape
    row_shape: tuple[int, ...]

    def row_gradient(self) -> torch.Tensor:
        return self.leaf.grad.reshape(self.indices.numel(), *self.row_shape)  # type: ignore[union-attr]


class ClosureAccess:
    """The VariableAccess of one closure execution: pulls, lookups and keyed pushes.

    Push keys are ``f"{closure_id}/{n}"`` for the n-th push of this execution,
    so a retried closure sends the same keys and the servers apply each once.
    """

    def __init__(
        self,
        variables: LocalVariables,
        client: VariableClient | None,
        closure_id: str,
        pipeline: PushPipeline | None = None,
    ):
        self._variables = variables
        self._client = client
        self._closure_id = closure_id
        self._pipeline = pipeline
        """Where this closure's pushes stay in flight (overlap_pushes); None: each push waits."""
        self._used: dict[str, nn.Parameter] = {}
        self._placed: set[int] = set()
        self._lookups: dict[str, list[_RowLookup]] = defaultdict(list)
        self._row_versions: dict[ShardRef, int] = {}
        self._push_seq = 0
        self.pushes_applied = 0
        self.pushes_duplicate = 0

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        parameter = self._variables.parameter(name, tuple(shape), dtype)
        self._used[name] = parameter
        return parameter

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        named = [p for p in parameters if variable_name(p) is not None]
        stale = self._variables.stale([str(variable_name(p)) for p in named])
        if stale:
            client = self._require_client()
            self._settle()  # a pull reads what the push in flight applies
            self._variables.fill(client.pull(stale, out=self._variables.pull_destinations(stale)), named)

    def place(self, module: nn.Module) -> None:
        """Moves ``module``'s other tensors (buffers, parameters that are not variables: they
        arrived in the closure as the coordinator held them) to the worker's device, once per
        module and closure; a no-op on a CPU worker."""
        device = self._variables.device
        if device.type == "cpu" or id(module) in self._placed:
            return
        module.to(device)
        self._placed.add(id(module))

    def refresh_used(self) -> None:
        """Makes every parameter this closure resolved current (one pull), so code that
        reads parameters directly, without a module's refresh hook, sees fresh values."""
        self.refresh(list(self._used.values()))

    def lookup_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """The rows ``indices`` (on any device) name, on the worker's device."""
        indices = indices.detach().to("cpu")  # the client and the pushed row gradients need host indices
        client = self._require_client()
        self._settle()
        pulled = client.pull_rows(name, indices)
        for ref, version in pulled.versions.items():
            self._row_versions.setdefault(ref, version)  # the oldest read is the gradient's base
        leaf = self._variables.transfers.to_device(pulled.tensors[name])
        if leaf.dtype.is_floating_point:
            leaf.requires_grad_(True)
            flat = indices.reshape(-1).to(torch.int64)
            self._lookups[name].append(_RowLookup(flat, leaf, tuple(leaf.shape[indices.dim() :])))
        return leaf

    def apply_gradients(self, names: Sequence[str]) -> None:
        """Pushes the gradients of ``names`` and, in the same round trip, reads back the dense
        ones this worker holds: their values as the servers hold them right after this push.

        With a pipeline (``overlap_pushes``, worker.pipeline) the push is left in flight: the
        previous one is settled first, and this one when the next step pushes or pulls, or the
        batch ends. Its gradients then belong to the push (a retry may send them again): their
        parameters' ``.grad`` is set to None, so no later step writes into them."""
        on_device = self._gradients(names)
        # The values these gradients came from: read before a settle replaces them.
        base = {**self._variables.base_versions(list(on_device)), **self._row_versions}
        self._settle()  # raises EarlierPushFailed when that push failed
        gradients = self._variables.transfers.to_host(on_device)  # after the settle: a GPU's pinned buffers are free
        self._variables.mark_stale(list(names))
        if gradients:
            client = self._require_client()
            key = f"{self._closure_id}/{self._push_seq}"
            self._push_seq += 1
            read_back = [n for n in dict.fromkeys(names) if n in self._used]
            out = self._variables.pull_destinations(read_back)
            used = list(self._used.values())
            if self._pipeline is None:
                self._record(*client.push_and_pull(gradients, read_back, key=key, base_versions=base, out=out), used)
            else:
                exchange = client.start_push_and_pull(gradients, read_back, key=key, base_versions=base, out=out)
                for name in gradients:
                    parameter = self._variables.parameters.get(name)
                    if parameter is not None:
                        parameter.grad = None
                self._pipeline.hold(self, exchange, lambda done: self._record(*done.result(), used))
        self._forget_rows(names)

    def _record(self, summary: PushSummary, pulled: PullResult, used: list[nn.Parameter]) -> None:
        """A push's outcome: the values it read back fill the parameters, and it is counted."""
        self._variables.fill(pulled, used, returned_at=time.monotonic())
        self.pushes_applied += summary.applied
        self.pushes_duplicate += summary.duplicates

    def _settle(self) -> None:
        if self._pipeline is not None:
            self._pipeline.settle()

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        for name in names:
            parameter = self._variables.parameters.get(name)
            if parameter is None or parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.zero_()
        self._forget_rows(names)

    def _gradients(self, names: Sequence[str]) -> dict[str, torch.Tensor | RowGradient]:
        gradients: dict[str, torch.Tensor | RowGradient] = {}
        for name in names:
            parameter = self._variables.parameters.get(name)
            if parameter is not None and parameter.grad is not None:
                gradients[name] = parameter.grad
            rows = self._row_gradient(name)
            if rows is not None:
                gradients[name] = rows
        return gradients

    def _row_gradient(self, name: str) -> RowGradient | None:
        done = [lookup for lookup in self._lookups.get(name, ()) if lookup.leaf.grad is not None]
        if not done:
            return None
        indices = torch.cat([lookup.indices for lookup in done])
        values = torch.cat([lookup.row_gradient() for lookup in done])
        return RowGradient(indices, values)

    def _forget_rows(self, names: Sequence[str]) -> None:
        for name in names:
            self._lookups.pop(name, None)
        forgotten = set(names)
        self._row_versions = {r: v for r, v in self._row_versions.items() if r.variable not in forgotten}

    def _require_client(self) -> VariableClient:
        if self._client is None:
            raise InvalidRequestError(
                "this closure uses distributed variables but was sent without parameter servers in its cluster context"
            )
        return self._client


# ---------------------------------------------------------------- the core


class WorkerCore:
    """Runs closures one at a time and keeps this worker's resources and parameters.

    ``client_factory`` makes the client of a cluster's parameter servers (the server
    passes one building ParameterServerClient; unit tests pass an in-memory fake).
    ``device``: where closures compute (the CPU, or a CUDA GPU: ``paramserve worker --device``).
    Raises ValueError for another kind of device.
    """

    def __init__(
        self,
        client_factory: ClientFactory,
        observer: ClosureObserver | None = None,
        device: torch.device = CPU,
    ):
        self._client_factory = client_factory
        self.incarnation = uuid.uuid4().hex
        self._observer = observer
        # One closure at a time (a worker is one device); bookkeeping has its own lock
        # so that GetInfo answers while a long closure runs.
        self._run_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._resources: dict[str, object] = {}
        self._variables = LocalVariables(transfers_for(device))
        self._clients: OrderedDict[tuple[str, ...], VariableClient] = OrderedDict()
        self._closures_run = 0
        self._cluster = ClusterContext()
        self._cluster_fingerprint = ""

    def run_closures(self, requests: Sequence[ClosureRequest]) -> list[ClosureOutcome]:
        """Runs closures in order; stops after the first that does not succeed (the rest are not
        run: a user error cancels what was queued after it, and a closure that needs something
        resent is retried with it). Raises InvalidRequestError, before running any, for a
        malformed request.

        Closures that ask for ``overlap_pushes`` leave each push in flight while the next step
        computes (worker.pipeline); the last is settled before this returns, and a push that
        failed is its closure's error (the closures after it are not run)."""
        for request in requests:
            _validate(request)
        pipeline = PushPipeline()
        runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]] = []
        with self._run_lock:
            try:
                for request in requests:
                    outcome, access = self._run(request, pipeline if request.overlap_pushes else None)
                    runs.append((request, outcome, access))
                    if outcome.error is not None or pipeline.failure is not None:
                        break
                pipeline.settle_quietly()
            finally:
                pipeline.abandon()  # only where something above raised
        if pipeline.failure is not None:
            runs = _blame_failed_push(runs, pipeline.failure)
        outcomes = [_counted(outcome, access) for _, outcome, access in runs]
        for (request, _, access), outcome in zip(runs, outcomes):
            if access is not None:  # not a request answered with needs_cluster (logged already)
                self._finished(request, outcome)
        return outcomes

    def run_closure(self, request: ClosureRequest) -> ClosureOutcome:
        """Runs ``request``'s function ``steps`` times and returns the last result or the error.

        Errors of the user's code (and of the parameter servers it reaches) come
        back in the outcome; only a malformed request raises (InvalidRequestError).
        """
        return self.run_closures([request])[0]

    def _run(
        self, request: ClosureRequest, pipeline: PushPipeline | None
    ) -> tuple[ClosureOutcome, ClosureAccess | None]:
        """One closure, under the run lock; its last push may still be in ``pipeline``."""
        start = time.perf_counter()
        cluster = self._cluster_for(request)
        if cluster is None:
            return self._needs_cluster(request), None
        access = ClosureAccess(self._variables, self._client_for(cluster), request.closure_id, pipeline)
        result, error = self._execute(request, access)
        outcome = ClosureOutcome(
            result=result,
            error=error,
            worker_incarnation=self.incarnation,
            resources_held=self._held(),
            pushes_applied=access.pushes_applied,
            pushes_duplicate=access.pushes_duplicate,
            seconds=time.perf_counter() - start,
        )
        return outcome, access

    def _finished(self, request: ClosureRequest, outcome: ClosureOutcome) -> None:
        with self._state_lock:
            self._closures_run += 1
        _log_outcome(request, outcome)
        if self._observer is not None:
            self._observer.on_closure(request, outcome)

    def info(self) -> WorkerInfo:
        held = self._held()
        with self._state_lock:
            return WorkerInfo(self.incarnation, os.getpid(), held, self._closures_run)

    def close(self) -> None:
        """Closes the parameter-server clients (and their threads)."""
        with self._run_lock:
            clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            client.close()

    def _execute(self, request: ClosureRequest, access: ClosureAccess) -> tuple[bytes | None, ClosureFailure | None]:
        context = WorkerContext.for_worker(
            request.worker_index, request.num_workers, self.incarnation, device=self._variables.device
        )
        # Gradients left by an earlier (perhaps failed) closure must not leak into this one.
        self._variables.clear_grads()
        try:
            with using_access(access), using_resources(self._resources), computing_on(self._variables.device):
                self._create_resources(request.resources, context)
                fn, args, kwargs = _load(request.payload, access)
                result = None
                reuse_first = self._variables.returned_within(request.max_value_age, time.monotonic())
                for step in range(max(1, request.steps)):
                    # A step starts from what the previous step's pushes returned (read as it
                    # ended), and pulls everything else it uses.
                    self._variables.begin_step(keep_returned=step > 0 or reuse_first)
                    access.refresh_used()
                    result = fn(*args, **kwargs)
            return _dumps_value(result), None
        # SystemExit too: a closure calling sys.exit() must not take the RPC thread down with it.
        except (Exception, SystemExit) as exc:
            return None, closure_failure(exc)

    def _create_resources(self, specs: Sequence[ResourceSpec], context: WorkerContext) -> None:
        for spec in specs:
            if spec.resource_id in self._resources:
                continue
            create = _load_resource_function(spec)
            resource = create(context)
            with self._state_lock:
                self._resources[spec.resource_id] = resource
            log.info("created resource %s", spec.resource_id)

    def _cluster_for(self, request: ClosureRequest) -> ClusterContext | None:
        """The context a request runs in: the one it carries (kept for later requests), the one
        held under its fingerprint, or None when this worker does not hold it."""
        if request.cluster is not None:
            fingerprint = request.cluster_fingerprint or request.cluster.fingerprint
            if fingerprint != self._cluster_fingerprint:
                self._variables.forget_returned()  # values of another layout or generation
            self._cluster, self._cluster_fingerprint = request.cluster, fingerprint
            return request.cluster
        if not request.cluster_fingerprint:
            return ClusterContext()  # a closure that uses no variables
        return self._cluster if request.cluster_fingerprint == self._cluster_fingerprint else None

    def _needs_cluster(self, request: ClosureRequest) -> ClosureOutcome:
        failure = ClosureFailure(
            type="ClusterContextMissing",
            message=f"this worker does not hold cluster context {request.cluster_fingerprint}: resend it",
            needs_cluster=True,
        )
        outcome = ClosureOutcome(None, failure, self.incarnation, self._held(), 0, 0, 0.0)
        _log_outcome(request, outcome)
        return outcome

    def _client_for(self, cluster: ClusterContext) -> VariableClient | None:
        addresses = tuple(cluster.parameter_servers)
        if not addresses:
            return None
        client = self._clients.get(addresses)
        if client is None:
            client = self._client_factory(addresses)
            self._clients[addresses] = client
            while len(self._clients) > _MAX_PS_CLIENTS:
                _, oldest = self._clients.popitem(last=False)
                oldest.close()
        self._clients.move_to_end(addresses)
        client.adopt_layouts(cluster.layouts)
        return client

    def _held(self) -> tuple[str, ...]:
        with self._state_lock:
            return tuple(sorted(self._resources))


def _blame_failed_push(
    runs: list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]], failure: tuple[object, BaseException]
) -> list[tuple[ClosureRequest, ClosureOutcome, ClosureAccess | None]]:
    """The runs up to the closure whose push failed, that closure with the push's error: the
    closures after it did not run as far as the coordinator knows (one stopped at its own push)."""
    owner, error = failure
    for position, (request, outcome, access) in enumerate(runs):
        if access is owner:
            failed = dataclasses.replace(outcome, result=None, error=closure_failure(error))
            return [*runs[:position], (request, failed, access)]
    raise AssertionError("a push failed that no closure of the batch owns")


def _counted(outcome: ClosureOutcome, access: ClosureAccess | None) -> ClosureOutcome:
    """``outcome`` with its closure's pushes counted once all of them are settled."""
    if access is None or (outcome.pushes_applied, outcome.pushes_duplicate) == (
        access.pushes_applied,
        access.pushes_duplicate,
    ):
        return outcome
    return dataclasses.replace(outcome, pushes_applied=access.pushes_applied, pushes_duplicate=access.pushes_duplicate)


def _validate(request: ClosureRequest) -> None:
    if not request.closure_id:
        # Push keys derive from it: without one, two closures' pushes would collide.
        raise InvalidRequestError("RunClosure needs a closure_id (it keys the closure's pushes)")
    if not request.payload:
        raise InvalidRequestError(f"closure {request.closure_id!r} has an empty payload")
    if request.steps < 0:
        raise InvalidRequestError(f"steps must be >= 0 (0 means 1), got {request.steps}")
    if not request.max_value_age >= 0:  # NaN too
        raise InvalidRequestError(f"max_value_age must be >= 0 seconds, got {request.max_value_age}")
    if request.worker_index < 0 or request.num_workers < 0:
        raise InvalidRequestError(
            f"worker_index and num_workers must be >= 0, got {request.worker_index} and {request.num_workers}"
        )
    for spec in request.resources:
        if not spec.resource_id or not spec.payload:
            raise InvalidRequestError("every resource needs a resource_id and a payload")


def _load(payload: bytes, access: ClosureAccess) -> tuple[Any, tuple, dict]:
    """Unpickles (fn, args, kwargs); raises ResourceMissingError naming every missing resource."""
    with collecting_missing() as missing:
        try:
            fn, args, kwargs = loads_closure(payload, access)
        except Exception:
            if missing:  # the failure may just be a placeholder meeting code that expected the resource
                raise ResourceMissingError(*missing) from None
            raise
    if missing:
        raise ResourceMissingError(*missing)
    return fn, tuple(args), dict(kwargs)


def _load_resource_function(spec: ResourceSpec) -> Any:
    with collecting_missing() as missing:
        create = cloudpickle.loads(spec.payload)
    if missing:
        raise ResourceMissingError(*missing)
    return create


# ---------------------------------------------------------------- results and errors


def _tensor_as_value(obj: Any) -> Any:
    """How a result tensor travels, or NotImplemented for anything else: tensors lose their
    autograd history (a loss has a grad_fn), and a GPU worker's tensors travel as host tensors
    (the coordinator may have no GPU). A dense tensor of a wire dtype travels as its raw bytes,
    dtype and shape (torch's own pickling writes a small archive per tensor, several times
    slower for a loss)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.layout == torch.strided and obj.dtype in DTYPE_NAMES:
            return _result_tensor, (bytes(as_byte_view(obj)), DTYPE_NAMES[obj.dtype], tuple(obj.shape))
        if obj.device.type != "cpu":
            return obj.detach().to("cpu").__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if obj.requires_grad or isinstance(obj, nn.Parameter):
            return obj.detach().clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return NotImplemented


class _ValuePickler(cloudpickle.Pickler):
    """Results as values (``_tensor_as_value``), anything cloudpickle can send."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = _tensor_as_value(obj)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


class _PlainValuePickler(pickle.Pickler):
    """Results as values with the standard library's C pickler: several times cheaper than
    cloudpickle for the common result (a loss, a dict of metrics). It refuses what must travel
    by value (functions and classes it cannot find by name), and then cloudpickle sends it."""

    def reducer_override(self, obj: Any) -> Any:
        return _tensor_as_value(obj)


def _result_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuilds a result tensor sent by _ValuePickler (runs on the coordinator)."""
    return tensor_from_buffer(bytearray(data), dtype_from_name(dtype), shape)


def _dumps_value(value: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _PlainValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()
    except Exception:
        buffer = io.BytesIO()
    _ValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def closure_failure(exc: BaseException) -> ClosureFailure:
    """What the coordinator learns about an exception raised while running a closure."""
    missing = _in_chain(exc, ResourceMissingError)
    if missing is not None:
        return ClosureFailure(
            type=_qualified_name(missing), message=str(missing), missing_resources=missing.resource_ids
        )
    server_error = _in_chain(exc, (ServerUnavailableError, DeadlineExceededError))
    if server_error is None:
        lost = _in_chain(exc, VariableNotFoundError)  # every variable asked for is in the cluster context
        server_error = lost if lost is not None and lost.server else None
    return ClosureFailure(
        type=_qualified_name(exc),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        pickled=_pickled_exception(exc),
        parameter_server=(server_error.server or "unknown") if server_error is not None else "",
    )


def _in_chain(exc: BaseException, types: type | tuple[type, ...]) -> Any:
    """``exc`` or the first exception it was raised from / during that is one of ``types``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _pickled_exception(exc: BaseException) -> bytes:
    """The exception when it survives a round trip (many custom exceptions do not), else b""."""
    try:
        payload = _dumps_value(exc)
        cloudpickle.loads(payload)
        return payload
    except Exception:
        return b""


def _qualified_name(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _log_outcome(request: ClosureRequest, outcome: ClosureOutcome) -> None:
    name = request.function_name or "closure"
    if outcome.error is None:
        log.debug(
            "closure %s (%s, attempt %d) done in %.3fs", request.closure_id, name, request.attempt, outcome.seconds
        )
    elif outcome.error.missing_resources:
        log.info(
            "closure %s (%s): missing resources %s", request.closure_id, name, list(outcome.error.missing_resources)
        )
    elif outcome.error.needs_cluster:
        log.info("closure %s (%s): asks for the cluster context", request.closure_id, name)
    else:
        log.info(
            "closure %s (%s, attempt %d) failed: %s: %s",
            request.closure_id,
            name,
            request.attempt,
            outcome.error.type,
            outcome.error.message,
        )
