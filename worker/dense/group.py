"""Hybrid training on the worker: dense variables replicated on every worker and averaged
every step by an all-reduce among the workers (``ParameterServerStrategy(sync_dense=True)``),
while embedding tables stay on the parameter servers and are updated asynchronously.

The coordinator runs hybrid training in *rounds*: each round, every member of the group gets
one RunClosures call, with closures or none. A member's closures call ``optimizer.step()`` as
usual; each step's dense gradients go through ``DenseReplicas.exchange``; when its closures
are done the member keeps taking part (``finish_round``) until every member is done. So the
members need not run the same number of steps: the one exchange of each step (an all-reduce,
or with two members on gloo, a send to the other: ``pairwise_exchange``) carries, after
the gradients, a header slot per member (is it stepping, and under which key), and a step's
average counts only the members that contributed. Every member, stepping or not, applies the
same average with the same optimizer: the replicas stay identical. A step's exchange is left
in flight and its average applied (``settle``) when a layer holding replicated variables next
runs, at the next step or at the round's end: the wait overlaps the table push and the next
step's row lookups.

Exactly once: a step's key (closure id and push number, as the servers' idempotency keys)
is remembered by every member once its average was applied. A closure retried after its
dense step was applied (its worker died before answering) contributes zeros for that step,
and its table push is a duplicate the servers drop: the retry changes nothing twice.

Forming a group (``begin_round`` with a new generation) builds a gloo process group on the
coordinator's rendezvous store (worker/dense/rendezvous_store.py: a namespace per generation, opened
with the cluster's token; the coordinator gives a generation up when a member is lost while it
forms, and the others' rendezvous ends at once instead of at the group's timeout); when every
member computes on a GPU of its own (``step_backend``: told apart by the GPUs' UUIDs, which two
processes sharing one GPU both report) the steps' all-reduce runs on an NCCL group beside it, on
the GPUs, and gloo keeps the rest (the state exchange, CPU bytes). Then it makes the members'
states equal:
a member without state of the current epoch starts from the latest state the coordinator
knows, and the member that applied the most steps sends its state to the others. A collective that fails (a
member died: its sockets close; or it hung past the group's timeout) raises ``GroupFailed``; the
coordinator forms the group anew without the member that left, and the closures of the broken
round run again.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DenseReplicas",
    "DenseRound",
    "GroupFailed",
    "GroupSpec",
    "contributors",
    "decode_headers",
    "encode_header",
    "key_hash",
    "pairwise_exchange",
    "post_pairwise",
    "state_source",
    "step_backend",
    "sum_in_rank_order",
]

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from paramserve.psserver.runtime.security import rendezvous_key
from paramserve.worker.closure_access import LocalVariables
from paramserve.worker.dense.rendezvous_store import RendezvousStore
from paramserve.worker.results import GroupFailed

log = logging.getLogger(__name__)

APPLIED_KEYS_KEPT = 65_536
"""Step keys remembered as applied (a retried closure's step is recognised among them). The
coordinator retries a closure within a few rounds, far fewer steps than this."""

HEADER_SLOT = 4
"""A member's header in a step's all-reduce: stepping (0 or 1), its step key in 3 parts of 21
bits (float32 holds integers below 2**24 exactly, and sums of zeros with one value stay exact)."""
_KEY_PART_BITS = 21
_PAIRWISE_TAG = 7
"""The tag of a step's point-to-point sends (gloo keeps collectives' slots apart from tags)."""


@dataclass(frozen=True)
class GroupSpec:
    """One member's view of a formation of the dense group (proto DenseGroup)."""

    generation: int
    rank: int
    world_size: int
    store_address: str
    host: str
    timeout: float
    store_secret: bytes = field(default=b"", repr=False)
    """The store's session secret: with the cluster's token, the key this member proves to it."""


@dataclass(frozen=True)
class DenseRound:
    """A round of hybrid training as one member receives it (proto DenseRound)."""

    group: GroupSpec
    variables: tuple[str, ...]
    optimizer: bytes
    state_epoch: int
    initial_state: bytes = b""
    read_state: bool = False


# ---------------------------------------------------------------- pure decisions


def key_hash(key: str) -> int:
    """A step key as the 63-bit integer members exchange (collisions: 1 in 2**63 per pair)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def contributors(stepping: Sequence[bool], keys: Sequence[int], applied: Container[int]) -> list[int]:
    """The ranks whose gradients count in this step's average: those stepping under a key not
    applied before (a retried closure's step counts once). The coordinator never runs one
    closure on two workers in one round, so two members never step under one key."""
    return [rank for rank, (active, key) in enumerate(zip(stepping, keys)) if active and key not in applied]


def encode_header(stepping: bool, key: int) -> list[float]:
    """A member's header slot (HEADER_SLOT floats)."""
    if not stepping:
        return [0.0] * HEADER_SLOT
    mask = (1 << _KEY_PART_BITS) - 1
    return [1.0, *(float((key >> (_KEY_PART_BITS * i)) & mask) for i in range(HEADER_SLOT - 1))]


def decode_headers(values: Sequence[float], world_size: int) -> tuple[list[bool], list[int]]:
    """Every member's (stepping, key) from the summed header slots."""
    stepping: list[bool] = []
    keys: list[int] = []
    for rank in range(world_size):
        slot = values[rank * HEADER_SLOT : (rank + 1) * HEADER_SLOT]
        stepping.append(slot[0] > 0.5)
        keys.append(sum(int(round(part)) << (_KEY_PART_BITS * i) for i, part in enumerate(slot[1:])))
    return stepping, keys


def state_source(versions: Sequence[int]) -> int:
    """The member whose state the others take when a group forms: the one that applied the
    most steps (the lowest rank among equals). Members in step hold equal versions; one ahead
    finished a step whose collective failed elsewhere, and its state is the one to keep."""
    return max(range(len(versions)), key=lambda rank: (versions[rank], -rank))


def encode_device(uuid: bytes | None, nccl_available: bool) -> list[int]:
    """This member's entry in the exchange of devices when a group forms: NCCL usable here (0 or
    1), then ``uuid`` (16 bytes naming the GPU it computes on; None on a CPU) as two int64
    halves (zeros on a CPU or without NCCL)."""
    if uuid is None or not nccl_available:
        return [0, 0, 0]
    return [1, int.from_bytes(uuid[:8], "big", signed=True), int.from_bytes(uuid[8:16], "big", signed=True)]


def step_backend(devices: Sequence[Sequence[int]]) -> str:
    """The backend of the steps' exchange, from every member's ``encode_device`` entry: "nccl" when
    every member computes on a GPU with NCCL and no two share one (NCCL drives one GPU per
    process: two ranks on one device fail), else "gloo" (the gradients go through host memory).
    Every member decides from the same gathered entries, so all agree."""
    gpus = [tuple(entry[1:]) for entry in devices if entry[0] == 1]
    if devices and len(gpus) == len(devices) and len(set(gpus)) == len(gpus):
        return "nccl"
    return "gloo"


def pairwise_exchange(world_size: int, backend: str) -> bool:
    """Whether a step's gradients go to the other member by a point-to-point send on gloo, each
    member summing the two vectors itself in rank order, instead of through gloo's all-reduce:
    in groups of two (or one) on gloo.

    Measured on 2 cores with two processes (benchmarks/gloo_exchange.py): gloo's all-reduce of
    the DLRM's 120 KB costs 1.37 ms and 0.89 CPU-ms per member (its work thread, the ring's two
    phases), the pairwise exchange 0.44 ms and 0.30 CPU-ms, and each member sends what a ring
    would. Not with three or more: a member whose send to a dead peer fails gives up its
    exchange with the others too, who then wait out the group's timeout (20 s in a test) for
    its vector, where gloo's all-reduce fails for every member within milliseconds. NCCL's
    all-reduce runs on the GPUs and stays."""
    return backend == "gloo" and world_size <= 2


def post_pairwise(
    post: Callable[..., Any], flat: torch.Tensor, rank: int, world_size: int
) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Starts the pairwise exchange of ``flat``: a send to and a receive from every other member
    (``post(collective, *args)`` starts one on the group and returns its Work). Returns the Works
    and, by rank, the buffers the others' vectors arrive in (None at ``rank``): once every Work
    is waited for, ``sum_in_rank_order`` of them with ``flat`` in its place is the sum."""
    works: list[Any] = []
    received: list[torch.Tensor | None] = []
    for peer in range(world_size):
        if peer == rank:
            received.append(None)
            continue
        buffer = torch.empty_like(flat)
        works.append(post("send", [flat], peer, _PAIRWISE_TAG))
        works.append(post("recv", [buffer], peer, _PAIRWISE_TAG))
        received.append(buffer)
    return works, received


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The members' vectors summed in rank order: every member computes the same bits (the same
    additions in the same order), so the replicas stay identical."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def store_endpoint(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"the dense group's store address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- the replicas


def _flat_gradients(
    group: Sequence[tuple[str, nn.Parameter]], gradients: Mapping[str, torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """Each parameter's gradient, flat on ``device`` (zeros for one this step did not touch)."""
    return [
        (
            gradients[name].detach().reshape(-1).to(device)
            if name in gradients
            else torch.zeros(p.numel(), dtype=p.dtype, device=device)
        )
        for name, p in group
    ]


def _on_host(state: Any) -> Any:
    """An optimizer's state dict with its tensors in host memory: a GPU worker's state is read
    by a coordinator that may have no GPU (torch.load of CUDA tensors fails there) and loaded
    by members that move it to their own parameters' device."""
    if isinstance(state, torch.Tensor):
        return state.to("cpu")
    if isinstance(state, dict):
        return {key: _on_host(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_host(value) for value in state)
    return state


def _nccl_group(store: Any, spec: GroupSpec) -> Any:
    """The steps' NCCL group. Blocking waits and error handling that cleans up without ending the
    process: a collective whose peer died raises after the group's timeout, as gloo's does, and
    the coordinator forms the group anew (torch's default would end this worker)."""
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=spec.timeout)
    return dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, options)


@dataclass
class _PendingStep:
    """A step whose exchange was sent and is not applied yet."""

    works: Sequence[Any]  # torch.distributed Work: the all-reduce, or the sends and receives
    main: Sequence[tuple[str, nn.Parameter]]
    flat: torch.Tensor  # float32 gradients then every member's header slot (summed: once waited for)
    header: int  # the header's length at the end of ``flat``
    others: Sequence[tuple[Sequence[tuple[str, nn.Parameter]], torch.Tensor]]
    received: Sequence[torch.Tensor | None] = ()
    """Pairwise: each member's ``flat`` by rank (None at this member's own rank)."""


class DenseReplicas:
    """This worker's replicas of the dense variables, their optimizer, and its group membership.

    Worker-wide, like LocalVariables, whose parameters it updates: a closure's module resolves
    a replicated variable to the same ``nn.Parameter`` every time, and it is never pulled.
    ``token``: the cluster's, which the coordinator's rendezvous store asks members to prove."""

    def __init__(self, variables: LocalVariables, token: str | None = None):
        self._variables = variables
        self._token = token
        self._names: tuple[str, ...] = ()
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_spec = b""
        self._wanted_optimizer = b""
        """The optimizer the current round asks for (cloudpickle of its class and param groups)."""
        self._epoch = -1
        self._version = -1
        """Dense steps applied since this epoch's values were loaded; -1: no state."""
        self._applied: OrderedDict[int, None] = OrderedDict()
        self._group: Any = None  # a ProcessGroupGloo
        self._step_group: Any = None  # the steps' exchange: the gloo group or an NCCL one
        self._step_device = torch.device("cpu")
        self._store: RendezvousStore | None = None
        self._spec: GroupSpec | None = None
        self._broken = False
        self._pending: _PendingStep | None = None

    # ------------------------------------------------------------ what closures ask

    def holds(self, name: str) -> bool:
        return name in self._names

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------ rounds

    def begin_round(self, round_: DenseRound) -> None:
        """Takes part in ``round_``: forms its group if this member holds another formation,
        and sets the optimizer's hyperparameters to the round's. Raises GroupFailed."""
        if round_.state_epoch > self._epoch:
            self._drop_state()
            self._epoch = round_.state_epoch
        self._names = tuple(sorted(round_.variables))
        if round_.initial_state and self._version < 0:
            self._load_state(torch.load(io.BytesIO(round_.initial_state), weights_only=True))
        self._use_optimizer(round_.optimizer)
        if self._spec is None or self._spec.generation != round_.group.generation or self._broken:
            self._form(round_.group)
            self._synchronize()

    def exchange(self, gradients: Mapping[str, torch.Tensor], key: str) -> None:
        """One step's part: contributes ``gradients`` (of the replicated variables this step
        touched; the others count as zero) under ``key``. The average over the members that
        contributed is applied by ``settle``: before the next step's part, when a layer holding
        replicated variables next runs forward (SettleBeforeForward), or when the round ends;
        until then the all-reduce runs while the worker goes on (its next lookup). Raises
        GroupFailed (here, or where the step is settled)."""
        self.settle()
        self._pending = self._start_step(stepping=True, key=key_hash(key), gradients=gradients)

    @property
    def pending(self) -> bool:
        """Whether a step's average is still to be applied (``settle``)."""
        return self._pending is not None

    def settle(self) -> None:
        """Applies the average of the step in flight, if any. Raises GroupFailed."""
        step, self._pending = self._pending, None
        if step is not None:
            self._finish_step(step)

    def finish_round(self) -> None:
        """Takes part in the other members' steps until every member is done. Raises GroupFailed."""
        if self._group is None:
            return
        self.settle()
        while self._collective_step(stepping=False, key=0, gradients={}):
            pass

    def state_of_epoch(self, epoch: int) -> bytes:
        """``state_bytes`` if this member holds state of ``epoch`` (or a later one), else empty."""
        return self.state_bytes() if self._version >= 0 and self._epoch >= epoch else b""

    def state_bytes(self) -> bytes:
        """The values, the optimizer's state and the version, as torch.save writes them."""
        buffer = io.BytesIO()
        torch.save(self._state(), buffer)
        return buffer.getvalue()

    def close(self) -> None:
        self._leave()

    # ------------------------------------------------------------ the group

    def _form(self, spec: GroupSpec) -> None:
        self._leave()
        host, port = store_endpoint(spec.store_address)
        timeout = datetime.timedelta(seconds=spec.timeout)
        key = rendezvous_key(self._token, spec.store_secret)
        try:
            self._store = RendezvousStore(host, port, key=key, generation=spec.generation, timeout=spec.timeout)
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.host)]
            self._group = dist.ProcessGroupGloo(self._store, spec.rank, spec.world_size, options)
            self._spec, self._broken = spec, False
            self._step_group, self._step_device = self._group, torch.device("cpu")
            backend = step_backend(self._all_gather(torch.tensor(self._device_entry())).tolist())
            if backend == "nccl":
                self._step_group = _nccl_group(dist.PrefixStore("nccl/", self._store), spec)
                self._step_device = self._variables.device
        except (RuntimeError, GroupFailed) as exc:
            self._leave()
            raise GroupFailed(f"forming dense group {spec.generation} (rank {spec.rank}) failed: {exc}") from exc
        log.info(
            "formed dense group %d: rank %d of %d, steps all-reduced with %s",
            spec.generation,
            spec.rank,
            spec.world_size,
            backend,
        )

    def _device_entry(self) -> list[int]:
        device = self._variables.device
        if device.type != "cuda":
            return encode_device(None, False)
        # The UUID's text (its type's fields vary across torch versions), hashed to 16 bytes.
        uuid = hashlib.blake2b(str(torch.cuda.get_device_properties(device).uuid).encode(), digest_size=16).digest()
        return encode_device(uuid, dist.is_nccl_available())

    def _leave(self) -> None:
        # Dropping the group joins gloo's threads now, while the interpreter is whole.
        if self._step_group is not None and self._step_group is not self._group:
            try:
                self._step_group.abort()  # a group whose peer died must not block the next one
            except (RuntimeError, AttributeError):
                pass
        self._group, self._spec, self._pending = None, None, None
        self._step_group, self._step_device = None, torch.device("cpu")
        store, self._store = self._store, None  # after the groups that use it
        if store is not None:
            store.close()

    def _synchronize(self) -> None:
        """Makes every member's state the one of the member that applied the most steps."""
        versions = self._all_gather(torch.tensor([self._version], dtype=torch.int64)).reshape(-1).tolist()
        if max(versions) < 0:
            raise GroupFailed("no member of the dense group holds the dense values: the coordinator sends them")
        source = state_source(versions)
        if all(v == versions[source] for v in versions):
            return
        payload = self.state_bytes() if self._rank == source else b""
        received = self._broadcast_bytes(payload, source)
        if self._rank != source:
            self._load_state(torch.load(io.BytesIO(received), weights_only=True))

    def _collective_step(self, *, stepping: bool, key: int, gradients: Mapping[str, torch.Tensor]) -> bool:
        """One collective step of the round, waited for; returns whether any member was stepping."""
        return self._finish_step(self._start_step(stepping=stepping, key=key, gradients=gradients))

    def _start_step(self, *, stepping: bool, key: int, gradients: Mapping[str, torch.Tensor]) -> _PendingStep:
        """Sends this member's part of a step and returns without waiting for the others.

        One exchange carries the step (an all-reduce, or pairwise: a send of ``flat`` to the
        other member and a receive of theirs, summed in rank order by ``_finish_step``): the
        float32 gradients (zeros from a member not
        stepping, or stepping under a key applied before), then a header slot per member
        (stepping, its key in 21-bit parts), each member writing only its own: the sum holds
        every member's header. Gradients of other dtypes follow in one all-reduce each (sent
        when the step is finished: every member sends its collectives in the same order)."""
        assert self._spec is not None
        parameters = self._parameters()
        fresh = stepping and key not in self._applied
        main = [(n, p) for n, p in zip(self._names, parameters) if p.dtype == torch.float32]
        device = self._step_device
        header = torch.zeros(self._spec.world_size * HEADER_SLOT, dtype=torch.float32)
        header[self._rank * HEADER_SLOT : (self._rank + 1) * HEADER_SLOT] = torch.tensor(encode_header(stepping, key))
        flat = torch.cat([*_flat_gradients(main, gradients if fresh else {}, device), header.to(device)])
        others = []
        for dtype in sorted({p.dtype for p in parameters} - {torch.float32}, key=str):
            group = [(n, p) for n, p in zip(self._names, parameters) if p.dtype == dtype]
            others.append((group, torch.cat(_flat_gradients(group, gradients if fresh else {}, device))))
        if not pairwise_exchange(self._spec.world_size, "gloo" if self._step_group is self._group else "nccl"):
            work = self._send("allreduce", [flat], group=self._step_group)
            return _PendingStep([work], main, flat, header.numel(), others)
        works, received = post_pairwise(self._send, flat, self._rank, self._spec.world_size)
        return _PendingStep(works, main, flat, header.numel(), others, received)

    def _finish_step(self, step: _PendingStep) -> bool:
        """Waits for a step's exchange and applies its average; returns whether any member
        was stepping (False: every member is done with the round)."""
        assert self._spec is not None
        for work in step.works:
            self._wait(work, "exchange")
        if step.received:
            step.flat = sum_in_rank_order([step.flat if part is None else part for part in step.received])
        active, keys = decode_headers(step.flat[step.flat.numel() - step.header :].tolist(), self._spec.world_size)
        if not any(active):
            return False
        counted = contributors(active, keys, self._applied)
        for _, other in step.others:
            self._wait(self._send("allreduce", [other], group=self._step_group), "allreduce")
        if counted:
            self._apply_average([(step.main, step.flat), *step.others], len(counted))
            for rank in counted:
                self._applied[keys[rank]] = None
            while len(self._applied) > APPLIED_KEYS_KEPT:
                self._applied.popitem(last=False)
        return True

    def _apply_average(
        self, averaged: Sequence[tuple[Sequence[tuple[str, nn.Parameter]], torch.Tensor]], count: int
    ) -> None:
        """Sets each parameter's gradient to its sum over the members divided by ``count`` (the
        members that contributed) and steps the optimizer, as every member does."""
        for group, flat in averaged:
            offset = 0
            for _, p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device).div_(count)
                offset += p.numel()
        assert self._optimizer is not None
        self._optimizer.step()
        self._version += 1
        for _, p in (item for group, _ in averaged for item in group):
            p.grad = None

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self._spec is not None
        gathered = [torch.empty_like(tensor) for _ in range(self._spec.world_size)]
        self._run("allgather", [gathered], [tensor])
        return torch.stack(gathered)

    def _broadcast_bytes(self, payload: bytes, source: int) -> bytes:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        options = dist.BroadcastOptions()
        options.rootRank = source
        self._run("broadcast", [size], options)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._run("broadcast", [data], options)
        return data.numpy().tobytes()

    def _run(self, collective: str, *args: Any) -> None:
        """``collective`` (a ProcessGroup method) on ``args``, waited for; GroupFailed if it fails."""
        self._wait(self._send(collective, *args), collective)

    def _send(self, collective: str, *args: Any, group: Any = None) -> Any:
        """Starts ``collective`` on ``args`` (on ``group``, by default the gloo group); its work
        object. GroupFailed if it cannot start."""
        if self._group is None or self._broken:
            raise GroupFailed("this worker holds no working dense group: the coordinator forms one")
        try:
            return getattr(group if group is not None else self._group, collective)(*args)
        except RuntimeError as exc:
            raise self._failed(collective, exc) from exc

    def _wait(self, work: Any, collective: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._failed(collective, exc) from exc

    def _failed(self, collective: str, exc: RuntimeError) -> GroupFailed:
        self._broken = True
        self._pending = None
        generation = self._spec.generation if self._spec is not None else -1
        return GroupFailed(f"the dense group's {collective} failed (group {generation}): {exc}")

    @property
    def _rank(self) -> int:
        assert self._spec is not None
        return self._spec.rank

    # ------------------------------------------------------------ state

    def _parameters(self) -> list[nn.Parameter]:
        missing = [name for name in self._names if name not in self._variables.parameters]
        if missing:
            raise GroupFailed(f"this worker holds no values of the dense variables {missing}")
        return [self._variables.parameters[name] for name in self._names]

    def _use_optimizer(self, spec: bytes) -> None:
        """The round's optimizer: the same class keeps its state and takes the new
        hyperparameters (a changed learning rate); another class starts afresh."""
        self._wanted_optimizer = spec
        self._ensure_optimizer()

    def _ensure_optimizer(self) -> None:
        spec = self._wanted_optimizer
        if not spec or (spec == self._optimizer_spec and self._optimizer is not None):
            return
        if not all(name in self._variables.parameters for name in self._names):
            return  # no values yet: built once they arrive (_synchronize)
        cls, groups = cloudpickle.loads(spec)
        parameters = dict(zip(self._names, self._parameters()))
        current = self._optimizer
        held = [[id(p) for p in group["params"]] for group in current.param_groups] if current is not None else []
        if type(current) is cls and held == [[id(parameters[n]) for n in names] for names, _ in groups]:
            assert current is not None
            for group, (_, kwargs) in zip(current.param_groups, groups):  # the same groups: their state kept
                group.update(kwargs)
        else:
            self._optimizer = cls([{"params": [parameters[n] for n in names], **kwargs} for names, kwargs in groups])
        self._optimizer_spec = spec

    def _drop_state(self) -> None:
        self._version = -1
        self._optimizer, self._optimizer_spec = None, b""
        self._applied.clear()

    def _load_values(self, values: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in values.items():
                parameter = self._variables.parameter(name, tuple(value.shape), value.dtype)
                parameter.copy_(value)
        self._version = 0
        self._optimizer, self._optimizer_spec = None, b""
        self._ensure_optimizer()

    def _state(self) -> dict[str, Any]:
        return {
            "version": self._version,
            "values": {name: p.detach().to("cpu") for name, p in zip(self._names, self._parameters())},
            "optimizer": _on_host(self._optimizer.state_dict()) if self._optimizer is not None else None,
            "applied": list(self._applied),
        }

    def _load_state(self, state: Mapping[str, Any]) -> None:
        self._load_values(state["values"])
        self._version = int(state["version"])
        if state["optimizer"] is not None and self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        self._applied = OrderedDict((int(key), None) for key in state["applied"])
