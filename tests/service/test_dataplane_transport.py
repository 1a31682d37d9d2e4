"""The step data plane (psserver/dataplane/dataplane_server.py, dataplane_client.py) over real sockets: who
gets in, what a bad peer gets back, and that the server stays up and unchanged for everyone else."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterator

import pytest
import torch

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.dataplane import dataplane_client, dataplane_server
from paramserve.psserver.dataplane.frames import MAGIC, PREFIX, FrameKind, TransportError
from paramserve.psserver.protocol.errors import AuthenticationError, VariableNotFoundError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.runtime.security import ClientTls, TlsConfig, bearer_metadata
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2
from tests.certificates import make_certificates, needs_openssl

SGD = OptimizerSpec("SGD", {"lr": 0.5})
TOKEN = "a-cluster-token-of-32-characters"


@pytest.fixture
def make_client() -> Iterator[Callable[..., ParameterServerClient]]:
    """Clients with the default configuration (on the data plane), not the transports matrix."""
    clients: list[ParameterServerClient] = []

    def make(addresses: list[str], **overrides: object) -> ParameterServerClient:
        client = ParameterServerClient(
            addresses, ClientConfig(**{"call_timeout": 10.0, "retry_deadline": 10.0, **overrides})
        )  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def frame(kind: FrameKind, header: bytes = b"", payload: bytes = b"", *, payload_bytes: int | None = None) -> bytes:
    size = len(payload) if payload_bytes is None else payload_bytes
    return PREFIX.pack(MAGIC, kind, len(header), size) + header + payload


def read_frame(sock: socket.socket) -> tuple[FrameKind, bytes, bytes]:
    prefix = receive(sock, PREFIX.size)
    magic, kind, header_bytes, payload_bytes = PREFIX.unpack(prefix)
    assert magic == MAGIC
    return FrameKind(kind), receive(sock, header_bytes), receive(sock, payload_bytes)


def receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed (reads EOF, or a reset); waits up to the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def connect(server, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.data_port), timeout=timeout)
    return sock


def admitted(server, token: str | None = None) -> socket.socket:
    sock = connect(server)
    sock.sendall(frame(FrameKind.HELLO, bearer_metadata(token)[1].encode() if token else b""))
    kind, _, _ = read_frame(sock)
    assert kind is FrameKind.WELCOME
    return sock


def error_of(header: bytes) -> ps_pb2.DataPlaneError:
    return ps_pb2.DataPlaneError.FromString(header)


def still_serves(server, make_client, token: str | None = None) -> None:
    """A well-behaved client still trains on ``server``, over its data plane."""
    client = make_client([server.address], token=token)
    name = f"check{len(server.store.list_shards())}"
    client.create_variable(name, torch.ones(4), optimizer=SGD)
    summary, pulled = client.push_and_pull({name: torch.ones(4)}, [name], key=f"{name}-1")
    assert summary.applied == 1
    assert torch.equal(pulled.tensors[name], torch.full((4,), 0.5))


def steps_on_data_plane(server) -> float:
    return (
        server.registry.get_sample_value(
            "paramserve_rpcs_total", {"role": "ps", "method": "DataPlaneStep", "code": "OK"}
        )
        or 0.0
    )


def test_a_client_steps_on_the_data_plane_and_gets_typed_errors_back(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(6, 2), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    client.create_variable("gone", torch.zeros(3), optimizer=SGD)
    make_client([server.address]).delete_variable("gone")  # this client still holds its layout

    with pytest.raises(VariableNotFoundError) as raised:
        client.push({"gone": torch.ones(3)}, key="k")
    assert raised.value.variable == "gone" and raised.value.server == server.address
    summary, pulled = client.push_and_pull({"w": torch.ones(6, 2)}, ["w"], key="k1")

    assert summary.applied == 2
    assert torch.equal(pulled.tensors["w"], torch.full((6, 2), -0.5))
    assert steps_on_data_plane(server) == 1
    assert (
        server.registry.get_sample_value(
            "paramserve_rpcs_total", {"role": "ps", "method": "DataPlaneStep", "code": "NOT_FOUND"}
        )
        == 1
    )
    assert server.data_plane.connections == 1, "the connection survives a typed error and is reused"


def test_a_wrong_or_missing_credential_is_refused_before_anything_is_read(start_ps, make_client):
    server = start_ps(token=TOKEN)
    for credential in (b"", bearer_metadata("another-token-of-32-characters!!")[1].encode()):
        sock = connect(server)
        sock.sendall(frame(FrameKind.HELLO, credential))
        kind, header, _ = read_frame(sock)
        assert kind is FrameKind.ERROR
        assert error_of(header).error_type == "AuthenticationError"
        assert "token" in error_of(header).message
        assert closed_by_peer(sock)
        sock.close()
    with pytest.raises(AuthenticationError):
        dataplane_client.DataPlaneConnection(
            "127.0.0.1",
            server.data_port,
            token="wrong-token-of-32-characters!!!",
            tls=None,
            timeout=10,
            max_body_bytes=1 << 20,
        )
    still_serves(server, make_client, TOKEN)


def test_a_step_before_hello_and_garbage_bytes_close_the_connection(start_ps, make_client):
    server = start_ps()
    early = connect(server)
    early.sendall(frame(FrameKind.STEP, b"", b""))
    garbage = connect(server)
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")

    assert closed_by_peer(early)
    assert closed_by_peer(garbage)
    still_serves(server, make_client)


def test_an_oversized_frame_is_refused_by_its_prefix_without_allocating(start_ps, make_client):
    server = start_ps(max_message_bytes=8 << 20)
    sock = admitted(server)
    sock.sendall(frame(FrameKind.STEP, b"", payload_bytes=1 << 40))  # a terabyte declared, nothing sent

    kind, header, _ = read_frame(sock)

    assert kind is FrameKind.ERROR
    error = error_of(header)
    assert error.error_type == "MessageTooLargeError"
    assert "--max-message-bytes" in error.message
    assert closed_by_peer(sock)
    still_serves(server, make_client)


def test_a_malformed_plan_gets_invalid_argument_and_changes_nothing(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)
    sock = admitted(server)
    plan = ps_pb2.StepPlan(
        idempotency_key="k",
        push=[
            tensor_pb2.PushPart(
                ref=tensor_pb2.ShardRef(variable="w", shard=0), values=tensor_pb2.TensorMeta(dtype="float32", shape=[4])
            )
        ],
    )

    sock.sendall(frame(FrameKind.STEP, b"\xff\xff\xff"))  # not a StepPlan
    bad_plan = read_frame(sock)
    sock.sendall(frame(FrameKind.STEP, plan.SerializeToString(), struct.pack("<3f", 1, 1, 1)))  # 12 bytes for 16
    short_payload = read_frame(sock)

    assert bad_plan[0] is FrameKind.ERROR and error_of(bad_plan[1]).error_type == "InvalidRequestError"
    assert short_payload[0] is FrameKind.ERROR and error_of(short_payload[1]).error_type == "InvalidRequestError"
    assert "12 bytes" in error_of(short_payload[1]).message
    assert torch.equal(client.pull(["w"]).tensors["w"], torch.zeros(4))
    assert client.pull(["w"]).versions == {ShardRef("w", 0): 0}


def test_a_step_whose_reply_was_lost_is_applied_once_when_retried(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)
    plan = ps_pb2.StepPlan(
        idempotency_key="step-7",
        push=[
            tensor_pb2.PushPart(
                ref=tensor_pb2.ShardRef(variable="w", shard=0), values=tensor_pb2.TensorMeta(dtype="float32", shape=[4])
            )
        ],
    )
    sock = admitted(server)
    sock.sendall(frame(FrameKind.STEP, plan.SerializeToString(), torch.ones(4).numpy().tobytes()))
    kind, _, _ = read_frame(sock)  # applied; the client then vanishes before it can act on the reply
    sock.close()

    retried = client.push({"w": torch.ones(4)}, key="step-7")

    assert kind is FrameKind.REPLY
    assert retried.duplicates == 1 and retried.applied == 0
    assert torch.equal(client.pull(["w"]).tensors["w"], torch.full((4,), -0.5))


def test_connections_beyond_the_limit_are_closed_at_once(start_ps):
    server = start_ps(max_connections=2)
    held = [admitted(server), admitted(server)]

    extra = connect(server)

    assert closed_by_peer(extra)
    assert server.data_plane.connections == 2
    for sock in held:
        sock.close()


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(start_ps, monkeypatch):
    monkeypatch.setattr(dataplane_server, "HANDSHAKE_SECONDS", 0.3)
    server = start_ps()
    sock = connect(server, timeout=10.0)  # waits for the server, far longer than its timeout

    assert closed_by_peer(sock)


def test_a_server_without_a_data_plane_is_served_by_the_step_rpc(start_ps, make_client):
    server = start_ps(data_port=None)
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)

    summary, pulled = client.push_and_pull({"w": torch.ones(4)}, ["w"], key="k")

    assert summary.applied == 1 and torch.equal(pulled.tensors["w"], torch.full((4,), -0.5))
    assert server.data_port is None
    assert (
        server.registry.get_sample_value("paramserve_rpcs_total", {"role": "ps", "method": "Step", "code": "OK"}) == 1
    )


def test_a_client_on_the_same_host_takes_the_local_socket_and_others_tcp(start_ps, make_client):
    server = start_ps(token=TOKEN)
    name = server.data_plane.local_socket
    assert name.startswith("paramserve-dataplane-")

    def connection(local_socket: str) -> dataplane_client.DataPlaneConnection:
        return dataplane_client.DataPlaneConnection(
            "127.0.0.1",
            server.data_port,
            token=TOKEN,
            tls=None,
            timeout=10,
            max_body_bytes=1 << 20,
            local_socket=local_socket,
            local_owner=(os.getpid(), os.getuid()),  # the server runs in this process
        )

    same_host, elsewhere = connection(name), connection("paramserve-dataplane-" + "0" * 32)

    assert same_host.local, "this process shares the server's host and network namespace"
    assert not elsewhere.local, "a name nobody listens on (another namespace's server) falls back to TCP"
    with pytest.raises(AuthenticationError):
        dataplane_client.DataPlaneConnection(
            "127.0.0.1", server.data_port, token=None, tls=None, timeout=10, max_body_bytes=1 << 20, local_socket=name
        )
    same_host.close()
    elsewhere.close()
    still_serves(server, make_client, TOKEN)


@needs_openssl
def test_under_mutual_tls_the_data_plane_needs_a_client_certificate(start_ps, make_client, tmp_path):
    certs = make_certificates(tmp_path / "certs")
    server = start_ps(tls=TlsConfig(certs.cert, certs.key, certs.ca))
    assert server.data_plane.local_socket == "", "no way around TLS, which may be what authenticates"
    client = make_client(
        [server.address], tls_root_certificates=certs.ca, tls_cert_chain=certs.cert, tls_private_key=certs.key
    )
    client.create_variable("w", torch.zeros(4), optimizer=SGD)

    summary, pulled = client.push_and_pull({"w": torch.ones(4)}, ["w"], key="k")

    assert summary.applied == 1 and torch.equal(pulled.tensors["w"], torch.full((4,), -0.5))
    assert steps_on_data_plane(server) == 1
    plaintext = connect(server)
    plaintext.sendall(frame(FrameKind.HELLO))  # not a TLS handshake
    assert closed_by_peer(plaintext)
    with pytest.raises(TransportError):  # TLS, but no client certificate
        dataplane_client.DataPlaneConnection(
            "127.0.0.1", server.data_port, token=None, timeout=10, max_body_bytes=1 << 20, tls=ClientTls(certs.ca)
        )
