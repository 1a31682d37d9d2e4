"""The one client of the parameter servers, used by workers and the coordinator.

It knows every server, places variables on them through a partitioner, and
pulls and pushes all shards of a request in parallel (one RPC per server).
Every call has a deadline; only retryable status codes are retried (tenacity,
jittered, within an overall deadline); failures surface as the typed errors
of psserver.errors, naming the variable, the server and the cause.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TypeVar, Union, cast

import grpc
import tenacity
import torch
from google.protobuf.message import DecodeError

from paramserve.psserver import convert
from paramserve.psserver.dataplane import DataPlaneConnection, DataPlaneLinks, TransportError
from paramserve.psserver.errors import (
    ERROR_METADATA_KEY,
    ERROR_TYPES,
    ERROR_VARIABLE_METADATA_KEY,
    AuthenticationError,
    ConfigurationError,
    DeadlineExceededError,
    DtypeMismatchError,
    IndexOutOfRangeError,
    InternalError,
    InvalidRequestError,
    MessageTooLargeError,
    ParamServeError,
    PermissionDeniedError,
    ServerUnavailableError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.psserver.partition import (
    FixedShardsPartitioner,
    Partitioner,
    place_shards,
    split_rows,
)
from paramserve.psserver.programs import ProgramNumbers, fits_a_program
from paramserve.psserver.security import ClientTls, bearer_metadata, open_channel
from paramserve.psserver.servicer import IDEMPOTENCY_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.serving import channel_options, metadata_text
from paramserve.psserver.streams import (
    DEFAULT_CHUNK_BYTES,
    byte_buffer,
    decode_step_reply,
    encode_parts,
    encode_step_request,
    meta_nbytes,
    meta_of,
    read_parts,
    tensor_from_bytes,
    tensor_payload,
)
from paramserve.psserver.tensors import as_byte_view, dtype_name, writable_byte_view
from paramserve.psserver.types import (
    PendingExchange,
    PullResult,
    PushOutcome,
    PushSummary,
    RowGradient,
    ShardInfo,
    ShardPlacement,
    ShardRef,
    ShardState,
    VariableLayout,
)
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_R = TypeVar("_R")

RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
"""Safe to retry: every paramserve RPC is idempotent (pushes carry idempotency keys)."""

_CODE_ERRORS: dict[grpc.StatusCode, type[ParamServeError]] = {
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLargeError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: VariableNotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


@dataclass(frozen=True)
class ClientConfig:
    token: str | None = None
    """The cluster's shared token; calls present a credential derived from it, never the token."""
    tls_root_certificates: pathlib.Path | None = None
    """PEM CA bundle to verify servers that serve TLS; None: plaintext."""
    tls_cert_chain: pathlib.Path | None = None
    tls_private_key: pathlib.Path | None = None
    """The client certificate and key presented to servers that require mutual TLS (both or neither)."""
    tls_server_name: str | None = None
    """Check the servers' certificates for this name instead of each address's host."""
    call_timeout: float = 30.0
    """Deadline of one attempt of one RPC, in seconds."""
    retry_deadline: float = 60.0
    """Time budget across all attempts of one RPC, in seconds."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = 64 << 20
    max_unary_bytes: int | None = None
    """Over gRPC (a server without a data plane, or a share over its frame limit): a server's
    share of a call whose payload (both ways) is at most this travels as one unary Step
    message each way; larger ones stream in chunks. None: ``chunk_bytes``."""
    max_parallel_calls: int = 16
    data_plane: bool = True
    """Send training steps over the servers' data planes where they have one
    (psserver/dataplane.py); False: always the Step RPC."""

    def client_tls(self) -> ClientTls | None:
        """The TLS these settings describe (None: plaintext). Raises ConfigurationError for a
        client certificate without its key, or TLS client files without a CA bundle."""
        if self.tls_root_certificates is None:
            if self.tls_cert_chain is not None or self.tls_private_key is not None:
                raise ConfigurationError("a TLS client certificate needs the CA bundle that verifies the servers "
                                         "too (tls_root_certificates, e.g. --ps-tls-ca)")
            return None
        return ClientTls(self.tls_root_certificates, self.tls_cert_chain, self.tls_private_key, self.tls_server_name)












class ParameterServerClient:
    """Talks to every parameter server of a cluster. Thread-safe; close() when done."""

    def __init__(self, addresses: Sequence[str], config: ClientConfig | None = None):
        if not addresses:
            raise ValueError("ParameterServerClient needs at least one parameter-server address")
        self.addresses = tuple(addresses)
        self.config = config or ClientConfig()
        self._channels = [self._open_channel(a) for a in self.addresses]
        self._stubs = [_Stub(channel) for channel in self._channels]
        self._pool = futures.ThreadPoolExecutor(
            max_workers=min(self.config.max_parallel_calls, max(2, 2 * len(addresses))),
            thread_name_prefix="paramserve-client",
        )
        self._lock = threading.Lock()
        self._layouts: dict[str, VariableLayout] = {}
        self._next_server = 0
        self._wire: dict[str, _LayoutWire] = {}
        self._links = DataPlaneLinks(
            [_host_of(a) for a in self.addresses], self._data_plane_info, token=self.config.token,
            tls=self.config.client_tls(), timeout=self.config.call_timeout,
        ) if self.config.data_plane else None

    # ------------------------------------------------------------------ layout

    @property
    def layouts(self) -> dict[str, VariableLayout]:
        with self._lock:
            return dict(self._layouts)

    def layout(self, name: str) -> VariableLayout:
        with self._lock:
            layout = self._layouts.get(name)
        if layout is None:
            layout = self.discover().get(name)
        if layout is None:
            raise VariableNotFoundError("no parameter server holds this variable; create it first", variable=name)
        return layout

    def adopt_layouts(self, layouts: Mapping[str, VariableLayout]) -> None:
        """Uses layouts known elsewhere (e.g. sent by the coordinator) instead of discovering them."""
        with self._lock:
            self._layouts.update(layouts)
            self._next_server = max(self._next_server, sum(len(l.shards) for l in self._layouts.values()))

    def discover(self) -> dict[str, VariableLayout]:
        """Rebuilds every variable's layout from the servers' shard lists."""
        infos = self._fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: [convert.info_from_proto(i) for i in self._stubs[server].list_shards(self._call_options()).shards],
        )
        layouts = layouts_from_infos({server: shard_infos for server, shard_infos in infos.items()})
        self.adopt_layouts(layouts)
        return layouts

    def plan_layout(self, name: str, shape: Sequence[int], dtype: torch.dtype, partitioner: Partitioner | None) -> VariableLayout:
        """Decides shard row ranges and servers for a new variable (round-robin across variables)."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            return VariableLayout(name, shape, dtype, (ShardPlacement(0, self._take_servers(1)[0], 0, 0),))
        num_shards = (partitioner or FixedShardsPartitioner(1))(shape, dtype)
        ranges = split_rows(shape[0], num_shards)
        servers = self._take_servers(len(ranges))
        shards = tuple(
            ShardPlacement(i, servers[i], r.start, r.stop - r.start) for i, r in enumerate(ranges)
        )
        return VariableLayout(name, shape, dtype, shards)

    def _take_servers(self, count: int) -> list[int]:
        with self._lock:
            first = self._next_server
            self._next_server += count
        return place_shards(count, len(self.addresses), first)

    # ------------------------------------------------------------------ create

    def create_variable(
        self,
        name: str,
        value: torch.Tensor | None = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        initializer: tensor_pb2.Initializer | None = None,
        optimizer: OptimizerSpec | None = None,
        partitioner: Partitioner | None = None,
    ) -> VariableLayout:
        """Creates a partitioned variable from ``value``, or from ``shape`` + ``initializer``
        filled on the servers (for tables too large to send). Safe to retry."""
        if (value is None) == (initializer is None):
            raise ValueError(f"create_variable({name!r}) takes a value or an initializer, not both or neither")
        if value is not None:
            value = value.detach().cpu().contiguous()
            shape, dtype = tuple(value.shape), value.dtype
        if shape is None:
            raise ValueError(f"create_variable({name!r}) with an initializer needs a shape")
        layout = self.plan_layout(name, shape, dtype, partitioner)
        parts_by_server: dict[int, list] = defaultdict(list)
        for shard in layout.shards:
            parts_by_server[shard.server].append(self._creation_part(layout, shard, value, optimizer, initializer))
        self._create_parts(parts_by_server, name)
        with self._lock:
            self._layouts[name] = layout
        return layout

    def _creation_part(self, layout, shard, value, optimizer, initializer):  # type: ignore[no-untyped-def]
        ref = layout.ref(shard)
        rows = slice(shard.row_start, shard.row_start + shard.num_rows)
        if value is None:
            shard_shape = (shard.num_rows, *layout.shape[1:]) if layout.shape else ()
            return convert.initialized_shard_part(ref, layout.shape, shard.row_start, shard_shape, layout.dtype, optimizer, initializer)
        piece = value[rows] if layout.shape else value
        state = ShardState(ref=ref, variable_shape=layout.shape, row_start=shard.row_start, value=piece,
                           optimizer=optimizer, slots={}, version=0, applied_keys=[])
        return convert.shard_part(state)

    def load_states(self, states_by_server: Mapping[int, Sequence[ShardState]], *, replace: bool = False) -> None:
        """Creates shards with their full state (value, slots, version, window): restores.
        ``replace``: the variables named are replaced whole and exactly on each server, live
        or not (ReplaceShards); otherwise shards that exist are kept (CreateShards)."""
        parts = {server: [convert.shard_part(s) for s in states] for server, states in states_by_server.items()}
        self._create_parts(parts, None, replace=replace)

    def _create_parts(self, parts_by_server: Mapping[int, list], variable: str | None, *, replace: bool = False) -> None:
        self._fan_out(
            parts_by_server,
            lambda server, parts: self._stubs[server].create_shards(
                lambda: encode_parts(iter(parts), self.config.chunk_bytes), self._call_options(), replace=replace
            ),
            variable=variable,
        )

    # ------------------------------------------------------------------ pull and push

    def pull(self, names: Sequence[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None) -> PullResult:
        """Reads whole variables (all known ones by default) from all servers in parallel.

        ``out``: host tensors to read variables into, by name (e.g. a GPU worker's pinned
        buffers; the result holds them); others are allocated. Raises ShapeMismatchError or
        DtypeMismatchError, before any call, for one that does not fit the variable."""
        exchange = _Exchange()
        self._add_reads(exchange, names if names is not None else list(self.layouts), out)
        _, versions = self._run(exchange, None, names[0] if names and len(names) == 1 else None)
        return PullResult(exchange.outputs, versions)

    def pull_rows(self, name: str, indices: torch.Tensor) -> PullResult:
        """Reads rows of a variable (an embedding lookup): the result has shape
        ``indices.shape + variable.shape[1:]``. Only the distinct rows travel."""
        layout = self.layout(name)
        flat = indices.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= layout.shape[0]):
            bad = int(flat[(flat < 0) | (flat >= layout.shape[0])][0])
            raise _index_error(name, bad, layout.shape[0])
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = torch.empty((unique.numel(), *layout.shape[1:]), dtype=layout.dtype)
        exchange = _Exchange()
        for shard, positions in _group_rows(layout, unique):
            local = unique[positions] - shard.row_start
            item = ps_pb2.PullItem(ref=convert.ref_to_proto(layout.ref(shard)), sparse=True,
                                   row_indices=convert.rows_to_bytes(local))
            exchange.read(shard.server, item, _RowScatter(rows, positions))
        _, versions = self._run(exchange, None, name)
        return PullResult({name: rows[inverse].reshape(*indices.shape, *layout.shape[1:])}, versions)

    def push(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
    ) -> PushSummary:
        """Applies gradients on the servers. Each shard applies a given ``key`` at most
        once, so a retried or replayed push is acknowledged but never applied twice.
        ``base_versions`` (from the pull the gradients came from) lets servers count staleness."""
        summary, _ = self.push_and_pull(gradients, (), key=key, base_versions=base_versions)
        return summary

    def push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[PushSummary, PullResult]:
        """``push(gradients)``, then reads the variables ``names`` as each server holds them
        once the push is applied there: one round trip per server when the payloads are
        under ``ClientConfig.max_unary_bytes``, else a push stream then a pull stream.
        ``out``: where to read them, as for ``pull``."""
        return self.start_push_and_pull(gradients, names, key=key, base_versions=base_versions, out=out).result()

    def start_push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> "PendingExchange":
        """``push_and_pull`` in two halves: sends every server's request on its data plane now
        and returns; ``result()`` reads the replies (into ``out``) and runs what could not be
        sent that way, with the usual retries. Between the two the caller may compute (the
        servers apply meanwhile), but must not change ``gradients`` or read ``out``; the
        exchange keeps the gradient tensors alive. ``abandon()`` instead drops the replies
        (closing their connections): whether the push was applied is then unknown, and a
        retry under the same ``key`` applies it at most once."""
        exchange = _Exchange()
        for name, gradient in gradients.items():
            for server, part in _push_parts(self._wire_of(self.layout(name)), gradient, base_versions or {}):
                exchange.push(server, part)
        self._add_reads(exchange, names, out)
        variable = next(iter(gradients)) if len(gradients) == 1 else None
        key = key or uuid.uuid4().hex
        sent = self._send_steps(exchange.by_server, key)

        def finish() -> tuple[PushSummary, PullResult]:
            outcomes, versions = self._finish(exchange, sent, key, variable)
            return PushSummary(tuple(outcomes)), PullResult(exchange.outputs, versions)

        def abandon() -> None:
            for server, _work, connection in sent:
                assert self._links is not None  # a step is sent only on a data plane
                self._links.forget(server, connection)

        return PendingExchange(finish, abandon, keep=gradients)

    def _add_reads(self, exchange: _Exchange, names: Sequence[str], out: Mapping[str, torch.Tensor] | None) -> None:
        for layout in (self.layout(n) for n in names):
            output = exchange.outputs[layout.name] = _read_destination(layout, (out or {}).get(layout.name))
            whole = writable_byte_view(output)  # contiguous: each shard's bytes are a range of it
            for shard, wire in zip(layout.shards, self._wire_of(layout).shards):
                rows = output[shard.row_start : shard.row_start + shard.num_rows] if layout.shape else output
                exchange.read(shard.server, wire.item, rows, wire.ref, whole[wire.start : wire.end], wire)

    def _wire_of(self, layout: VariableLayout) -> "_LayoutWire":
        """The wire messages of ``layout``'s shards, made once per layout: a step builds none."""
        wire = self._wire.get(layout.name)
        if wire is None or wire.layout is not layout:
            wire = self._wire[layout.name] = _LayoutWire.of(layout)
        return wire

    def _run(self, exchange: _Exchange, key: str | None, variable: str | None) -> tuple[list[PushOutcome], dict[ShardRef, int]]:
        """Runs each server's share of ``exchange``. Shares go to the servers' data planes
        first (up to their frame limit), all sent before any reply is read; the rest, and any
        share whose connection broke, run on the thread pool with retries: on the data plane
        again, else one Step RPC for shares under ``max_unary_bytes``, else streams."""
        key = key or ""
        return self._finish(exchange, self._send_steps(exchange.by_server, key), key, variable)

    def _finish(self, exchange: _Exchange, sent: list["_SentStep"], key: str,
                variable: str | None) -> tuple[list[PushOutcome], dict[ShardRef, int]]:
        """Reads the replies of the steps ``_send_steps`` sent, then runs the rest of
        ``exchange`` the way with retries (see ``_run``)."""
        limit = self.config.chunk_bytes if self.config.max_unary_bytes is None else self.config.max_unary_bytes

        def call(server: int, work: _ServerWork) -> _StepResult:
            on_data_plane = self._data_plane_step(server, work, key)
            if on_data_plane is not None:
                return on_data_plane
            if work.nbytes() <= limit:
                return self._stubs[server].step(work, key, self._call_options())
            pushed: list[PushOutcome] = []
            stub = self._stubs[server]
            if work.parts:
                chunk_bytes = self.config.chunk_bytes
                headed = [(tensor_pb2.PartHeader(push=part.message()), part.pieces) for part in work.parts]
                pushed = _outcomes(stub.push(lambda: encode_parts(iter(headed), chunk_bytes), key,
                                             self._call_options()).results)
            versions = stub.pull(work.pull_request(self.config.chunk_bytes), work.destinations, self._call_options()) \
                if work.items else {}
            return pushed, versions

        done, errors = self._receive_steps(sent, variable)
        rest = {server: work for server, work in exchange.by_server.items() if server not in done}
        try:
            done.update(self._fan_out(rest, call, variable=variable))
        except ParamServeError as err:
            errors.append(err)
        if errors:
            raise errors[0]
        outcomes: list[PushOutcome] = []
        versions: dict[ShardRef, int] = {}
        for result in done.values():
            if result is None:
                continue
            pushed, read = result
            outcomes += pushed
            versions.update(read)
        return outcomes, versions

    def _send_steps(self, works: Mapping[int, _ServerWork], key: str) -> list["_SentStep"]:
        """One attempt of each step on the data planes, in the calling thread: every request is
        sent before any reply is read (``_receive_steps``), so the servers work at once. Leaves
        out servers whose data plane is unknown, absent or broken, and steps over its frame
        limit: those go the way with retries."""
        sent: list[_SentStep] = []
        if self._links is None or not works:
            return sent
        for server, work in works.items():
            try:
                connection = self._links.acquire(server)
                if connection is None:
                    continue
            except (TransportError, grpc.RpcError, ParamServeError):
                continue  # the retrying way asks again, and says what is wrong
            if not connection.fits(work.nbytes()):
                self._links.release(server, connection)
                continue
            try:
                connection.send_step(*_step_frame(work, key, connection.programs))
            except TransportError:
                self._links.forget(server, connection)
                continue
            sent.append((server, work, connection))
        return sent

    def _receive_steps(self, sent: Sequence["_SentStep"],
                       variable: str | None) -> tuple[dict[int, _StepResult | None], list[ParamServeError]]:
        """The replies of ``sent``: results by server (None for a typed error, which is in the
        list), leaving out servers whose connection broke (those go the way with retries)."""
        done: dict[int, _StepResult | None] = {}
        errors: list[ParamServeError] = []
        links = self._links
        if not sent or links is None:  # a step is sent only on a data plane
            return done, errors
        for server, work, connection in sent:
            try:
                done[server] = _receive_step(connection, work)
            except TransportError:
                links.forget(server, connection)
                continue
            except ParamServeError as err:
                links.release(server, connection)
                err.server = err.server or self.addresses[server]
                err.variable = err.variable or variable
                errors.append(err)
                done[server] = None
                continue
            links.release(server, connection)
        return done, errors

    def _data_plane_step(self, server: int, work: _ServerWork, key: str) -> _StepResult | None:
        """One attempt of one server's step on its data plane; None when it has none, or when
        the step is over its frame limit."""
        links = self._links
        connection = links.acquire(server) if links is not None else None
        if links is None or connection is None:
            return None
        if not connection.fits(work.nbytes()):
            links.release(server, connection)
            return None
        try:
            connection.send_step(*_step_frame(work, key, connection.programs))
            result = _receive_step(connection, work)
        except TransportError:
            links.forget(server, connection)
            raise
        except ParamServeError:
            links.release(server, connection)
            raise
        links.release(server, connection)
        return result

    def _data_plane_info(self, server: int) -> ps_pb2.DataPlaneInfo | None:
        """What ``server`` says of its data plane; None for a server without the RPC."""
        try:
            return self._stubs[server].unary("GetDataPlane", ps_pb2.GetDataPlaneRequest(), ps_pb2.DataPlaneInfo,
                                             self._call_options())
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise

    # ------------------------------------------------------------------ state

    def export(self) -> dict[int, list[ShardState]]:
        """Every shard with its optimizer state, by server (for checkpoints)."""
        return self._fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: self._stubs[server].export(self.config.chunk_bytes, self._call_options()),
        )

    def list_shards(self) -> dict[int, list[ShardInfo]]:
        return self._fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: [convert.info_from_proto(i) for i in self._stubs[server].list_shards(self._call_options()).shards],
        )

    def probe(self, server: int, timeout: float, *, shards: bool = False) -> tuple[str, list[ShardInfo]] | None:
        """One call of server ``server`` within ``timeout`` seconds, no retries: its store's
        incarnation (and with ``shards`` the shards it holds), or None when it does not answer.
        A health check that also tells a restarted server: it answers with a new incarnation."""
        options = _CallOptions(self.config.token, timeout, timeout)
        request = ps_pb2.ListShardsRequest(incarnation_only=not shards)
        try:
            reply = self._stubs[server].unary("ListShards", request, ps_pb2.ListShardsResponse, options)
        except grpc.RpcError as err:
            if err.code() in RETRYABLE_CODES:
                return None
            raise typed_error(err, self.addresses[server], None) from None
        return reply.incarnation, [convert.info_from_proto(i) for i in reply.shards]

    def save(self, directory: str, keep: int = 0) -> dict[int, str]:
        """Each server saves its shards under ``directory/ps-<i>`` on its own filesystem."""
        return self._fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: self._stubs[server].unary(
                "Save", ps_pb2.SaveRequest(directory=f"{directory}/ps-{server}", keep=keep), ps_pb2.SaveResponse, self._call_options()
            ).path,
        )

    def restore(self, path: str, layouts: Sequence[VariableLayout]) -> None:
        """Loads ``layouts``' shards from a checkpoint directory the servers can read,
        re-partitioning when the checkpoint was written with another layout."""
        targets: dict[int, list[ps_pb2.RestoreTarget]] = defaultdict(list)
        for layout in layouts:
            for shard in layout.shards:
                targets[shard.server].append(ps_pb2.RestoreTarget(ref=convert.ref_to_proto(layout.ref(shard)), row_start=shard.row_start, num_rows=shard.num_rows))
        self._fan_out(
            targets,
            lambda server, items: self._stubs[server].unary(
                "Restore", ps_pb2.RestoreRequest(path=path, targets=items), ps_pb2.RestoreResponse, self._call_options()
            ),
        )
        self.adopt_layouts({l.name: l for l in layouts})

    def set_hyperparameters(self, values: Mapping[str, float], variable: str | None = None) -> int:
        request = ps_pb2.SetHyperparametersRequest(variable=variable or "", values_json=json.dumps(dict(values)))
        results = self._fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: self._stubs[server].unary("SetHyperparameters", request, ps_pb2.SetHyperparametersResponse, self._call_options()).shards_updated,
            variable=variable,
        )
        return sum(results.values())

    def delete_variable(self, name: str) -> None:
        layout = self.layout(name)
        servers = {s.server: None for s in layout.shards}
        self._fan_out(
            servers,
            lambda server, _: self._stubs[server].unary("DeleteVariable", ps_pb2.DeleteVariableRequest(variable=name), ps_pb2.DeleteVariableResponse, self._call_options()),
            variable=name,
        )
        with self._lock:
            self._layouts.pop(name, None)

    def close(self) -> None:
        if self._links is not None:
            self._links.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "ParameterServerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _open_channel(self, address: str) -> grpc.Channel:
        return open_channel(address, self.config.client_tls(), channel_options(self.config.max_message_bytes))

    def _call_options(self) -> "_CallOptions":
        return _CallOptions(self.config.token, self.config.call_timeout, self.config.retry_deadline)

    def _fan_out(self, work: Mapping[int, _T], call: Callable[[int, _T], _R], *,
                 variable: str | None = None) -> dict[int, _R]:
        """Runs call(server, work) for every server concurrently (the calling thread takes one
        share itself: one thread hand-off less); raises the first typed error."""
        def run(server: int, item: _T) -> _R:
            try:
                return _with_retries(lambda: call(server, item), self.config.retry_deadline, self.addresses[server])
            except grpc.RpcError as err:
                raise typed_error(err, self.addresses[server], variable) from None
            except TransportError as err:
                raise ServerUnavailableError(
                    f"parameter server unreachable (data plane: {err}); check that it runs and the address is right",
                    server=self.addresses[server], variable=variable) from None
            except ParamServeError as err:
                err.server = err.server or self.addresses[server]
                err.variable = err.variable or variable
                raise

        shares = list(work.items())
        if not shares:
            return {}
        pending = {server: self._pool.submit(run, server, item) for server, item in shares[:-1]}
        results: dict[int, _R] = {}
        errors: list[ParamServeError] = []
        last_server, last_item = shares[-1]
        try:
            results[last_server] = run(last_server, last_item)
        except ParamServeError as err:
            errors.append(err)
        for server, future in pending.items():
            try:
                results[server] = future.result()
            except ParamServeError as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return results


_SentStep = tuple[int, "_ServerWork", DataPlaneConnection]
"""A step sent on a data plane whose reply is not read yet: (server, work, connection)."""


def _index_error(name: str, index: int, rows: int) -> IndexOutOfRangeError:
    return IndexOutOfRangeError(f"row index {index} is outside [0, {rows})", variable=name)


def _read_destination(layout: VariableLayout, given: torch.Tensor | None) -> torch.Tensor:
    """Where a pulled variable lands: the caller's host tensor, checked to fit, or a new one."""
    if given is None:
        return torch.empty(layout.shape, dtype=layout.dtype)
    if tuple(given.shape) != layout.shape:
        raise ShapeMismatchError(f"the destination has shape {tuple(given.shape)}, the servers hold {layout.shape}",
                                 variable=layout.name)
    if given.dtype != layout.dtype:
        raise DtypeMismatchError(f"the destination holds {given.dtype}, the servers hold {layout.dtype}",
                                 variable=layout.name)
    if given.device.type != "cpu" or not given.is_contiguous():
        raise InvalidRequestError(f"a pull destination must be a contiguous host tensor, got one on {given.device}",
                                  variable=layout.name)
    return given


@dataclass(frozen=True)
class _CallOptions:
    token: str | None
    timeout: float
    retry_deadline: float

    def metadata(self, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        metadata = list(extra)
        if self.token:
            metadata.append(bearer_metadata(self.token))
        return metadata


class _RowScatter:
    """A pull destination that scatters received rows to positions of a larger tensor."""

    def __init__(self, target: torch.Tensor, positions: torch.Tensor):
        self.target = target
        self.positions = positions


class _Stub:
    """Raw-bytes multicallables for one server (the hot path skips protobuf for tensor data)."""

    def __init__(self, channel: grpc.Channel):
        prefix = f"/{SERVICE_NAME}/"
        self._channel = channel
        self._prefix = prefix
        self._create = channel.stream_unary(prefix + "CreateShards", response_deserializer=ps_pb2.CreateShardsResponse.FromString)
        self._replace = channel.stream_unary(prefix + "ReplaceShards", response_deserializer=ps_pb2.CreateShardsResponse.FromString)
        self._pull = channel.unary_stream(prefix + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString)
        self._push = channel.stream_unary(prefix + "Push", response_deserializer=ps_pb2.PushResponse.FromString)
        self._step = channel.unary_unary(prefix + "Step")
        self._export = channel.unary_stream(prefix + "ExportShards", request_serializer=ps_pb2.ExportShardsRequest.SerializeToString)
        self._unary: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def create_shards(self, make_chunks: Callable[[], Iterator[bytes]], options: _CallOptions, *,
                      replace: bool = False) -> ps_pb2.CreateShardsResponse:
        call = self._replace if replace else self._create
        return call(make_chunks(), timeout=options.timeout, metadata=options.metadata())

    def push(self, make_chunks: Callable[[], Iterator[bytes]], key: str, options: _CallOptions) -> ps_pb2.PushResponse:
        return self._push(make_chunks(), timeout=options.timeout, metadata=options.metadata((IDEMPOTENCY_METADATA_KEY, key)))

    def pull(self, request: ps_pb2.PullRequest, destinations: list[_Destination],
             options: _CallOptions) -> dict[ShardRef, int]:
        stream = self._pull(request, timeout=options.timeout, metadata=options.metadata())
        return _receive_pulled(stream, list(request.items), destinations)

    def step(self, work: _ServerWork, key: str, options: _CallOptions) -> _StepResult:
        request = encode_step_request(_step_plan(work, key), _pushed_bytes(work))
        return _step_result(self._step(request, timeout=options.timeout, metadata=options.metadata()), work)

    def export(self, chunk_bytes: int, options: _CallOptions) -> list[ShardState]:
        request = ps_pb2.ExportShardsRequest(chunk_bytes=chunk_bytes)
        stream = self._export(request, timeout=options.timeout, metadata=options.metadata())
        return [
            convert.shard_state_from_part(header.shard, payload)
            for header, payload in read_parts(stream, lambda h: byte_buffer(h.payload_bytes))
        ]

    def list_shards(self, options: _CallOptions) -> ps_pb2.ListShardsResponse:
        return self.unary("ListShards", ps_pb2.ListShardsRequest(), ps_pb2.ListShardsResponse, options)

    def unary(self, method: str, request, response_cls, options: _CallOptions):  # type: ignore[no-untyped-def]
        callable_ = self._unary.get(method)
        if callable_ is None:
            callable_ = self._channel.unary_unary(
                self._prefix + method,
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            self._unary[method] = callable_
        return callable_(request, timeout=options.timeout, metadata=options.metadata())


_Destination = Union[torch.Tensor, "_RowScatter"]
_StepResult = tuple[list[PushOutcome], dict[ShardRef, int]]
"""One server's step: its push results, and the version each shard read was at."""


@dataclass(slots=True, eq=False)
class _Part:
    """One push part: its bytes, and either its shard's wire messages (a dense push of a whole
    shard, which a step program names) or its own message (a sparse or converted push)."""

    pieces: list[memoryview]
    base_version: int
    wire: "_ShardWire | None" = None
    built: tensor_pb2.PushPart | None = None

    def message(self) -> tensor_pb2.PushPart:
        if self.built is None:
            assert self.wire is not None
            self.built = tensor_pb2.PushPart(ref=self.wire.ref_proto, values=self.wire.meta, base_version=self.base_version)
        return self.built


def _outcomes(results: Iterable[ps_pb2.PushResult]) -> list[PushOutcome]:
    return [PushOutcome(convert.ref_from_proto(r.ref), r.applied, int(r.version), int(r.staleness)) for r in results]


def _step_plan(work: "_ServerWork", key: str) -> ps_pb2.StepPlan:
    return ps_pb2.StepPlan(idempotency_key=key, push=[part.message() for part in work.parts], pull=work.items)


def _pushed_bytes(work: "_ServerWork") -> list[memoryview]:
    """The pushed parts' bytes (not copied), in plan order."""
    return [piece for part in work.parts for piece in part.pieces]


def _step_frame(work: "_ServerWork", key: str, programs: ProgramNumbers) -> tuple[bytes, list[memoryview]]:
    """``work`` as a data-plane step: the StepPlan's bytes and the pushed bytes. A step of whole
    dense shards is a step program of the connection (psserver/programs.py): defined the first
    time, then run by number (``work.program`` records which, for reading the reply)."""
    signature = work.signature()
    if signature is None:
        work.program = None
        return _step_plan(work, key).SerializeToString(), _pushed_bytes(work)
    number, defined = programs.number(signature)
    work.program = (programs, signature, number)
    if defined:
        bases = [part.base_version for part in work.parts]
        plan = ps_pb2.StepPlan(run_program=number, idempotency_key=key,
                               base_versions=bases if any(base >= 0 for base in bases) else ())
    else:
        plan = _step_plan(work, key)
        plan.define_program = number
    return plan.SerializeToString(), _pushed_bytes(work)


def _step_result(reply: bytes | memoryview, work: "_ServerWork") -> _StepResult:
    """Decodes a Step RPC's packed StepReply into ``work``'s destinations."""
    outcome, payload = decode_step_reply(reply)
    views, finish = _placement(work, outcome, len(payload))
    offset = 0
    for view in views:
        view[:] = payload[offset : offset + len(view)]
        offset += len(view)
    return finish()


def _receive_step(connection: DataPlaneConnection, work: "_ServerWork") -> _StepResult:
    """Reads a data-plane reply for ``work``, its pulled bytes straight into their places
    (``_placement``). Raises InvalidRequestError for a reply that does not match the reads."""
    finished: list[Callable[[], _StepResult]] = []

    def place(header: memoryview, payload_bytes: int) -> list[memoryview]:
        try:
            outcome = ps_pb2.StepOutcome.FromString(bytes(header))
        except DecodeError as err:
            raise InvalidRequestError(f"the server's StepOutcome does not parse: {err}") from None
        views, finish = _placement(work, outcome, payload_bytes) if work.program is None else \
            _program_placement(work, outcome, payload_bytes)
        finished.append(finish)
        return views

    connection.receive_reply(place)
    return finished[0]()


def _program_placement(work: "_ServerWork", outcome: ps_pb2.StepOutcome,
                       payload_bytes: int) -> tuple[list[memoryview], Callable[[], _StepResult]]:
    """``_placement`` for a step program's reply (``ProgramOutcome``: the results in the
    program's order). Marks the program defined on the connection once the server answered."""
    assert work.program is not None
    programs, signature, number = work.program
    result = outcome.program
    parts, reads = len(work.parts), len(work.items)
    if not outcome.HasField("program") or (len(result.applied), len(result.versions), len(result.staleness),
                                            len(result.pulled_versions)) != (parts, parts, parts, reads):
        raise InvalidRequestError(f"the server's reply does not answer step program {number} "
                                  f"({parts} pushes, {reads} reads)")
    views = cast(list[memoryview], work.views)
    expected = sum(len(view) for view in views)
    if payload_bytes != expected:
        raise InvalidRequestError(f"the server's reply holds {payload_bytes} bytes, step program {number} reads {expected}")
    programs.defined(signature, number)

    def finish() -> _StepResult:
        pushed = [PushOutcome(cast(_ShardWire, part.wire).ref, applied, version, staleness)
                  for part, applied, version, staleness in zip(work.parts, result.applied, result.versions, result.staleness)]
        return pushed, dict(zip(cast(list[ShardRef], work.refs), result.pulled_versions))

    return [view for view in views if len(view)], finish


def _placement(work: "_ServerWork", outcome: ps_pb2.StepOutcome,
               payload_bytes: int) -> tuple[list[memoryview], Callable[[], _StepResult]]:
    """Where a step reply's pulled bytes go, in order (adding up to ``payload_bytes``), and
    what finishes the step once they are there. A read whose destination is a contiguous range
    (``work.views``) or tensor takes its bytes in place, with no copy after the one out of the
    message; others go through a buffer, then into their destination. Raises
    InvalidRequestError for a reply that does not match the reads asked for."""
    views: list[memoryview] = []
    later: list[tuple[_Destination, torch.Tensor, tensor_pb2.TensorMeta]] = []
    versions: dict[ShardRef, int] = {}
    total = 0
    for part in outcome.pulled:
        if not 0 <= part.item < len(work.destinations):
            raise InvalidRequestError(f"the server answered for item {part.item} of {len(work.destinations)}")
        destination, view, ref = work.destinations[part.item], work.views[part.item], work.refs[part.item]
        size = meta_nbytes(part.meta)
        expected = len(view) if view is not None else _destination_bytes(destination)
        if size != expected:
            raise InvalidRequestError(f"the server sent {size} bytes for a read of {expected}")
        total += size
        versions[ref if ref is not None else convert.ref_from_proto(work.items[part.item].ref)] = int(part.version)
        if not size:
            continue
        if view is not None:
            views.append(view)
        elif isinstance(destination, torch.Tensor) and destination.is_contiguous():
            views.append(writable_byte_view(destination))
        else:
            buffer = byte_buffer(size)
            views.append(writable_byte_view(buffer))
            later.append((destination, buffer, part.meta))
    if total != payload_bytes:
        raise InvalidRequestError(f"the server's reply holds {payload_bytes} bytes, its parts describe {total}")

    def finish() -> _StepResult:
        for destination, buffer, meta in later:
            value = tensor_from_bytes(buffer, meta)
            if isinstance(destination, _RowScatter):
                destination.target[destination.positions] = value
            else:
                destination.copy_(value.reshape(destination.shape))
        return _outcomes(outcome.pushed), versions

    return views, finish


def _host_of(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too): where a server's data plane is reached."""
    host = address.rpartition(":")[0] or address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass
class _ServerWork:
    """One server's share of an exchange: push parts to apply, then shards to read into destinations."""

    parts: list[_Part] = field(default_factory=list)
    items: list[ps_pb2.PullItem] = field(default_factory=list)
    read_wires: list["_ShardWire | None"] = field(default_factory=list)
    """Each read's shard wire when it reads a whole shard (a step program can name it)."""
    program: tuple[ProgramNumbers, tuple[object, ...], int] | None = None
    """The step program the last data-plane frame of this work named: (table, signature, number)."""
    destinations: list[_Destination] = field(default_factory=list)
    refs: list[ShardRef | None] = field(default_factory=list)
    """Each read's shard, when the caller knows it (else parsed from its item)."""
    views: list[memoryview | None] = field(default_factory=list)
    """Each read's bytes in its destination, when it is a contiguous range there (the data
    plane receives straight into it)."""

    def nbytes(self) -> int:
        """Payload bytes both ways (what decides between one unary message and streams)."""
        pushed = sum(len(piece) for part in self.parts for piece in part.pieces)
        return pushed + sum(len(v) if v is not None else _destination_bytes(d) for v, d in zip(self.views, self.destinations))

    def signature(self) -> tuple[object, ...] | None:
        """What identifies this work as a step program: its push parts' and reads' shard wires
        (cached per layout, compared by identity), or None when a part or a read is not of a
        whole dense shard with a place to land, or when the step is too large for a program."""
        if not fits_a_program(len(self.parts) + len(self.items)):
            return None
        wires: list[object] = []
        for part in self.parts:
            if part.wire is None:
                return None
            wires.append(part.wire)
        wires.append(None)  # pushes | reads
        for wire, view in zip(self.read_wires, self.views):
            if wire is None or view is None:
                return None
            wires.append(wire)
        return tuple(wires)

    def pull_request(self, chunk_bytes: int) -> ps_pb2.PullRequest:
        return ps_pb2.PullRequest(items=self.items, chunk_bytes=chunk_bytes)


@dataclass
class _Exchange:
    """What one client call does on each server, and the tensors its reads fill."""

    by_server: dict[int, _ServerWork] = field(default_factory=lambda: defaultdict(_ServerWork))
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def push(self, server: int, part: _Part) -> None:
        self.by_server[server].parts.append(part)

    def read(self, server: int, item: ps_pb2.PullItem, destination: _Destination, ref: ShardRef | None = None,
             view: memoryview | None = None, wire: "_ShardWire | None" = None) -> None:
        work = self.by_server[server]
        work.read_wires.append(wire)
        work.items.append(item)
        work.destinations.append(destination)
        work.refs.append(ref)
        work.views.append(view)


@dataclass(frozen=True, eq=False)
class _ShardWire:
    ref: ShardRef
    ref_proto: tensor_pb2.ShardRef
    item: ps_pb2.PullItem
    meta: tensor_pb2.TensorMeta
    """The shard's value as it travels (the layout's dtype)."""
    start: int
    end: int
    """Its bytes within the whole variable's (row-major: shards are row ranges)."""


@dataclass(frozen=True)
class _LayoutWire:
    """A layout's per-shard wire messages, built once (a step reuses them)."""

    layout: VariableLayout
    shards: tuple[_ShardWire, ...]

    @staticmethod
    def of(layout: VariableLayout) -> "_LayoutWire":
        element = torch.empty((), dtype=layout.dtype).element_size()
        row_bytes = element * math.prod(layout.shape[1:]) if layout.shape else element
        shards = []
        for shard in layout.shards:
            ref = layout.ref(shard)
            ref_proto = convert.ref_to_proto(ref)
            shape = layout.shard_shape(shard)
            start = shard.row_start * row_bytes if layout.shape else 0
            end = start + (shard.num_rows * row_bytes if layout.shape else element)
            shards.append(_ShardWire(ref, ref_proto, ps_pb2.PullItem(ref=ref_proto),
                                     tensor_pb2.TensorMeta(dtype=dtype_name(layout.dtype), shape=list(shape)), start, end))
        return _LayoutWire(layout, tuple(shards))


def _destination_bytes(destination: _Destination) -> int:
    if isinstance(destination, _RowScatter):
        row = destination.target[0] if destination.target.dim() else destination.target
        return destination.positions.numel() * row.numel() * destination.target.element_size()
    return destination.numel() * destination.element_size()


def _receive_pulled(chunks: Iterable[bytes | memoryview], items: Sequence[ps_pb2.PullItem],
                    destinations: Sequence[_Destination]) -> dict[ShardRef, int]:
    """Fills ``destinations`` from PulledPart chunks (a Pull stream or a StepReply); returns the
    version each shard was read at. Whole-shard reads land straight in their destination."""
    versions: dict[ShardRef, int] = {}

    def allocate(header: tensor_pb2.PartHeader) -> torch.Tensor:
        if not 0 <= header.pulled.item < len(destinations):
            raise InvalidRequestError(f"the server answered for item {header.pulled.item} of {len(destinations)}")
        destination = destinations[header.pulled.item]
        expected = _destination_bytes(destination)
        if header.payload_bytes != expected:
            raise InvalidRequestError(f"the server sent {header.payload_bytes} bytes for a read of {expected}")
        if isinstance(destination, torch.Tensor) and destination.is_contiguous() and destination.numel():
            return destination.reshape(-1).view(torch.uint8)  # write straight into the result
        return byte_buffer(header.payload_bytes)

    for header, payload in read_parts(chunks, allocate):
        part = header.pulled
        versions[convert.ref_from_proto(items[part.item].ref)] = int(part.version)
        destination = destinations[part.item]
        if isinstance(destination, _RowScatter):
            destination.target[destination.positions] = tensor_from_bytes(payload, part.meta)
        elif payload.data_ptr() != destination.data_ptr() or not destination.numel():
            destination.copy_(tensor_from_bytes(payload, part.meta).reshape(destination.shape))
    return versions


def _push_parts(wire: _LayoutWire, gradient: torch.Tensor | RowGradient,
                base_versions: Mapping[ShardRef, int]) -> Iterator[tuple[int, _Part]]:
    layout = wire.layout
    if isinstance(gradient, RowGradient):
        indices = gradient.indices.reshape(-1).to(torch.int64)
        values = gradient.values.reshape(indices.numel(), *layout.shape[1:]).detach().cpu()
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= layout.shape[0]):
            bad = int(indices[(indices < 0) | (indices >= layout.shape[0])][0])
            raise _index_error(layout.name, bad, layout.shape[0])
        for shard, positions in _group_rows(layout, indices):
            local = (indices[positions] - shard.row_start).contiguous()
            rows_values = values[positions].contiguous()
            ref = layout.ref(shard)
            base = base_versions.get(ref, -1)
            part = tensor_pb2.PushPart(ref=convert.ref_to_proto(ref), values=meta_of(rows_values), sparse=True,
                                       num_indices=local.numel(), base_version=base)
            yield shard.server, _Part([tensor_payload(local), tensor_payload(rows_values)], base, built=part)
        return
    gradient = gradient.detach().cpu()
    if tuple(gradient.shape) != layout.shape:
        raise ShapeMismatchError(f"gradient has shape {tuple(gradient.shape)}, the variable {layout.shape}", variable=layout.name)
    if gradient.dtype == layout.dtype and gradient.is_contiguous():  # the common case: byte ranges of one view
        whole = as_byte_view(gradient)
        for shard, shard_wire in zip(layout.shards, wire.shards):
            base = base_versions.get(shard_wire.ref, -1) if base_versions else -1
            yield shard.server, _Part([whole[shard_wire.start : shard_wire.end]], base, wire=shard_wire)
        return
    for shard in layout.shards:
        piece = gradient[shard.row_start : shard.row_start + shard.num_rows] if layout.shape else gradient
        ref = layout.ref(shard)
        base = base_versions.get(ref, -1)
        part = tensor_pb2.PushPart(ref=convert.ref_to_proto(ref), values=meta_of(piece), base_version=base)
        yield shard.server, _Part([tensor_payload(piece)], base, built=part)


def _group_rows(layout: VariableLayout, indices: torch.Tensor) -> Iterator[tuple[ShardPlacement, torch.Tensor]]:
    """(shard, positions in indices) for every shard that some index falls in."""
    owners = torch.bucketize(indices, layout.row_starts(), right=True) - 1
    for shard_index in torch.unique(owners).tolist():
        yield layout.shards[shard_index], (owners == shard_index).nonzero().reshape(-1)


def layouts_from_infos(infos_by_server: Mapping[int, Sequence[ShardInfo]]) -> dict[str, VariableLayout]:
    """Reconstructs variable layouts from what each server reports holding."""
    found: dict[str, list[tuple[ShardInfo, int]]] = defaultdict(list)
    for server, infos in infos_by_server.items():
        for info in infos:
            found[info.ref.variable].append((info, server))
    layouts = {}
    for name, entries in found.items():
        entries.sort(key=lambda e: e[0].ref.shard)
        first = entries[0][0]
        shards = tuple(
            ShardPlacement(info.ref.shard, server, info.row_start, info.shape[0] if info.shape else 0)
            for info, server in entries
        )
        layouts[name] = VariableLayout(name, first.variable_shape, first.dtype, shards)
    return layouts


def _with_retries(fn: Callable[[], _T], deadline: float, address: str) -> _T:
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_is_retryable),
        wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
        stop=tenacity.stop_after_delay(deadline),
        reraise=True,
        before_sleep=lambda state: log.warning(
            "retrying call to %s after %s (attempt %d)", address,
            _describe(state.outcome.exception() if state.outcome else None), state.attempt_number
        ),
    )
    return retrying(fn)


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, TransportError) or (isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES)


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


def typed_error(err: grpc.RpcError, server: str, variable: str | None) -> ParamServeError:
    """The paramserve error a failed RPC stands for (by the server's trailing metadata, else its code)."""
    trailers = dict(err.trailing_metadata() or ())
    code = err.code()
    cls = ERROR_TYPES.get(str(trailers.get(ERROR_METADATA_KEY, ""))) or _CODE_ERRORS.get(code, InternalError)
    details = err.details() or code.name
    if cls is ServerUnavailableError:
        details = f"parameter server unreachable ({code.name}: {details}); check that it runs and the address is right"
    escaped = trailers.get(ERROR_VARIABLE_METADATA_KEY)
    return cls(details, variable=metadata_text(str(escaped)) if escaped else variable, server=server)
