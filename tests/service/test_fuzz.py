"""Issue 10: a property-based fuzz (hypothesis) of every parameter-server RPC with arbitrary
bytes and arbitrary well-formed-but-hostile messages: never INTERNAL or UNKNOWN, and a
protected variable stays bit-identical with its version unchanged."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramserve.psserver.metadata import IDEMPOTENCY_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

UNARY = ["Step", "DeleteVariable", "ListShards", "Save", "Restore", "SetHyperparameters"]
REQUEST_STREAM = ["CreateShards", "Push"]
RESPONSE_STREAM = ["Pull", "ExportShards"]
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXAMPLES = 500

names = st.sampled_from(["w", "", "x\u00e9", "\x00", "w" * 300])
ints = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
metas = st.builds(
    tensor_pb2.TensorMeta,
    dtype=st.sampled_from(["float32", "int64", "bfloat16", "nope", ""]),
    shape=st.lists(ints, max_size=4),
)
refs = st.builds(tensor_pb2.ShardRef, variable=names, shard=st.integers(-2, 3))
push_parts = st.builds(
    tensor_pb2.PushPart,
    ref=refs,
    values=metas,
    sparse=st.booleans(),
    num_indices=st.integers(-5, 1 << 40),
    base_version=ints,
)
shard_specs = st.builds(
    tensor_pb2.ShardSpec,
    ref=refs,
    variable_shape=st.lists(ints, max_size=3),
    row_start=ints,
    shard_meta=metas,
    optimizer=st.builds(
        tensor_pb2.OptimizerSpec,
        name=st.sampled_from(["SGD", "Adam", "x"]),
        kwargs_json=st.sampled_from(['{"lr": 1}', '{"betas": [0.9]}', "[[[", "{}"]),
    ),
)
headers = st.one_of(
    st.builds(tensor_pb2.PartHeader, push=push_parts, payload_bytes=ints),
    st.builds(tensor_pb2.PartHeader, shard=shard_specs, payload_bytes=ints),
)
chunks = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda h, d: tensor_pb2.Chunk(header=h, data=d).SerializeToString(), headers, st.binary(max_size=64)),
)
messages = st.one_of(
    st.binary(max_size=256),
    st.builds(
        lambda items: ps_pb2.PullRequest(items=items).SerializeToString(),
        st.lists(
            st.builds(ps_pb2.PullItem, ref=refs, sparse=st.booleans(), row_indices=st.binary(max_size=64)), max_size=3
        ),
    ),
    st.builds(
        lambda n, v: ps_pb2.SetHyperparametersRequest(variable=n, values_json=v).SerializeToString(),
        names,
        st.one_of(st.text(max_size=64), st.just('{"lr": ' + "9" * 5000 + "}"), st.just("[" * 5000)),
    ),
    st.builds(lambda d: ps_pb2.SaveRequest(directory=d).SerializeToString(), st.text(max_size=64)),
    st.builds(lambda p: ps_pb2.RestoreRequest(path=p).SerializeToString(), st.text(max_size=64)),
)


@pytest.fixture(scope="module")
def target():
    from paramserve.psserver.client import ClientConfig, ParameterServerClient
    from paramserve.psserver.server import ServerConfig, build_server

    server = build_server(ServerConfig(max_workers=4, max_shard_bytes=1 << 24))
    client = ParameterServerClient([server.address], ClientConfig(call_timeout=10, retry_deadline=10))
    value = torch.randn(6, 4)
    # "keep" is protected: no generated request names it (others may create, change or delete "w").
    client.create_variable("keep", value, optimizer=OptimizerSpec("SGD", {"lr": 0.5}))
    client.create_variable("w", torch.zeros(6, 4), optimizer=OptimizerSpec("SGD", {"lr": 0.5}))
    channel = grpc.insecure_channel(server.address)
    yield channel, client, value
    channel.close()
    client.close()
    server.stop(grace=0)


def outcome(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def protected(client, value) -> None:
    pulled = client.pull(["keep"])
    assert torch.equal(pulled.tensors["keep"], value) and set(pulled.versions.values()) == {0}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(UNARY + RESPONSE_STREAM), body=messages)
def test_unary_requests_never_fail_internally(target, method, body):
    channel, client, value = target
    if method in RESPONSE_STREAM:
        code = outcome(lambda: list(channel.unary_stream(f"/{SERVICE_NAME}/{method}")(body, timeout=10)))
    else:
        code = outcome(lambda: channel.unary_unary(f"/{SERVICE_NAME}/{method}")(body, timeout=10))
    assert code not in FORBIDDEN
    protected(client, value)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(REQUEST_STREAM), body=st.lists(chunks, max_size=4))
def test_streamed_requests_never_fail_internally(target, method, body):
    channel, client, value = target
    code = outcome(
        lambda: channel.stream_unary(f"/{SERVICE_NAME}/{method}")(
            iter(body), timeout=10, metadata=[(IDEMPOTENCY_METADATA_KEY, "fuzz")]
        )
    )
    assert code not in FORBIDDEN
    protected(client, value)


program_numbers = st.one_of(
    st.just(0), st.integers(0, 66), st.integers(-(1 << 31), (1 << 32) - 1).map(lambda n: n % (1 << 32))
)
step_plans = st.one_of(
    st.binary(max_size=128),
    st.builds(
        lambda parts, items, define, run, bases: ps_pb2.StepPlan(
            idempotency_key="fuzz", push=parts, pull=items, define_program=define, run_program=run, base_versions=bases
        ).SerializeToString(),
        st.lists(push_parts, max_size=3),
        st.lists(
            st.builds(ps_pb2.PullItem, ref=refs, sparse=st.booleans(), row_indices=st.binary(max_size=64)), max_size=3
        ),
        program_numbers,
        st.one_of(st.just(0), program_numbers),
        st.lists(ints, max_size=4),
    ),
)
program_runs = st.builds(
    lambda number, key, bases: ps_pb2.StepPlan(
        idempotency_key=key, run_program=number, base_versions=bases
    ).SerializeToString(),
    st.integers(0, 66),
    st.sampled_from(["", "fuzz", "fuzz-2"]),
    st.lists(ints, max_size=4),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=step_plans, then=st.one_of(st.none(), program_runs), payload=st.binary(max_size=256))
def test_data_plane_steps_never_fail_internally(target, plan, then, payload):
    """The step data plane answers any plan and payload with a reply or a typed error (never
    InternalError), on a connection that stays usable, and leaves the protected variable alone;
    likewise a step program run after whatever the first frame defined."""
    import socket

    from paramserve.psserver.dataplane import MAGIC, PREFIX, FrameKind
    from tests.service.test_dataplane_transport import read_frame

    channel, client, value = target
    info = ps_pb2.DataPlaneInfo.FromString(channel.unary_unary(f"/{SERVICE_NAME}/GetDataPlane")(b"", timeout=10))
    with socket.create_connection(("127.0.0.1", info.port), timeout=10) as sock:
        sock.sendall(PREFIX.pack(MAGIC, FrameKind.HELLO, 0, 0))
        assert read_frame(sock)[0] == FrameKind.WELCOME
        answers = []
        for frame in (plan, then if then is not None else plan):  # the same connection answers again
            sock.sendall(PREFIX.pack(MAGIC, FrameKind.STEP, len(frame), len(payload)) + frame + payload)
            answers.append(read_frame(sock)[:2])
    for kind, header in answers:
        assert kind in (FrameKind.REPLY, FrameKind.ERROR)
        if kind == FrameKind.ERROR:
            assert ps_pb2.DataPlaneError.FromString(header).error_type not in ("InternalError", "ParamServeError")
    protected(client, value)
