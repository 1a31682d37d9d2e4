"""Issue 10: hostile or careless input gets a specific status (never INTERNAL or UNKNOWN),
nothing is allocated for a request before it is checked, and the trust model holds: the
token is never sent, worker replies are signed, servers refuse to listen beyond loopback
unauthenticated, checkpoint paths are confined, and TLS (mutual too) works everywhere."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from paramserve.coordinator.commands.health import check, credentials
from paramserve.coordinator.dispatch.worker_transport import GrpcTransport, RpcFailure
from paramserve.psserver.protocol.errors import (
    CheckpointError,
    ConfigurationError,
    InvalidRequestError,
    ParamServeError,
    PermissionDeniedError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.metadata import IDEMPOTENCY_METADATA_KEY, SERVICE_NAME, metadata_text, metadata_value
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.runtime.security import AUTH_METADATA_KEY, TlsConfig, check_token, confined_path
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2, worker_pb2
from tests.certificates import make_certificates, needs_openssl

SGD = OptimizerSpec("SGD", {"lr": 0.5})
TOKEN = "a-test-token-of-enough-length"


def raw_unary(address: str, method: str, request: bytes, metadata=(), timeout: float = 10) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/{SERVICE_NAME}/{method}")(request, timeout=timeout, metadata=list(metadata))


def raw_chunks(address: str, method: str, chunks, metadata=(), timeout: float = 10) -> bytes:
    with grpc.insecure_channel(address) as channel:
        return channel.stream_unary(f"/{SERVICE_NAME}/{method}")(iter(chunks), timeout=timeout, metadata=list(metadata))


def status_of(call) -> tuple[grpc.StatusCode, str, dict]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err = caught.value
    return err.code(), err.details(), dict(err.trailing_metadata() or ())


@pytest.fixture
def holder(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    value = torch.randn(6, 4)
    client.create_variable("w", value, optimizer=SGD)
    return server, client, value


def assert_unchanged(client, value):
    pulled = client.pull(["w"])
    assert torch.equal(pulled.tensors["w"], value), "a rejected request changed the variable"
    assert set(pulled.versions.values()) == {0}


# ---------------------------------------------------------------- error trailers


@pytest.mark.parametrize("name", ["caf\u00e9\u2603", "tab\tnew\nline\x00nul\x7f", "x" * 9000, "%41 not an escape"])
def test_any_variable_name_gets_its_real_error_and_comes_back_whole(holder, name):
    server, client, value = holder
    with pytest.raises(VariableNotFoundError) as caught:
        raw_delete(server.address, name)
    if len(name) < 1000:
        assert caught.value.variable == name
    else:  # bounded in the trailer (the message still names it)
        assert caught.value.variable.startswith(name[:100]) and caught.value.variable.endswith("\u2026")
    assert_unchanged(client, value)


def raw_delete(address: str, name: str) -> None:
    from paramserve.psserver.client.calls import typed_error

    try:
        raw_unary(address, "DeleteVariable", ps_pb2.DeleteVariableRequest(variable=name).SerializeToString())
    except grpc.RpcError as err:
        raise typed_error(err, address, None) from None


def test_metadata_values_are_printable_ascii_bounded_and_reversible():
    for text in ["caf\u00e9", "a\x00b\nc", "%20", "plain-name_1.weight"]:
        escaped = metadata_value(text)
        assert all(0x21 <= ord(c) < 0x7F for c in escaped)
        assert metadata_text(escaped) == text
    assert len(metadata_value("\u2603" * 5000)) <= 3072


def test_long_save_path_errors_stay_within_metadata_limits(start_ps, make_client, tmp_path):
    server = start_ps(token=TOKEN)
    client = make_client([server.address], token=TOKEN)
    long_path = str(tmp_path / "/".join(["d" * 300] * 12))  # under PATH_MAX; each name over NAME_MAX
    code, details, _ = status_of(
        lambda: raw_unary(
            server.address,
            "Save",
            ps_pb2.SaveRequest(directory=long_path).SerializeToString(),
            metadata=client._options.metadata(),
        )
    )
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT), details


# ---------------------------------------------------------------- typed errors instead of INTERNAL


def test_save_path_with_a_nul_byte_is_invalid(start_ps, make_client):
    server = start_ps(token=TOKEN)
    client = make_client([server.address], token=TOKEN)
    code, details, _ = status_of(
        lambda: raw_unary(
            server.address,
            "Save",
            ps_pb2.SaveRequest(directory="/tmp/a\x00b").SerializeToString(),
            metadata=client._options.metadata(),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in details


def shard_chunk(shape, *, initializer: bool, payload_bytes: int = 0, name: str = "huge") -> bytes:
    spec = tensor_pb2.ShardSpec(
        ref=tensor_pb2.ShardRef(variable=name, shard=0),
        variable_shape=list(shape),
        shard_meta=tensor_pb2.TensorMeta(dtype="float32", shape=list(shape)),
    )
    if initializer:
        spec.initializer.CopyFrom(tensor_pb2.Initializer(kind="zeros"))
    return tensor_pb2.Chunk(header=tensor_pb2.PartHeader(shard=spec, payload_bytes=payload_bytes)).SerializeToString()


@pytest.mark.parametrize("initializer", [True, False])
def test_a_huge_declared_shard_is_refused_before_anything_is_allocated(start_ps, initializer):
    server = start_ps(max_shard_bytes=1 << 30)
    shape = [1 << 20, 1 << 20]  # 4 TiB
    chunk = shard_chunk(shape, initializer=initializer, payload_bytes=0 if initializer else 4 << 40)
    code, details, trailers = status_of(lambda: raw_chunks(server.address, "CreateShards", [chunk]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-shard-bytes" in details
    assert trailers["paramserve-error"] == "MessageTooLargeError"


def test_negative_dimensions_are_invalid(start_ps):
    server = start_ps()
    chunk = shard_chunk([-(1 << 20), -(1 << 20)], initializer=True)
    code, details, _ = status_of(lambda: raw_chunks(server.address, "CreateShards", [chunk]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "negative" in details


@pytest.mark.parametrize(
    "values_json",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"lr": ' + "9" * 5000 + "}",
        '{"lr": ' + "9" * 30 + "}",
        '{"lr": {"nested": 1}}',
        '{"lr": NaN}',
    ],
)
def test_bad_hyperparameter_json_is_invalid_and_changes_nothing(holder, values_json):
    server, client, value = holder
    request = ps_pb2.SetHyperparametersRequest(variable="w", values_json=values_json).SerializeToString()
    code, details, _ = status_of(lambda: raw_unary(server.address, "SetHyperparameters", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert_unchanged(client, value)


@pytest.mark.parametrize("kwargs", [{"betas": [0.9]}, {"betas": [0.9, 0.99, 0.1]}, {"lr": -1}])
def test_bad_optimizer_arguments_are_invalid(start_ps, make_client, kwargs):
    server = start_ps()
    client = make_client([server.address])
    with pytest.raises(InvalidRequestError):
        client.create_variable("v", torch.zeros(3), optimizer=OptimizerSpec("Adam", kwargs))
    assert not any(client.list_shards().values())


def test_a_deeply_nested_manifest_at_restore_is_a_checkpoint_error(start_ps, make_client, tmp_path):
    server = start_ps(checkpoint_root=tmp_path)
    client = make_client([server.address])
    value = torch.randn(6, 4)
    client.create_variable("w", value, optimizer=SGD)
    checkpoint = tmp_path / "ckpt-00000001"
    checkpoint.mkdir()
    (checkpoint / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError) as caught:
        client.restore(str(checkpoint), list(client.layouts.values()))
    assert "nests too deeply" in str(caught.value)
    assert_unchanged(client, value)


# ---------------------------------------------------------------- memory: checked before buffering


def push_header_chunk(shape, *, payload_bytes: int, variable: str = "w") -> bytes:
    part = tensor_pb2.PushPart(
        ref=tensor_pb2.ShardRef(variable=variable, shard=0),
        values=tensor_pb2.TensorMeta(dtype="float32", shape=list(shape)),
    )
    return tensor_pb2.Chunk(header=tensor_pb2.PartHeader(push=part, payload_bytes=payload_bytes)).SerializeToString()


def test_a_push_that_does_not_fit_its_shard_is_refused_from_its_header(holder):
    server, client, value = holder
    shape = [3 << 28]  # declares 3 GiB; only the header is sent
    chunk = push_header_chunk(shape, payload_bytes=3 << 30)
    gate = threading.Event()

    def body():
        yield chunk
        gate.wait(10)  # the stream stays open: the answer must come from the header alone

    code, details, trailers = status_of(
        lambda: raw_chunks(server.address, "Push", body(), metadata=[(IDEMPOTENCY_METADATA_KEY, "k")])
    )
    gate.set()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-push-bytes" in details
    small = push_header_chunk([6, 5], payload_bytes=6 * 5 * 4)
    code, details, trailers = status_of(
        lambda: raw_chunks(server.address, "Push", [small], metadata=[(IDEMPOTENCY_METADATA_KEY, "k")])
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and trailers["paramserve-error"] == "ShapeMismatchError"
    assert "(6, 5)" in details and "(6, 4)" in details
    assert_unchanged(client, value)


def test_pull_of_repeated_rows_is_refused_and_reads_are_capped(start_ps, make_client):
    server = start_ps(max_pull_bytes=64 << 10)
    client = make_client([server.address])
    client.create_variable("t", torch.zeros(1000, 256), optimizer=SGD)  # 1 MiB
    rows = torch.zeros(1000, dtype=torch.int64).numpy().tobytes()
    item = ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="t", shard=0), sparse=True, row_indices=rows)

    def pull(items):
        with grpc.insecure_channel(server.address) as channel:
            return list(
                channel.unary_stream(f"/{SERVICE_NAME}/Pull")(
                    ps_pb2.PullRequest(items=items).SerializeToString(), timeout=10
                )
            )

    code, details, _ = status_of(lambda: pull([item]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in details
    whole = ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="t", shard=0))
    code, details, _ = status_of(lambda: pull([whole]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pull-bytes" in details
    few = client.pull_rows("t", torch.tensor([3, 1, 3]))  # the client de-duplicates
    assert few.tensors["t"].shape == (3, 256)


# ---------------------------------------------------------------- trust


def test_an_empty_token_is_a_configuration_error():
    for empty in ("", "   ", "\n"):
        with pytest.raises(ConfigurationError, match="empty"):
            check_token(empty, "PARAMSERVE_TOKEN")
    assert check_token(None, "PARAMSERVE_TOKEN") is None


def test_the_token_itself_never_travels(start_ps, make_client):
    seen: list[tuple] = []

    class Recorder(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            seen.append(tuple(details.invocation_metadata))
            return continuation(details)

    fake = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[Recorder()])
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        client = make_client([f"127.0.0.1:{port}"], token=TOKEN, retry_deadline=1.0, call_timeout=1.0)
        with pytest.raises(ParamServeError):  # the fake serves no paramserve method
            client.list_shards()
    finally:
        fake.stop(0)
    assert seen, "the client never called the fake server"
    assert all(TOKEN not in str(value) for metadata in seen for _, value in metadata)
    assert any(key == AUTH_METADATA_KEY for metadata in seen for key, _ in metadata)


def test_the_coordinator_refuses_an_unsigned_reply_from_a_fake_worker():
    """A process at a worker's address that lacks the token answers with a pickle: refused unread."""
    ran = []
    payload = pickle.dumps(ran)  # stands for attacker data: never unpickled

    def answer(request: bytes, context) -> bytes:
        return worker_pb2.RunClosuresResponse().SerializeToString() + payload[:0]

    fake = grpc.server(futures.ThreadPoolExecutor(2))
    fake.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "paramserve.wire.v1.Worker", {"RunClosures": grpc.unary_unary_rpc_method_handler(answer)}
            ),
        )
    )
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()

    async def call() -> None:
        transport = GrpcTransport(f"127.0.0.1:{port}", TOKEN, 1 << 20)
        try:
            await transport.run_closures(worker_pb2.RunClosuresRequest(), timeout=10)
        finally:
            await transport.close()

    try:
        with pytest.raises(RpcFailure) as caught:
            asyncio.run(call())
    finally:
        fake.stop(0)
    assert caught.value.code == "UNAUTHENTICATED" and "not signed" in caught.value.details


def test_a_real_worker_signs_its_reply(start_worker_with_token):
    address = start_worker_with_token

    async def call() -> worker_pb2.RunClosuresResponse:
        transport = GrpcTransport(address, TOKEN, 1 << 20)
        try:
            return await transport.run_closures(worker_pb2.RunClosuresRequest(), timeout=10)
        finally:
            await transport.close()

    assert isinstance(asyncio.run(call()), worker_pb2.RunClosuresResponse)


@pytest.fixture
def start_worker_with_token():
    from paramserve.worker.server import WorkerConfig, build_worker

    worker = build_worker(WorkerConfig(token=TOKEN, max_workers=2))
    yield worker.address
    worker.stop(grace=0)


def test_a_server_refuses_to_listen_beyond_loopback_unauthenticated(start_ps, caplog):
    with pytest.raises(ConfigurationError, match="--insecure"):
        start_ps(host="0.0.0.0")
    with caplog.at_level(logging.WARNING):
        server = start_ps(host="0.0.0.0", insecure=True)
    assert server.port > 0
    assert any("--insecure" in record.getMessage() for record in caplog.records)
    assert start_ps(host="0.0.0.0", token=TOKEN).port > 0


def test_a_busy_port_is_a_configuration_error(start_ps):
    server = start_ps()
    with pytest.raises(ConfigurationError, match="cannot listen"):
        start_ps(port=server.port)


def test_checkpoint_paths_are_confined(start_ps, make_client, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    server = start_ps(checkpoint_root=root)
    client = make_client([server.address])
    client.create_variable("w", torch.ones(4), optimizer=SGD)
    for outside in (str(tmp_path / "elsewhere"), "../escape", "/etc"):
        with pytest.raises(PermissionDeniedError, match="checkpoint root"):
            client.save(outside)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escape").exists()
    saved = client.save("run1")
    assert all(pathlib.Path(path).resolve().is_relative_to(root.resolve()) for path in saved.values())
    tokenless = start_ps()
    stranger = make_client([tokenless.address])
    with pytest.raises(PermissionDeniedError, match="--checkpoint-root"):
        stranger.save(str(tmp_path / "anywhere"))
    assert not (tmp_path / "anywhere").exists()


def test_confined_path_rules(tmp_path):
    assert confined_path(tmp_path, "a/b", authenticated=False) == tmp_path.resolve() / "a/b"
    with pytest.raises(PermissionDeniedError):
        confined_path(tmp_path, "../x", authenticated=True)
    with pytest.raises(InvalidRequestError):
        confined_path(tmp_path, "a" * 5000, authenticated=True)


# ---------------------------------------------------------------- TLS, mutual TLS


@needs_openssl
def test_mutual_tls_between_client_and_server_and_health_over_tls(start_ps, make_client, tmp_path):
    certs = make_certificates(tmp_path / "certs")
    server = start_ps(host="0.0.0.0", tls=TlsConfig(certs.cert, certs.key, certs.ca))  # client certs: may listen wide
    address = f"127.0.0.1:{server.port}"
    good = make_client([address], tls_root_certificates=certs.ca, tls_cert_chain=certs.cert, tls_private_key=certs.key)
    good.create_variable("w", torch.arange(4.0), optimizer=SGD)
    assert torch.equal(good.pull(["w"]).tensors["w"], torch.arange(4.0))
    for cert, key in ((None, None), (certs.other_cert, certs.other_key)):
        stranger = make_client(
            [address],
            tls_root_certificates=certs.ca,
            tls_cert_chain=cert,
            tls_private_key=key,
            retry_deadline=1.0,
            call_timeout=1.0,
        )
        stranger.adopt_layouts(good.layouts)
        with pytest.raises(Exception) as caught:
            stranger.pull(["w"])
        assert type(caught.value).__name__ in ("ServerUnavailableError", "AuthenticationError")
    assert check(address, 5.0, tls=credentials(certs.ca, certs.cert, certs.key)) == "SERVING"
    assert check(address, 2.0) == "UNREACHABLE", "plaintext health cannot reach a TLS server"


def test_a_client_certificate_needs_a_ca_bundle():
    from paramserve.psserver.client.ps_client import ClientConfig

    with pytest.raises(ConfigurationError):
        ClientConfig(tls_cert_chain=pathlib.Path("c.pem"), tls_private_key=pathlib.Path("k.pem")).client_tls()


def test_json_of_the_error_helpers_is_stable():
    assert json.loads(json.dumps({"k": metadata_value("é")})) == {"k": "%C3%A9"}


# ---------------------------------------------------------------- a header flood (issue 20, B1)


def _continuation_flood(port: int, frames: int, hold: threading.Event) -> None:
    """One connection that sends a request's headers as ``frames`` ~1 KB CONTINUATION frames and
    never acknowledges the server's SETTINGS: gRPC buffers the block until its settings timeout."""

    def frame(kind: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", stream) + payload

    path = b"/grpc.health.v1.Health/Check"
    headers = b"\x83\x86\x04" + bytes([len(path)]) + path
    block = b"".join(
        frame(9, 1, b"\0\x0e" + b"x-flood-%06d" % i + b"\x7f\xe9\x06" + b"v" * 1000) for i in range(frames)
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, b"") + frame(1, 1, headers) + block)
            hold.wait(60)
    except OSError:
        return


def _resident_mb(pid: int) -> float:
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in text.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def test_a_header_flood_is_dropped_at_the_settings_timeout_and_its_memory_returned(tmp_path):
    """Upstream gRPC buffers a header block before the peer acknowledges SETTINGS (about 1 MB a
    flooding connection here, bounded by --max-connections): paramserve drops such peers after
    the 10 s settings timeout, and gives the freed memory back (psserver/runtime/memory.py)."""
    (tmp_path / "token").write_text(TOKEN)
    port_file = tmp_path / "port.json"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramserve.psserver",
            "--port",
            "0",
            "--no-data-plane",
            "--token-file",
            str(tmp_path / "token"),
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    hold = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        port = json.loads(port_file.read_text())["port"]
        before = _resident_mb(server.pid)
        flooders = [threading.Thread(target=_continuation_flood, args=(port, 1000, hold)) for _ in range(150)]
        for thread in flooders:
            thread.start()
        deadline = time.monotonic() + 30
        while _resident_mb(server.pid) - before < 100:
            assert time.monotonic() < deadline, "the flood did not reach the server"
            time.sleep(0.1)
        deadline = time.monotonic() + 45  # the settings timeout, then a trim
        while _resident_mb(server.pid) - before > 40:
            assert time.monotonic() < deadline, f"still {_resident_mb(server.pid) - before:.0f} MB above before"
            time.sleep(0.2)
        assert server.poll() is None
    finally:
        hold.set()
        server.terminate()
        server.wait(30)
