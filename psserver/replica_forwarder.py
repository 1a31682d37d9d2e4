"""How a primary sends its writes to a backup: the backup's own RPCs, tagged with the epoch.

A forwarded write is the RPC a client would make for it (a push as a ``Step`` without reads,
or a ``Push`` stream when it is large; shards as ``CreateShards`` / ``ReplaceShards``;
``SetHyperparameters``; ``DeleteVariable``) with the ``paramserve-replica-epoch`` metadata, so
the backup applies it through the same checks and the same engine as any write
(``servicer.py`` admits it with ``Replica.admit_forwarded``), and nothing new parses tensors.
One attempt each: a write the backup did not confirm holds the primary for the coordinator's
decision (psserver/replication.py), so a retry here would only delay that decision.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from paramserve.psserver import convert
from paramserve.psserver.calls import CallOptions, Stub, typed_error
from paramserve.psserver.channels import channel_options, open_channel
from paramserve.psserver.errors import VariableNotFoundError
from paramserve.psserver.metadata import REPLICA_EPOCH_METADATA_KEY
from paramserve.psserver.security import ClientTls
from paramserve.psserver.store import ShardPush
from paramserve.psserver.streams import (
    DEFAULT_CHUNK_BYTES,
    encode_parts,
    encode_step_request,
    meta_of,
    tensor_payload,
)
from paramserve.psserver.types import ShardState
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = ["GrpcForwarder", "ForwarderSettings", "UNARY_FORWARD_BYTES"]

UNARY_FORWARD_BYTES = 16 << 20
"""A push of at most this many bytes is forwarded as one Step message, a larger one as a Push
stream of chunks (one message must stay under the backup's message limit)."""


@dataclass(frozen=True)
class ForwarderSettings:
    """How this server reaches its backups: the cluster's token, TLS roots when the servers serve
    TLS, the deadline of one forwarded write and the message limit."""

    token: str | None = None
    tls: ClientTls | None = None
    timeout: float = 10.0
    max_message_bytes: int = 64 << 20


@dataclass(frozen=True)
class _EpochOptions(CallOptions):
    epoch: int = 0

    def metadata(self, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        return super().metadata(*extra, (REPLICA_EPOCH_METADATA_KEY, str(self.epoch)))


class GrpcForwarder:
    """Forwards one primary's writes to the backup at ``address`` (psserver.replication.Forwarder)."""

    def __init__(self, address: str, settings: ForwarderSettings):
        self._address = address
        self._settings = settings
        self._channel = open_channel(address, settings.tls, channel_options(settings.max_message_bytes))
        self._stub = Stub(self._channel)

    def _options(self, epoch: int) -> _EpochOptions:
        return _EpochOptions(self._settings.token, self._settings.timeout, self._settings.timeout, epoch)

    def push(self, pushes: Sequence[ShardPush], key: str, epoch: int) -> None:
        parts = [_push_part(push) for push in pushes]
        size = sum(len(piece) for _, pieces in parts for piece in pieces)
        options = self._options(epoch)
        if size <= UNARY_FORWARD_BYTES:
            plan = ps_pb2.StepPlan(push=[part for part, _ in parts], idempotency_key=key)
            request = encode_step_request(plan, [piece for _, pieces in parts for piece in pieces])
            self._call(lambda: self._stub.step(request, options))
            return
        headed = [(tensor_pb2.PartHeader(push=part), pieces) for part, pieces in parts]
        self._call(lambda: self._stub.push(lambda: encode_parts(iter(headed), DEFAULT_CHUNK_BYTES), key, options))

    def shards(self, states: Sequence[ShardState], replace: bool, epoch: int) -> None:
        parts = [convert.shard_part(state) for state in states]
        options = self._options(epoch)
        self._call(
            lambda: self._stub.create_shards(
                lambda: encode_parts(iter(parts), DEFAULT_CHUNK_BYTES), options, replace=replace
            )
        )

    def hyperparameters(self, variable: str | None, values: Mapping[str, Any], epoch: int) -> None:
        request = ps_pb2.SetHyperparametersRequest(variable=variable or "", values_json=json.dumps(dict(values)))
        options = self._options(epoch)
        self._call(lambda: self._stub.unary("SetHyperparameters", request, ps_pb2.SetHyperparametersResponse, options))

    def delete(self, variable: str, epoch: int) -> None:
        request = ps_pb2.DeleteVariableRequest(variable=variable)
        options = self._options(epoch)
        try:
            self._call(lambda: self._stub.unary("DeleteVariable", request, ps_pb2.DeleteVariableResponse, options))
        except VariableNotFoundError:
            pass  # the backup holds none of it either

    def close(self) -> None:
        self._channel.close()

    def _call(self, call: Any) -> None:
        try:
            call()
        except grpc.RpcError as err:
            raise typed_error(err, self._address, None) from None


def _push_part(push: ShardPush) -> tuple[tensor_pb2.PushPart, list[memoryview]]:
    """A store's ShardPush as the PushPart and payload a client would have sent for it."""
    values = push.values.contiguous()
    part = tensor_pb2.PushPart(
        ref=convert.ref_to_proto(push.ref), values=meta_of(values), base_version=push.base_version
    )
    if push.rows is None:
        return part, [tensor_payload(values)]
    rows = push.rows.to(torch.int64).contiguous()
    part.sparse, part.num_indices = True, rows.numel()
    return part, [tensor_payload(rows), tensor_payload(values)]
