"""Issue 43: what one request may make a parameter server allocate is counted, and refused, before
it is allocated, against a real server process: a dynamic table's every allocation (its list of
freed slots and its id index at ``max_rows`` included), and the rows a lookup gathers."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.dynamic import dynamic_wire
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState, DynamicTableConfig
from paramserve.psserver.protocol.errors import MessageTooLargeError
from paramserve.psserver.protocol.metadata import SERVICE_NAME
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.streams import encode_parts
from paramserve.psserver.protocol.types import ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

SGD = OptimizerSpec("SGD", {"lr": 0.5})
SHARD_LIMIT = 256 << 20
"""The server's --max-shard-bytes."""
MESSAGE_LIMIT = 4 << 20
"""The server's --max-message-bytes."""
SHARD_ROWS = 1 << 31
"""The most rows a shard can index (a row's slot is an int32)."""


class Server:
    def __init__(self, process: subprocess.Popen[bytes], address: str):
        self.process, self.address = process, address

    def memory_kib(self, field: str) -> int:
        """``VmSize`` (address space) or ``VmRSS`` (resident) of the server process."""
        text = pathlib.Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line for line in text.splitlines() if line.startswith(f"{field}:")).split()[1])

    def call(self, method: str, request: bytes) -> bytes:
        with grpc.insecure_channel(self.address) as channel:
            return channel.unary_unary(f"/{SERVICE_NAME}/{method}")(request, timeout=30)

    def stream(self, method: str, chunks: Iterator[bytes]) -> bytes:
        with grpc.insecure_channel(self.address) as channel:
            return channel.stream_unary(f"/{SERVICE_NAME}/{method}")(chunks, timeout=30)

    def tables(self) -> list[str]:
        reply = ps_pb2.DynamicTablesResponse.FromString(
            self.call("ListDynamicTables", ps_pb2.ListDynamicTablesRequest().SerializeToString())
        )
        return sorted(table.ref.variable for table in reply.tables)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One ``paramserve ps`` process on 127.0.0.1 with small limits (no token: loopback only)."""
    directory = tmp_path_factory.mktemp("ps")
    port_file = directory / "port.json"
    flags = ["--port", "0", "--port-file", str(port_file), "--max-shard-bytes", str(SHARD_LIMIT)]
    flags += ["--max-message-bytes", str(MESSAGE_LIMIT), "--chunk-bytes", str(1 << 20)]
    process = subprocess.Popen(
        [sys.executable, "-m", "paramserve.psserver", *flags],
        stdout=subprocess.DEVNULL,
        stderr=(directory / "ps.log").open("wb"),
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert process.poll() is None, (directory / "ps.log").read_text()
            assert time.monotonic() < deadline, "the server did not start within 120 s"
            time.sleep(0.05)
        yield Server(process, f"127.0.0.1:{json.loads(port_file.read_text())['port']}")
    finally:
        process.terminate()
        process.wait(30)


def refusal(call) -> tuple[grpc.StatusCode, str, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    return err.code(), err.details(), dict(err.trailing_metadata() or ()).get("paramserve-error", "")


def table_config(max_rows: int) -> DynamicTableConfig:
    return DynamicTableConfig(dim=4, optimizer=SGD, max_rows=max_rows)


def create_request(name: str, max_rows: int) -> bytes:
    return ps_pb2.CreateDynamicTableRequest(
        ref=tensor_pb2.ShardRef(variable=name, shard=0),
        num_shards=1,
        config=dynamic_wire.config_to_proto(table_config(max_rows)),
    ).SerializeToString()


def replace_chunks(name: str, max_rows: int) -> Iterator[bytes]:
    """A ReplaceDynamicTables stream of one empty shard (a restore of a table with no rows)."""
    state = DynamicShardState(
        ref=ShardRef(name, 0),
        num_shards=1,
        config=table_config(max_rows),
        ids=torch.empty(0, dtype=torch.int64),
        values=torch.empty(0, 4),
        updated=torch.empty(0, dtype=torch.int64),
    )
    return encode_parts([dynamic_wire.shard_part(state)], 1 << 20)


@pytest.mark.parametrize("max_rows", [1 << 62, 1 << 40], ids=["2^62", "2^40"])
def test_a_max_rows_no_shard_can_index_is_invalid_and_reserves_nothing(server, max_rows):
    """Issue 43: 2^62 failed INTERNAL (the arena's list of freed slots, 8 bytes a row, made up
    front), and 2^40 reserved 8 TiB of the server's address space."""
    size, resident = server.memory_kib("VmSize"), server.memory_kib("VmRSS")
    for call in (
        lambda: server.call("CreateDynamicTable", create_request("huge", max_rows)),
        lambda: server.stream("ReplaceDynamicTables", replace_chunks("huge", max_rows)),
    ):
        code, details, error = refusal(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and error == "InvalidRequestError", (code, details)
        assert "max_rows" in details and str(SHARD_ROWS) in details, details
    assert server.memory_kib("VmSize") - size < 1 << 20, "the server reserved a GiB or more"
    assert server.memory_kib("VmRSS") - resident < 256 << 10
    assert "huge" not in server.tables()
    assert server.process.poll() is None


def test_a_max_rows_whose_index_passes_the_shard_limit_is_refused_naming_it(server):
    """The id index of 2^25 rows grows to 2^26 buckets of 8-byte keys: 512 MiB in one allocation,
    over this server's 256 MiB --max-shard-bytes, though each arena block fits."""
    code, details, error = refusal(lambda: server.call("CreateDynamicTable", create_request("wide", 1 << 25)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and error == "MessageTooLargeError", (code, details)
    assert "--max-shard-bytes" in details and "max_rows" in details, details
    server.call("CreateDynamicTable", create_request("fits", 1 << 20))  # 16 MiB of index: made
    assert "wide" not in server.tables() and "fits" in server.tables()


def test_a_lookup_over_the_message_limit_is_refused_and_a_normal_one_served(server):
    """Issue 43: a lookup's rows are gathered whole before they stream, so one 6M-id lookup made
    a server hold a 384 MB reply (1.0-1.1 GB at the peak) for a 48 MB request. The rows one
    request reads are bounded as a message is (--max-message-bytes)."""
    client = ParameterServerClient([server.address], ClientConfig(call_timeout=30.0, retry_deadline=30.0))
    try:
        dim = 64  # 256 bytes a row: 20,000 rows are 5 MB, over the 4 MiB limit
        client.dynamic.create("lookups", DynamicTableConfig(dim=dim, optimizer=SGD, initializer="zeros"))
        shape = {"lookups": (dim, torch.float32)}
        with pytest.raises(MessageTooLargeError, match="--max-message-bytes") as caught:
            client.pull_unique_rows({"lookups": torch.arange(20_000)}, dynamic=shape)
        assert "split the lookup" in str(caught.value)
        found, _ = client.pull_unique_rows({"lookups": torch.arange(1000)}, dynamic=shape)
        assert found["lookups"].rows.shape == (1000, dim)
    finally:
        client.close()
    assert server.process.poll() is None
