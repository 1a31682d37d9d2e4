"""gRPC channels to paramserve's servers: their options, and opening one with or without TLS.

Every process that calls a server (the parameter-server client, the coordinator's worker
transport) opens its channels here, so they all fail fast on a dead peer, reach a restarted one
within a second, and read large messages in large chunks. What TLS presents and verifies is
psserver.security's ``ClientTls``; this only puts it on the channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from paramserve.psserver.runtime.security import ClientTls

__all__ = ["KEEPALIVE_TIME_MS", "TCP_READ_OPTIONS", "channel_options", "open_aio_channel", "open_channel"]

TCP_READ_OPTIONS: list[tuple[str, Any]] = [
    # gRPC starts reading sockets 8 KiB at a time and grows slowly: a 0.5 MB message then costs
    # several times the CPU of the bytes (measured: a client receiving 0.47 MB spent 1.1 CPU-ms,
    # 0.37 with these). Tensor messages are large, so read large chunks from the start.
    ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 512 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]
"""Read sizes for both ends of a connection: servers take them too (serving.server_options)."""


KEEPALIVE_TIME_MS = 5_000
"""How often a client pings a server while a call moves no data (a long closure, a step being
applied): a peer that vanished without closing the connection (a host gone, a cut link) is
noticed within this and the 2 s the ping has to be answered, not at the call's deadline. A live
server's gRPC core answers pings however busy its Python code is."""


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Fail fast on a dead peer instead of waiting for TCP timeouts (servers allow these pings:
        # serving.server_options).
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", 2_000),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging however long a call moves no data
        # A server replaced at a new address under the same name (a container or pod comes back
        # with a new IP) is reached within about a second: gRPC re-resolves a name when a
        # connection fails, but by default at most every 30 s.
        ("grpc.dns_min_time_between_resolutions_ms", 1000),
        ("grpc.enable_retries", 0),  # retries are tenacity's job, in one place
        # A restarted peer is reached within about a second: gRPC's default reconnect backoff
        # grows to two minutes, which left workers unaware of a restarted server for ~57 s.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        *TCP_READ_OPTIONS,
    ]


def open_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``address``: TLS when ``tls`` is given, plaintext otherwise."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def open_aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    """``open_channel`` for grpc.aio (create it on the event loop that uses it)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])
