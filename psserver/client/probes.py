"""Probing parameter servers: answered, busy, or gone.

The coordinator's failure detector (coordinator/recovery/ps_recovery.py) asks each server for its store's
incarnation every second. An answer names the server process (a new incarnation: it restarted).
No answer is ambiguous, and this module resolves it:

- a connection refused or reset: nothing serves at the address now;
- no answer in time: either the server is busy (creating a large table, applying a large step:
  its gRPC threads are taken, but it holds its shards and will answer), or the process holding
  the connection vanished without closing it (a host gone, a cut link, a container replaced at a
  new address under the same name). So the probe is asked again on a fresh connection, which
  resolves the name anew: a replacement answers it (with its new incarnation), a busy server
  still does not, and then whether its port accepts connections tells busy (the kernel accepts
  for a listening process however busy it is) from gone.

Probes have channels of their own, so that renewing one never cancels the client's other calls.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from paramserve.psserver.client.calls import RETRYABLE_CODES, CallOptions, Stub, typed_error
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.types import ShardInfo
from paramserve.psserver.runtime.tf_config import parse_address
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = ["Prober", "ServerProbe", "accepts_connections"]


@dataclass(frozen=True)
class ServerProbe:
    """What one probe of a parameter server found."""

    incarnation: str | None
    """Its store's incarnation (new at every start); None: it did not answer in time."""
    shards: list[ShardInfo]
    """The shards it holds, when asked for."""
    reachable: bool
    """It answered, or its port accepts connections: a busy server is slow to answer, but it is
    there and holds its shards."""
    resident_bytes: int = 0
    """Its process's resident memory, when asked for its shards (0: unknown)."""


def accepts_connections(address: str, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to ``address`` ("host:port") is accepted within ``timeout``."""
    host, port = parse_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


class Prober:
    """Probes of each of ``addresses``, over channels of their own (``open_channel(address)``)."""

    def __init__(self, addresses: Sequence[str], open_channel: Callable[[str], grpc.Channel], token: str | None):
        self._addresses = tuple(addresses)
        self._open = open_channel
        self._token = token
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}

    def probe(self, server: int, timeout: float, *, shards: bool = False) -> ServerProbe:
        """Server ``server``'s incarnation (and with ``shards`` its shards) within ``timeout``
        seconds; when it does not answer in time, once more on a fresh connection, then whether it
        is busy or gone (see the module). Raises the typed error of a refusal (e.g. a bad token)."""
        request = ps_pb2.ListShardsRequest(incarnation_only=not shards)
        options = CallOptions(self._token, timeout, timeout)
        code = self._call(server, request, options)
        if isinstance(code, ServerProbe):
            return code
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._renew(server)
            code = self._call(server, request, options)
            if isinstance(code, ServerProbe):
                return code
        busy = code == grpc.StatusCode.DEADLINE_EXCEEDED and accepts_connections(self._addresses[server])
        return ServerProbe(None, [], reachable=busy)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _call(
        self, server: int, request: ps_pb2.ListShardsRequest, options: CallOptions
    ) -> ServerProbe | grpc.StatusCode:
        try:
            reply = Stub(self._channel(server)).unary("ListShards", request, ps_pb2.ListShardsResponse, options)
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE_CODES:
                raise typed_error(err, self._addresses[server], None) from None
            return err.code()
        shards = [convert.info_from_proto(i) for i in reply.shards]
        return ServerProbe(reply.incarnation, shards, reachable=True, resident_bytes=int(reply.resident_bytes))

    def _channel(self, server: int) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(server)
            if channel is None:
                channel = self._channels[server] = self._open(self._addresses[server])
            return channel

    def _renew(self, server: int) -> None:
        """Drops ``server``'s probe connection: the next probe connects afresh, resolving its name."""
        with self._lock:
            channel = self._channels.pop(server, None)
        if channel is not None:
            channel.close()
