"""The coordinator's calls to the members of replicated shard groups (psserver/replication/replica.py):
ask each server its role, give it one, empty a server that rejoins, and have a primary copy its
shards into it (the primary sends them itself, shard by shard, while it serves: the coordinator
holds none of the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from paramserve.psserver.client.calls import CallOptions, EpochCallOptions, Stub, typed_error
from paramserve.psserver.client.probes import Prober
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.replica_config import ReplicaConfig
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.psserver.runtime.security import ClientTls
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = ["MemberState", "ReplicaCalls"]


@dataclass(frozen=True)
class MemberState:
    """What one server of a group answered (``answered`` False: it did not; ``busy`` then says
    whether its port still accepts connections, a server too busy to answer in time)."""

    answered: bool
    incarnation: str = ""
    config: ReplicaConfig = ReplicaConfig()
    refusing: str = ""
    busy: bool = False


class ReplicaCalls:
    """Calls to every server of the cluster, by address. Thread-safe; close() when done."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str | None,
        tls: ClientTls | None,
        timeout: float = 10.0,
        max_message_bytes: int = 64 << 20,
    ):
        self._addresses = tuple(addresses)
        self._token = token
        self._timeout = timeout
        self._channels = {
            address: open_channel(address, tls, channel_options(max_message_bytes)) for address in self._addresses
        }
        self._stubs = {address: Stub(channel) for address, channel in self._channels.items()}
        self._prober = Prober(
            self._addresses, lambda address: open_channel(address, tls, channel_options(max_message_bytes)), token
        )

    def _options(self, timeout: float | None = None) -> CallOptions:
        seconds = self._timeout if timeout is None else timeout
        return CallOptions(self._token, seconds, seconds)

    def state(self, address: str, timeout: float) -> MemberState:
        """The server's role, epoch, incarnation and whether it serves clients; when it does not
        answer within ``timeout``, whether it is busy or gone (psserver/client/probes.py)."""
        request = ps_pb2.ConfigureReplicaRequest(query=True)
        try:
            reply = self._stubs[address].unary(
                "ConfigureReplica", request, ps_pb2.ConfigureReplicaResponse, self._options(timeout)
            )
        except grpc.RpcError:
            found = self._prober.probe(self._addresses.index(address), timeout)
            return MemberState(answered=False, busy=found.reachable and found.incarnation is None)
        return _member(reply)

    def configure(self, address: str, config: ReplicaConfig) -> MemberState:
        """Gives the server ``config``; raises the typed error of a refusal or a failed call."""
        request = ps_pb2.ConfigureReplicaRequest(config=convert.replica_config_to_proto(config))
        try:
            reply = self._stubs[address].unary(
                "ConfigureReplica", request, ps_pb2.ConfigureReplicaResponse, self._options()
            )
        except grpc.RpcError as err:
            raise typed_error(err, address, None) from None
        return _member(reply)

    def wipe(self, member: str, epoch: int) -> None:
        """Deletes every variable ``member`` (a backup at ``epoch``) holds: what a server that
        rejoins kept from before is not its primary's."""
        stub = self._stubs[member]
        try:
            listed = stub.unary("ListShards", ps_pb2.ListShardsRequest(), ps_pb2.ListShardsResponse, self._options())
            options = EpochCallOptions(self._token, self._timeout, self._timeout, epoch)
            for variable in sorted({info.ref.variable for info in listed.shards}):
                request = ps_pb2.DeleteVariableRequest(variable=variable)
                stub.unary("DeleteVariable", request, ps_pb2.DeleteVariableResponse, options)
        except grpc.RpcError as err:
            raise typed_error(err, member, None) from None

    def copy_into(self, primary: str, target: str, timeout: float) -> tuple[int, int]:
        """Has ``primary`` copy its shards into ``target``, its joining backup, while it serves
        (psserver/replication/replica.py: ``Replica.copy_to``). Returns the shards and bytes copied."""
        try:
            reply = self._stubs[primary].unary(
                "CopyShards", ps_pb2.CopyShardsRequest(target=target), ps_pb2.CopyShardsResponse, self._options(timeout)
            )
        except grpc.RpcError as err:
            raise typed_error(err, primary, None) from None
        return int(reply.shards), int(reply.bytes)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _member(reply: ps_pb2.ConfigureReplicaResponse) -> MemberState:
    config = convert.replica_config_from_proto(reply.config)
    return MemberState(True, reply.incarnation, config, reply.refusing)
