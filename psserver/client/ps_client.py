"""The one client of the parameter servers, used by workers and the coordinator.

It knows every server, places variables on them through a partitioner, and
pulls and pushes all shards of a request in parallel (one exchange per server:
psserver/client/step_transport.py chooses how each travels). Every call has a deadline;
only retryable status codes are retried (tenacity, jittered, within an overall
deadline: psserver/client/calls.py); failures surface as the typed errors of
psserver.errors, naming the variable, the server and the cause.

It loads none of the server's modules (the store, the servicer, the step engine,
serving): a worker or a coordinator that imports it gets the client only.
"""

from __future__ import annotations

import json
import pathlib
import threading
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass

import torch

from paramserve.psserver.client.calls import CallOptions, ServerCalls, Stub
from paramserve.psserver.client.dynamic_client import DynamicTableCalls
from paramserve.psserver.client.probes import Prober, ServerProbe
from paramserve.psserver.client.step_transport import (
    DataPlaneTransport,
    StepRouter,
    StreamTransport,
    UnaryStepTransport,
)
from paramserve.psserver.client.step_work import (
    Exchange,
    LayoutWire,
    PushPart,
    ReadEntry,
    gradient_parts,
    lookup_reads,
    read_destination,
)
from paramserve.psserver.dataplane.dataplane_client import DataPlaneLinks
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import ConfigurationError, VariableNotFoundError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import (
    Partitioner,
    place_shards,
    shard_count,
    split_rows,
)
from paramserve.psserver.protocol.streams import DEFAULT_CHUNK_BYTES, encode_parts
from paramserve.psserver.protocol.tensors import writable_byte_view
from paramserve.psserver.protocol.types import (
    PendingExchange,
    PullResult,
    PushOutcome,
    PushSummary,
    RowGradient,
    ShardInfo,
    ShardPlacement,
    ShardRef,
    ShardState,
    UniqueRows,
    VariableLayout,
    layouts_from_infos,
)
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.psserver.runtime.security import ClientTls
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2


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
    (psserver/dataplane/frames.py); False: always the Step RPC."""

    def client_tls(self) -> ClientTls | None:
        """The TLS these settings describe (None: plaintext). Raises ConfigurationError for a
        client certificate without its key, or TLS client files without a CA bundle."""
        if self.tls_root_certificates is None:
            if self.tls_cert_chain is not None or self.tls_private_key is not None:
                raise ConfigurationError(
                    "a TLS client certificate needs the CA bundle that verifies the servers "
                    "too (tls_root_certificates, e.g. --ps-tls-ca)"
                )
            return None
        return ClientTls(self.tls_root_certificates, self.tls_cert_chain, self.tls_private_key, self.tls_server_name)


class ParameterServerClient:
    """Talks to every parameter server of a cluster. Thread-safe; close() when done."""

    def __init__(self, addresses: Sequence[str], config: ClientConfig | None = None):
        if not addresses:
            raise ValueError("ParameterServerClient needs at least one parameter-server address")
        self.addresses = tuple(addresses)
        self.config = config or ClientConfig()
        config = self.config
        self._options = CallOptions(config.token, config.call_timeout, config.retry_deadline)
        self._channels = [
            open_channel(a, config.client_tls(), channel_options(config.max_message_bytes)) for a in self.addresses
        ]
        self._stubs = [Stub(channel) for channel in self._channels]
        self._prober = Prober(
            self.addresses,
            lambda address: open_channel(address, config.client_tls(), channel_options(config.max_message_bytes)),
            config.token,
        )
        self._pool = futures.ThreadPoolExecutor(
            max_workers=min(config.max_parallel_calls, max(2, 2 * len(addresses))),
            thread_name_prefix="paramserve-client",
        )
        self._calls = ServerCalls(self.addresses, self._pool, config.retry_deadline)
        self._lock = threading.Lock()
        self._layouts: dict[str, VariableLayout] = {}
        self._next_server = 0
        self._wire: dict[str, LayoutWire] = {}
        self._dynamic: dict[str, tuple[int, torch.dtype]] = {}
        """Dynamic tables this client reads and pushes: name -> (dim, dtype)."""
        self._steps = self._step_router()
        self.dynamic = DynamicTableCalls(
            self.addresses, self._stubs, self._calls, self._options, self._knows_dynamic, config.chunk_bytes
        )
        """The dynamic tables' control plane: create, stats, export, replace."""

    def _step_router(self) -> StepRouter:
        """The step's three routes over this client's channels (psserver/client/step_transport.py)."""
        config = self.config
        links = (
            DataPlaneLinks(
                self.addresses,
                lambda server: self._stubs[server].data_plane_info(self._options),
                token=config.token,
                tls=config.client_tls(),
                timeout=config.call_timeout,
            )
            if config.data_plane
            else None
        )
        unary_limit = config.chunk_bytes if config.max_unary_bytes is None else config.max_unary_bytes
        return StepRouter(
            DataPlaneTransport(links) if links is not None else None,
            UnaryStepTransport(self._stubs, self._options),
            StreamTransport(self._stubs, self._options, config.chunk_bytes),
            unary_limit=unary_limit,
            calls=self._calls,
        )

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
            self._next_server = max(self._next_server, sum(len(known.shards) for known in self._layouts.values()))

    def discover(self) -> dict[str, VariableLayout]:
        """Rebuilds every variable's layout from the servers' shard lists."""
        infos = self._calls.fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: [
                convert.info_from_proto(i) for i in self._stubs[server].list_shards(self._options).shards
            ],
        )
        layouts = layouts_from_infos({server: shard_infos for server, shard_infos in infos.items()})
        self.adopt_layouts(layouts)
        return layouts

    def plan_layout(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, partitioner: Partitioner | None
    ) -> VariableLayout:
        """Decides shard row ranges and servers for a new variable (round-robin across variables)."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            return VariableLayout(name, shape, dtype, (ShardPlacement(0, self._take_servers(1)[0], 0, 0),))
        num_shards = shard_count(partitioner, shape, dtype)
        ranges = split_rows(shape[0], num_shards)
        servers = self._take_servers(len(ranges))
        shards = tuple(ShardPlacement(i, servers[i], r.start, r.stop - r.start) for i, r in enumerate(ranges))
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
            return convert.initialized_shard_part(
                ref, layout.shape, shard.row_start, shard_shape, layout.dtype, optimizer, initializer
            )
        piece = value[rows] if layout.shape else value
        state = ShardState(
            ref=ref,
            variable_shape=layout.shape,
            row_start=shard.row_start,
            value=piece,
            optimizer=optimizer,
            slots={},
            version=0,
            applied_keys=[],
        )
        return convert.shard_part(state)

    def load_states(self, states_by_server: Mapping[int, Sequence[ShardState]], *, replace: bool = False) -> None:
        """Creates shards with their full state (value, slots, version, window): restores.
        ``replace``: the variables named are replaced whole and exactly on each server, live
        or not (ReplaceShards); otherwise shards that exist are kept (CreateShards)."""
        parts = {server: [convert.shard_part(s) for s in states] for server, states in states_by_server.items()}
        self._create_parts(parts, None, replace=replace)

    def _create_parts(
        self, parts_by_server: Mapping[int, list], variable: str | None, *, replace: bool = False
    ) -> None:
        self._calls.fan_out(
            parts_by_server,
            lambda server, parts: self._stubs[server].create_shards(
                lambda: encode_parts(iter(parts), self.config.chunk_bytes), self._options, replace=replace
            ),
            variable=variable,
        )

    # ------------------------------------------------------------------ pull and push

    def pull(self, names: Sequence[str] | None = None, *, out: Mapping[str, torch.Tensor] | None = None) -> PullResult:
        """Reads whole variables (all known ones by default) from all servers in parallel.

        ``out``: host tensors to read variables into, by name (e.g. a GPU worker's pinned
        buffers; the result holds them); others are allocated. Raises ShapeMismatchError or
        DtypeMismatchError, before any call, for one that does not fit the variable."""
        exchange = Exchange()
        self._add_reads(exchange, names if names is not None else list(self.layouts), out)
        _, versions = self._run(exchange, None, names[0] if names and len(names) == 1 else None)
        return PullResult(exchange.outputs, versions)

    def pull_rows(self, name: str, indices: torch.Tensor) -> PullResult:
        """Reads rows of a variable (an embedding lookup): the result has shape
        ``indices.shape + variable.shape[1:]``. Only the distinct rows travel."""
        found, versions = self.pull_unique_rows({name: indices})
        return PullResult({name: found[name].gathered(indices.shape)}, versions)

    def pull_unique_rows(
        self, lookups: Mapping[str, torch.Tensor], *, dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None
    ) -> tuple[dict[str, UniqueRows], dict[ShardRef, int]]:
        """Reads the distinct rows of every lookup (variable name: indices of any shape) in one
        exchange per server, however many tables the lookups touch; also the version each
        shard was read at. Raises IndexOutOfRangeError, before any call, for an index outside
        its table. ``dynamic``: tables among them that are dynamic (name: dim and dtype), whose
        indices are ids (DtypeMismatchError for ids that are not integers); remembered, so
        that their gradients push by id too."""
        exchange = Exchange()
        found = self._add_lookups(exchange, lookups, dynamic)
        _, versions = self._run(exchange, None, next(iter(lookups)) if len(lookups) == 1 else None)
        return found, versions

    def _add_lookups(
        self,
        exchange: Exchange,
        lookups: Mapping[str, torch.Tensor],
        dynamic: Mapping[str, tuple[int, torch.dtype]] | None,
    ) -> dict[str, UniqueRows]:
        if dynamic:
            self._knows_dynamic(dynamic)
        return lookup_reads(exchange, lookups, self._dynamic, len(self.addresses), self._wire_of_name)

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
        once the push is applied there: one round trip per server (on its data plane, or one
        Step RPC when its share is under ``ClientConfig.max_unary_bytes``), else a push stream
        then a pull stream. ``out``: where to read them, as for ``pull``."""
        return self.start_push_and_pull(gradients, names, key=key, base_versions=base_versions, out=out).result()

    def start_push_and_pull(
        self,
        gradients: Mapping[str, torch.Tensor | RowGradient],
        names: Sequence[str],
        *,
        key: str | None = None,
        base_versions: Mapping[ShardRef, int] | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> PendingExchange:
        """``push_and_pull`` in two halves: sends every server's request on its data plane now
        and returns; ``result()`` reads the replies (into ``out``) and runs what could not be
        sent that way, with the usual retries. Between the two the caller may compute (the
        servers apply meanwhile), but must not change ``gradients`` or read ``out``; the
        exchange keeps the gradient tensors alive. ``abandon()`` instead drops the replies
        (closing their connections): whether the push was applied is then unknown, and a
        retry under the same ``key`` applies it at most once."""
        exchange = Exchange()
        for server, part in self.push_parts(gradients, base_versions):
            exchange.push(server, part)
        self._add_reads(exchange, names, out)
        variable = next(iter(gradients)) if len(gradients) == 1 else None
        in_flight = self._steps.start(exchange.by_server, key or uuid.uuid4().hex, variable)

        def finish() -> tuple[PushSummary, PullResult]:
            outcomes, versions = in_flight.result()
            return PushSummary(tuple(outcomes)), PullResult(exchange.outputs, versions)

        return PendingExchange(finish, in_flight.abandon, keep=gradients)

    def push_parts(
        self, gradients: Mapping[str, torch.Tensor | RowGradient], base_versions: Mapping[ShardRef, int] | None = None
    ) -> list[tuple[int, PushPart]]:
        """What ``gradients`` send to each server, as (server, part): checked and cut now, sent by
        ``start_push_parts_and_read_rows`` (the parts keep the gradients' memory alive)."""
        dynamic = {name: shape[0] for name, shape in self._dynamic.items()}
        return gradient_parts(gradients, base_versions or {}, dynamic, len(self.addresses), self._wire_of_name)

    def _wire_of_name(self, name: str) -> LayoutWire:
        return self._wire_of(self.layout(name))

    def start_push_parts_and_read_rows(
        self,
        parts: Sequence[tuple[int, PushPart]],
        names: Sequence[str],
        lookups: Mapping[str, torch.Tensor],
        *,
        key: str,
        dynamic: Mapping[str, tuple[int, torch.dtype]] | None = None,
    ) -> tuple[PendingExchange, dict[str, UniqueRows]]:
        """A push (``parts``) and the next step's lookups in one round trip per server: each
        server applies the push, then reads ``names`` and the rows (so they include the push).
        A bad lookup raises before anything is sent. Returns the exchange (``result()``: the
        push's summary and ``names``' values, or the typed error: a retry under ``key`` applies
        the push once) and the rows by table, filled once ``result()`` returns."""
        exchange = Exchange()
        found = self._add_lookups(exchange, lookups, dynamic)
        for server, part in parts:
            exchange.push(server, part)
        self._add_reads(exchange, names, None)
        in_flight = self._steps.start(exchange.by_server, key, None)

        def finish() -> tuple[PushSummary, PullResult]:
            outcomes, versions = in_flight.result()
            return PushSummary(tuple(outcomes)), PullResult(exchange.outputs, versions)

        return PendingExchange(finish, in_flight.abandon, keep=parts), found

    def _add_reads(self, exchange: Exchange, names: Sequence[str], out: Mapping[str, torch.Tensor] | None) -> None:
        for layout in (self.layout(n) for n in names):
            output = exchange.outputs[layout.name] = read_destination(layout, (out or {}).get(layout.name))
            whole = writable_byte_view(output)  # contiguous: each shard's bytes are a range of it
            for shard, wire in zip(layout.shards, self._wire_of(layout).shards):
                rows = output[shard.row_start : shard.row_start + shard.num_rows] if layout.shape else output
                exchange.read(shard.server, ReadEntry(wire.item, rows, wire.ref, whole[wire.start : wire.end], wire))

    def _wire_of(self, layout: VariableLayout) -> LayoutWire:
        """The wire messages of ``layout``'s shards, made once per layout: a step builds none."""
        wire = self._wire.get(layout.name)
        if wire is None or wire.layout is not layout:
            wire = self._wire[layout.name] = LayoutWire.of(layout)
        return wire

    def _run(
        self, exchange: Exchange, key: str | None, variable: str | None
    ) -> tuple[list[PushOutcome], dict[ShardRef, int]]:
        """Runs each server's share of ``exchange`` (psserver/client/step_transport.py: StepRouter)."""
        return self._steps.start(exchange.by_server, key or "", variable).result()

    # ------------------------------------------------------------------ state

    def export(self) -> dict[int, list[ShardState]]:
        """Every shard with its optimizer state, by server (for checkpoints)."""
        return self._calls.fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: self._stubs[server].export(self.config.chunk_bytes, self._options),
        )

    def list_shards(self) -> dict[int, list[ShardInfo]]:
        return self._calls.fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: [
                convert.info_from_proto(i) for i in self._stubs[server].list_shards(self._options).shards
            ],
        )

    def probe(self, server: int, timeout: float, *, shards: bool = False) -> ServerProbe:
        """One probe of server ``server`` (psserver/client/probes.py): its store's incarnation (and with
        ``shards`` the shards it holds), or, when it does not answer in time, whether it is busy
        or gone. A health check that also tells a restarted server: a new incarnation."""
        return self._prober.probe(server, timeout, shards=shards)

    def save(self, directory: str, keep: int = 0) -> dict[int, str]:
        """Each server saves its shards under ``directory/ps-<i>`` on its own filesystem."""
        return self._calls.fan_out(
            {server: None for server in range(len(self.addresses))},
            lambda server, _: (
                self._stubs[server]
                .unary(
                    "Save",
                    ps_pb2.SaveRequest(directory=f"{directory}/ps-{server}", keep=keep),
                    ps_pb2.SaveResponse,
                    self._options,
                )
                .path
            ),
        )

    def restore(self, path: str, layouts: Sequence[VariableLayout]) -> None:
        """Loads ``layouts``' shards from a checkpoint directory the servers can read,
        re-partitioning when the checkpoint was written with another layout."""
        targets: dict[int, list[ps_pb2.RestoreTarget]] = defaultdict(list)
        for layout in layouts:
            for shard in layout.shards:
                targets[shard.server].append(
                    ps_pb2.RestoreTarget(
                        ref=convert.ref_to_proto(layout.ref(shard)), row_start=shard.row_start, num_rows=shard.num_rows
                    )
                )
        self._calls.fan_out(
            targets,
            lambda server, items: self._stubs[server].unary(
                "Restore", ps_pb2.RestoreRequest(path=path, targets=items), ps_pb2.RestoreResponse, self._options
            ),
        )
        self.adopt_layouts({layout.name: layout for layout in layouts})

    def _knows_dynamic(self, tables: Mapping[str, tuple[int, torch.dtype]]) -> None:
        with self._lock:
            self._dynamic.update(tables)

    def set_hyperparameters(self, values: Mapping[str, float], variable: str | None = None) -> int:
        """Changes optimizer hyperparameters of ``variable`` (dense or a dynamic table) on the
        servers holding its shards, or of every variable on every server for None; returns how
        many shards changed."""
        if variable:
            return self.set_hyperparameters_of(values, [variable])
        return self._send_hyperparameters(values, {server: [""] for server in range(len(self.addresses))})

    def set_hyperparameters_of(self, values: Mapping[str, float], variables: Sequence[str]) -> int:
        """``set_hyperparameters`` of several variables in one call per server (a scheduler's
        rate for a model's variables costs one round trip, not one per variable); returns how
        many shards changed."""
        by_server: dict[int, list[str]] = {}
        for name in dict.fromkeys(variables):
            servers = (
                range(len(self.addresses)) if name in self._dynamic else {s.server for s in self.layout(name).shards}
            )
            for server in servers:
                by_server.setdefault(server, []).append(name)
        return self._send_hyperparameters(values, by_server, variables[0] if len(variables) == 1 else None)

    def _send_hyperparameters(
        self, values: Mapping[str, float], by_server: Mapping[int, Sequence[str]], variable: str | None = None
    ) -> int:
        """One SetHyperparameters call per server, naming its variables ("": every variable)."""
        text = json.dumps(dict(values))
        results = self._calls.fan_out(
            by_server,
            lambda server, names: (
                self._stubs[server]
                .unary(
                    "SetHyperparameters",
                    ps_pb2.SetHyperparametersRequest(variable=names[0], variables=names[1:], values_json=text),
                    ps_pb2.SetHyperparametersResponse,
                    self._options,
                )
                .shards_updated
            ),
            variable=variable,
        )
        return sum(results.values())

    def delete_variable(self, name: str) -> None:
        if name in self._dynamic:
            servers = {server: None for server in range(len(self.addresses))}
        else:
            servers = {s.server: None for s in self.layout(name).shards}
        self._calls.fan_out(
            servers,
            lambda server, _: self._stubs[server].unary(
                "DeleteVariable",
                ps_pb2.DeleteVariableRequest(variable=name),
                ps_pb2.DeleteVariableResponse,
                self._options,
            ),
            variable=name,
        )
        with self._lock:
            self._layouts.pop(name, None)
            self._dynamic.pop(name, None)

    def close(self) -> None:
        self._steps.close()
        self._prober.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> ParameterServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
