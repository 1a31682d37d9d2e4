"""Every bad input gets a clear status, the server stays up, and the variable is unchanged."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch

from paramserve.psserver.protocol.errors import (
    AuthenticationError,
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    MessageTooLargeError,
    NonFiniteGradientError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.metadata import IDEMPOTENCY_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.streams import encode_parts, meta_of, tensor_payload
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

SGD = OptimizerSpec("SGD", {"lr": 0.5})


@pytest.fixture
def cluster(start_ps, make_client):
    """One server holding 'w' (2 shards of 6x4 float32); returns (server, client, original value)."""
    server = start_ps()
    client = make_client([server.address])
    value = torch.randn(6, 4)
    client.create_variable("w", value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    return server, client, value


def assert_unchanged(client, value):
    assert torch.equal(client.pull(["w"]).tensors["w"], value), "a rejected request changed the variable"
    assert {v for v in client.pull(["w"]).versions.values()} == {0}


def raw_push(address: str, parts, key: str = "k", metadata=()):
    """Pushes hand-made parts, bypassing every check the client makes."""
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary(f"/{SERVICE_NAME}/Push", response_deserializer=ps_pb2.PushResponse.FromString)
        return push(iter(parts), timeout=10, metadata=[(IDEMPOTENCY_METADATA_KEY, key), *metadata])


def push_part(variable: str, shard: int, values: torch.Tensor, rows: torch.Tensor | None = None):
    part = tensor_pb2.PushPart(ref=tensor_pb2.ShardRef(variable=variable, shard=shard), values=meta_of(values))
    pieces = [tensor_payload(values)]
    if rows is not None:
        part.sparse, part.num_indices = True, rows.numel()
        pieces.insert(0, tensor_payload(rows))
    return tensor_pb2.PartHeader(push=part), pieces


def test_unknown_variable_is_not_found(cluster, make_client):
    server, client, value = cluster
    with pytest.raises(VariableNotFoundError) as caught:
        client.pull(["nope"])
    assert "nope" in str(caught.value)
    with pytest.raises(grpc.RpcError) as raw:
        raw_push(server.address, encode_parts([push_part("nope", 0, torch.ones(3, 4))]))
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    assert_unchanged(client, value)


def test_wrong_shape_is_rejected_by_the_server(cluster):
    server, client, value = cluster
    with pytest.raises(grpc.RpcError) as raw:
        raw_push(server.address, encode_parts([push_part("w", 0, torch.ones(2, 4))]))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape" in raw.value.details()
    with pytest.raises(ShapeMismatchError):
        client.push({"w": torch.ones(5, 4)})
    assert_unchanged(client, value)


def test_wrong_dtype_is_rejected(cluster):
    server, client, value = cluster
    with pytest.raises(DtypeMismatchError) as caught:
        client.push({"w": torch.ones(6, 4, dtype=torch.float64)})
    assert "float64" in str(caught.value) and "float32" in str(caught.value)
    assert caught.value.server == server.address
    assert_unchanged(client, value)


def test_row_index_out_of_range_is_rejected(cluster):
    server, client, value = cluster
    with pytest.raises(IndexOutOfRangeError):
        client.pull_rows("w", torch.tensor([0, 6]))
    with pytest.raises(grpc.RpcError) as raw:  # shard 0 holds local rows 0..2 only
        raw_push(server.address, encode_parts([push_part("w", 0, torch.ones(1, 4), rows=torch.tensor([3]))]))
    assert raw.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert_unchanged(client, value)


def test_nan_gradient_is_rejected_and_no_shard_of_the_push_is_applied(cluster):
    server, client, value = cluster
    gradient = torch.ones(6, 4)
    gradient[5, 1] = float("nan")  # only the second shard is poisoned
    with pytest.raises(NonFiniteGradientError):
        client.push({"w": gradient})
    assert_unchanged(client, value)
    assert server.registry.get_sample_value("paramserve_ps_pushes_total", {"result": "rejected"}) == 1.0


def test_nan_gradients_can_be_allowed(start_ps, make_client):
    from paramserve.psserver.store.shard_store import StoreConfig

    client = make_client([start_ps(store=StoreConfig(allow_nonfinite=True)).address])
    client.create_variable("w", torch.zeros(2), optimizer=SGD)
    client.push({"w": torch.tensor([float("inf"), 1.0])})
    assert torch.isinf(client.pull(["w"]).tensors["w"][0])


def test_missing_or_wrong_token_is_unauthenticated(start_ps, make_client):
    server = start_ps(token="s3cret")
    good = make_client([server.address], token="s3cret")
    good.create_variable("w", torch.zeros(3), optimizer=SGD)
    for token in (None, "wrong"):
        stranger = make_client([server.address], token=token)
        stranger.adopt_layouts(good.layouts)
        with pytest.raises(AuthenticationError) as caught:
            stranger.push({"w": torch.ones(3)})
        assert "token" in str(caught.value)
    assert torch.equal(good.pull(["w"]).tensors["w"], torch.zeros(3))


def test_health_needs_no_token(start_ps):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = start_ps(token="s3cret")
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_garbage_chunk_is_invalid_argument(cluster):
    server, client, value = cluster
    with pytest.raises(grpc.RpcError) as raw:
        raw_push(server.address, [b"\xff\x00 this is not a chunk"])
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed chunk" in raw.value.details()
    with grpc.insecure_channel(server.address) as channel:
        pull = channel.unary_stream(f"/{SERVICE_NAME}/Pull")
        with pytest.raises(grpc.RpcError) as bad_pull:
            list(pull(b"\x0a\xff\xff\xff\x0f garbage", timeout=10))
    assert bad_pull.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(client, value)


def test_truncated_stream_applies_nothing(cluster):
    server, client, value = cluster
    chunks = list(encode_parts([push_part("w", 0, torch.ones(3, 4))], chunk_bytes=16))
    with pytest.raises(grpc.RpcError) as raw:
        raw_push(server.address, chunks[:-1])
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "payload bytes" in raw.value.details()
    assert_unchanged(client, value)


def test_push_without_idempotency_key_is_rejected(cluster):
    server, client, value = cluster
    with pytest.raises(grpc.RpcError) as raw:
        raw_push(server.address, encode_parts([push_part("w", 0, torch.ones(3, 4))]), key="")
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert IDEMPOTENCY_METADATA_KEY in raw.value.details()
    assert_unchanged(client, value)


def test_garbage_bytes_on_the_port_do_not_hurt_the_server(cluster):
    server, client, value = cluster
    for payload in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64):
        # The server may answer, reset or close mid-send: how it refuses is gRPC's business;
        # what matters is that it still serves, unchanged, afterwards.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):
                    pass
            except OSError:  # reset, broken pipe, timeout
                pass
    assert_unchanged(client, value)


def test_oversized_message_is_resource_exhausted(start_ps, make_client):
    server = start_ps(max_message_bytes=2 << 20, chunk_bytes=1 << 20)
    client = make_client([server.address], chunk_bytes=4 << 20, max_message_bytes=64 << 20)
    value = torch.zeros(2 << 20)  # 8 MiB
    good = make_client([server.address], chunk_bytes=1 << 20)
    good.create_variable("w", value, optimizer=SGD)
    with pytest.raises(MessageTooLargeError) as caught:
        client.push({"w": torch.ones(2 << 20)})
    assert caught.value.server == server.address
    assert torch.equal(good.pull(["w"]).tensors["w"], value)


def test_unknown_optimizer_is_rejected_at_creation(cluster):
    server, client, value = cluster
    with pytest.raises(InvalidRequestError) as caught:
        client.create_variable("v", torch.zeros(3), optimizer=OptimizerSpec("os.system", {}))
    assert "os.system" in str(caught.value)
    assert [i.ref.variable for i in server.store.list_shards()] == ["w", "w"]


def step_request(parts, key: str, pull) -> bytes:
    """A StepRequest as a client would pack it, from push_part()s."""
    from paramserve.psserver.protocol.streams import encode_step_request

    plan = ps_pb2.StepPlan(idempotency_key=key, push=[header.push for header, _ in parts], pull=pull)
    return encode_step_request(plan, [piece for _, pieces in parts for piece in pieces])


def raw_step(address: str, request: bytes) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/{SERVICE_NAME}/Step")(request, timeout=10)


def test_a_step_whose_read_is_bad_applies_none_of_its_push(cluster):
    server, client, value = cluster
    good_push = [push_part("w", 0, torch.ones(3, 4))]
    for bad_read in (
        ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="nope", shard=0)),  # no such variable
        ps_pb2.PullItem(
            ref=tensor_pb2.ShardRef(variable="w", shard=1), sparse=True, row_indices=torch.tensor([7]).numpy().tobytes()
        ),  # row out of range
    ):
        with pytest.raises(grpc.RpcError) as caught:
            raw_step(server.address, step_request(good_push, "k", [bad_read]))
        assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE)
    assert_unchanged(client, value)


def test_a_step_push_without_a_key_is_rejected(cluster):
    server, client, value = cluster
    with pytest.raises(grpc.RpcError) as caught:
        raw_step(server.address, step_request([push_part("w", 0, torch.ones(3, 4))], "", []))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "idempotency key" in caught.value.details()
    assert_unchanged(client, value)


@pytest.mark.parametrize("extra", [b"\x00" * 4, b""])
def test_a_step_whose_payload_disagrees_with_its_plan_is_rejected(cluster, extra):
    from paramserve.psserver.protocol.streams import encode_step_request

    server, client, value = cluster
    header, pieces = push_part("w", 0, torch.ones(3, 4))
    plan = ps_pb2.StepPlan(idempotency_key="k", push=[header.push])
    payload = [*pieces, extra] if extra else [memoryview(pieces[0].tobytes()[:-4])]  # 4 bytes too many / too few
    with pytest.raises(grpc.RpcError) as caught:
        raw_step(server.address, encode_step_request(plan, payload))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the payload holds" in caught.value.details()
    assert_unchanged(client, value)


def test_a_garbage_step_is_invalid_argument(cluster):
    server, client, value = cluster
    with pytest.raises(grpc.RpcError) as caught:
        raw_step(server.address, b"\x0a\xff\xff\xff\x0f garbage")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(client, value)
