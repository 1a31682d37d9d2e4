"""Issue 10: a property-based fuzz (hypothesis) of every parameter-server RPC with arbitrary
bytes and arbitrary well-formed-but-hostile messages: never INTERNAL or UNKNOWN, and a
protected variable and a protected dynamic table stay bit-identical with their versions
unchanged."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig
from paramserve.psserver.protocol.metadata import IDEMPOTENCY_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

UNARY = [
    "Step",
    "DeleteVariable",
    "ListShards",
    "Save",
    "Restore",
    "SetHyperparameters",
    "CreateDynamicTable",
    "ListDynamicTables",
    "MarkDynamicTablesSaved",
]
REQUEST_STREAM = ["CreateShards", "Push", "ReplaceDynamicTables"]
RESPONSE_STREAM = ["Pull", "ExportShards", "ExportDynamicTables"]
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXAMPLES = 500

names = st.sampled_from(["w", "t", "", "x\u00e9", "\x00", "w" * 300])
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
sizes = st.one_of(st.integers(-2, 64), ints)
dynamic_configs = st.builds(
    tensor_pb2.DynamicTableConfig,
    dim=sizes,
    dtype=st.sampled_from(["float32", "int64", "nope", ""]),
    optimizer=st.builds(
        tensor_pb2.OptimizerSpec,
        name=st.sampled_from(["SGD", "Adagrad", "x"]),
        kwargs_json=st.sampled_from(['{"lr": 1}', '{"lr": -1}', "[[[", "{}"]),
    ),
    initializer=st.builds(
        tensor_pb2.Initializer, kind=st.sampled_from(["normal", "zeros", "x", ""]), a=st.floats(), b=st.floats()
    ),
    admit_after=sizes,
    default_row=st.sampled_from(["zeros", "shared", "x", ""]),
    ttl_steps=sizes,
    ttl_seconds=st.floats(),
    max_rows=sizes,
    max_bytes=sizes,
    admission_width=sizes,
    block_rows=sizes,
)
huge = st.one_of(st.integers(1, 64), st.integers(1 << 30, (1 << 63) - 1))
valid_configs = st.builds(  # well formed, so that a huge size reaches the server's checks
    lambda dim, admit, width, rows, block: tensor_pb2.DynamicTableConfig(
        dim=dim,
        dtype="float32",
        optimizer=tensor_pb2.OptimizerSpec(name="SGD", kwargs_json='{"lr": 1}'),
        admit_after=admit,
        admission_width=width,
        max_rows=rows,
        block_rows=block,
    ),
    huge,
    st.integers(1, 3),
    st.one_of(st.just(0), huge),
    st.one_of(st.just(0), huge),
    st.one_of(st.just(0), huge),
)
dynamic_configs = st.one_of(dynamic_configs, valid_configs)
marks = st.builds(ps_pb2.DynamicSaveMark, ref=refs, lineage=st.text(max_size=8), through=ints)


def create_table_requests(table_refs: st.SearchStrategy, num_shards: st.SearchStrategy) -> st.SearchStrategy:
    """Serialised CreateDynamicTable requests."""
    return st.builds(
        lambda ref, n, config: ps_pb2.CreateDynamicTableRequest(
            ref=ref, num_shards=n, config=config
        ).SerializeToString(),
        table_refs,
        num_shards,
        dynamic_configs,
    )


def export_table_requests(
    table_refs: st.SearchStrategy, chunk_bytes: st.SearchStrategy, save_marks: st.SearchStrategy
) -> st.SearchStrategy:
    """Serialised ExportDynamicTables requests, whole or incremental."""
    return st.builds(
        lambda refs, chunk, incremental, since: ps_pb2.ExportDynamicTablesRequest(
            refs=refs, chunk_bytes=chunk, incremental=incremental, since=since
        ).SerializeToString(),
        table_refs,
        chunk_bytes,
        st.booleans(),
        save_marks,
    )


dynamic_headers = st.builds(
    tensor_pb2.DynamicShardHeader,
    ref=refs,
    num_shards=st.integers(-2, 4),
    config=dynamic_configs,
    tensors=st.lists(
        st.builds(
            tensor_pb2.NamedTensorMeta, name=st.sampled_from(["ids", "values", "updated", "slot.sum", "x"]), meta=metas
        ),
        max_size=5,
    ),
    version=ints,
    applied_keys=st.lists(st.text(max_size=4), max_size=2),
    delta=st.booleans(),
    lineage=st.text(max_size=8),
    through=ints,
)
headers = st.one_of(
    st.builds(tensor_pb2.PartHeader, push=push_parts, payload_bytes=ints),
    st.builds(tensor_pb2.PartHeader, shard=shard_specs, payload_bytes=ints),
    st.builds(tensor_pb2.PartHeader, dynamic=dynamic_headers, payload_bytes=ints),
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
    create_table_requests(refs, st.integers(-2, 4)),
    export_table_requests(st.lists(refs, max_size=3), ints, st.lists(marks, max_size=3)),
    st.builds(lambda m: ps_pb2.MarkDynamicTablesSavedRequest(marks=m).SerializeToString(), st.lists(marks, max_size=3)),
    st.builds(lambda p: ps_pb2.RestoreRequest(path=p).SerializeToString(), st.text(max_size=64)),
)


@pytest.fixture(scope="module")
def target():
    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
    from paramserve.psserver.server import ServerConfig, build_server

    server = build_server(ServerConfig(max_workers=4, max_shard_bytes=1 << 24))
    client = ParameterServerClient([server.address], ClientConfig(call_timeout=10, retry_deadline=10))
    value = torch.randn(6, 4)
    # "keep" is protected: no generated request names it (others may create, change or delete "w").
    client.create_variable("keep", value, optimizer=OptimizerSpec("SGD", {"lr": 0.5}))
    client.create_variable("w", torch.zeros(6, 4), optimizer=OptimizerSpec("SGD", {"lr": 0.5}))
    # "kept" is a protected dynamic table (no generated ref names it), "t" one they may change.
    for table in ("kept", "t"):
        client.dynamic.create(table, DynamicTableConfig(dim=4, optimizer=OptimizerSpec("SGD", {"lr": 0.5})))
        client.pull_unique_rows({table: torch.arange(20)}, dynamic={table: (4, torch.float32)})
    channel = grpc.insecure_channel(server.address)
    yield channel, client, (value, table_rows(client))
    channel.close()
    client.close()
    server.stop(grace=0)


def outcome(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def table_rows(client) -> tuple[list[int], torch.Tensor, int]:
    (state,) = client.dynamic.export(["kept"])[0]
    return state.ids.tolist(), state.values, state.version


def protected(client, before) -> None:
    value, rows = before
    pulled = client.pull(["keep"])
    assert torch.equal(pulled.tensors["keep"], value) and set(pulled.versions.values()) == {0}
    ids, values, version = table_rows(client)
    assert (ids, version) == (rows[0], rows[2]) and torch.equal(values, rows[1])


def unary_outcome(channel, method, body):
    """The status of one call with a single request (its replies read whole where they stream)."""
    if method in RESPONSE_STREAM:
        return outcome(lambda: list(channel.unary_stream(f"/{SERVICE_NAME}/{method}")(body, timeout=10)))
    return outcome(lambda: channel.unary_unary(f"/{SERVICE_NAME}/{method}")(body, timeout=10))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(UNARY + RESPONSE_STREAM), body=messages)
def test_unary_requests_never_fail_internally(target, method, body):
    channel, client, value = target
    assert unary_outcome(channel, method, body) not in FORBIDDEN
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

    from paramserve.psserver.dataplane.frames import MAGIC, PREFIX, FrameKind
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


dynamic_refs = st.builds(tensor_pb2.ShardRef, variable=st.sampled_from(["t", "u", ""]), shard=st.integers(-1, 2))
dynamic_requests = st.one_of(
    st.binary(max_size=128),
    create_table_requests(dynamic_refs, st.integers(-1, 3)),
    export_table_requests(
        st.lists(dynamic_refs, max_size=2),
        st.one_of(st.integers(-1, 64), ints),
        st.lists(st.builds(ps_pb2.DynamicSaveMark, ref=dynamic_refs, lineage=st.text(max_size=4), through=ints)),
    ),
    st.builds(lambda m: ps_pb2.MarkDynamicTablesSavedRequest(marks=m).SerializeToString(), st.lists(marks, max_size=3)),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(
        ["CreateDynamicTable", "ListDynamicTables", "MarkDynamicTablesSaved", "ExportDynamicTables"]
    ),
    body=dynamic_requests,
)
def test_dynamic_table_requests_never_fail_internally(target, method, body):
    """The dynamic tables' control plane (well-formed settings with huge sizes included: a
    table whose allocation would pass the server's shard limit is refused before any is made)."""
    channel, client, value = target
    assert unary_outcome(channel, method, body) not in FORBIDDEN
    protected(client, value)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    header=st.builds(
        tensor_pb2.PartHeader,
        dynamic=st.builds(
            tensor_pb2.DynamicShardHeader,
            ref=dynamic_refs,
            num_shards=st.integers(-1, 3),
            config=dynamic_configs,
            tensors=st.lists(
                st.builds(
                    tensor_pb2.NamedTensorMeta,
                    name=st.sampled_from(["ids", "values", "updated"]),
                    meta=st.builds(
                        tensor_pb2.TensorMeta,
                        dtype=st.sampled_from(["float32", "int64"]),
                        shape=st.lists(st.integers(0, 3), max_size=2),
                    ),
                ),
                max_size=3,
            ),
            version=ints,
        ),
        payload_bytes=st.integers(0, 64),
    ),
    data=st.binary(max_size=64),
)
def test_replaced_dynamic_tables_never_fail_internally(target, header, data):
    channel, client, value = target
    body = [tensor_pb2.Chunk(header=header, data=data).SerializeToString()]
    code = outcome(lambda: channel.stream_unary(f"/{SERVICE_NAME}/ReplaceDynamicTables")(iter(body), timeout=10))
    assert code not in FORBIDDEN
    protected(client, value)
