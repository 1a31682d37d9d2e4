"""Probing parameter servers (psserver/client/probes.py): an answer names the server's incarnation;
without one, a server that is busy (its port accepts connections) is told from one that is gone."""

from __future__ import annotations

import socket
import threading
from concurrent import futures

import grpc

from paramserve.psserver.client.probes import Prober, accepts_connections
from paramserve.psserver.protocol.metadata import SERVICE_NAME
from paramserve.psserver.runtime.channels import channel_options, open_channel


def prober(address: str) -> Prober:
    return Prober([address], lambda a: open_channel(a, None, channel_options(4 << 20)), token=None)


def test_a_server_that_answers_names_its_incarnation_and_shards(start_ps):
    server = start_ps()
    found = prober(f"127.0.0.1:{server.port}").probe(0, timeout=5.0, shards=True)
    assert found.incarnation == server.store.incarnation and found.shards == [] and found.reachable


def test_a_busy_server_is_reachable_and_asked_again_on_a_fresh_connection():
    release, calls = threading.Event(), []

    def list_shards(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls.append(context.peer())
        release.wait(30)  # busy: every thread of its pool taken for longer than the probe waits
        return b""

    busy = grpc.server(futures.ThreadPoolExecutor(4))
    busy.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE_NAME, {"ListShards": grpc.unary_unary_rpc_method_handler(list_shards)}
            )
        ]
    )
    port = busy.add_insecure_port("127.0.0.1:0")
    busy.start()
    opened: list[grpc.Channel] = []

    def open_probe_channel(address: str) -> grpc.Channel:
        opened.append(open_channel(address, None, channel_options(4 << 20)))
        return opened[-1]

    probes = Prober([f"127.0.0.1:{port}"], open_probe_channel, token=None)
    try:
        found = probes.probe(0, timeout=0.5)
        assert found.incarnation is None and found.reachable, "busy, not gone"
        # Asked a second time, on a channel of its own (the kernel may give the new connection
        # the client port the first one had: the peer's address does not tell them apart).
        assert len(calls) == 2 and len(opened) == 2 and opened[0] is not opened[1]
    finally:
        release.set()
        probes.close()
        busy.stop(0)


def test_a_server_that_is_gone_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    assert not accepts_connections(f"127.0.0.1:{port}")
    probes = prober(f"127.0.0.1:{port}")
    try:
        found = probes.probe(0, timeout=1.0)
        assert found.incarnation is None and not found.reachable
    finally:
        probes.close()


def test_a_probe_for_shards_reads_the_servers_resident_memory_and_a_liveness_probe_does_not(start_ps):
    server = start_ps()
    with_shards = prober(f"127.0.0.1:{server.port}").probe(0, timeout=5.0, shards=True)
    liveness = prober(f"127.0.0.1:{server.port}").probe(0, timeout=5.0)
    assert with_shards.resident_bytes > 10 << 20, "a Python process with torch loaded holds tens of MB"
    assert liveness.resident_bytes == 0
