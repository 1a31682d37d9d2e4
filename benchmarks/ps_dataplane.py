"""Data-plane throughput of paramserve's parameter servers, beside baselines from the same run.

    python benchmarks/ps_dataplane.py [--json] [--repeats N] [--table-rows 10000000]

- dense_push_pull: push a 10M-float32 gradient then pull the 10M-float32 model,
  partitioned over two parameter-server processes on 127.0.0.1 (GB/s moved,
  both directions) beside a bare gRPC echo of the same bytes in the same chunks
  (raw bytes, identity serialisers, another process) that, like push-then-pull,
  uploads everything and then downloads it. The overlapped echo (chunks sent
  back as they arrive, up and down at once) and raw TCP loopback throughput are
  printed as context.
- sparse_rows: pull + push of 1,000 random rows of a 10M x 64 table (rows/s)
  beside the same on a 100k x 64 table: the ratio shows whether cost grows
  with table size (1.0 = it does not).
- sparse_rows_threads: the same on a 100k x 64 table with default thread counts
  everywhere, beside every process (both servers and this one) at one torch
  thread (OMP_NUM_THREADS=1 for the servers): fresh clusters, the sides taking
  turns, medians of --rounds. A ratio under 1 is what default threads cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import EchoServer, Result, best_of, print_report, tcp_loopback_gbps

from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.streams import DEFAULT_CHUNK_BYTES
from paramserve.psserver.protocol.types import RowGradient
from paramserve.wire.v1 import tensor_pb2

DENSE_FLOATS = 10_000_000
SPARSE_ROWS = 1000
EMBEDDING_DIM = 64


def dense_push_pull_gbps(client: ParameterServerClient, repeats: int) -> float:
    model = torch.randn(DENSE_FLOATS)
    client.create_variable(
        "dense", model, optimizer=OptimizerSpec("SGD", {"lr": 1e-6}), partitioner=FixedShardsPartitioner(2)
    )
    gradient = torch.randn(DENSE_FLOATS)

    def step() -> float:
        start = time.perf_counter()
        client.push({"dense": gradient})
        client.pull(["dense"])
        return time.perf_counter() - start

    seconds = best_of(repeats, step)
    return 2 * model.numel() * 4 / seconds / 1e9


def echo_gbps(echo: EchoServer, repeats: int, chunk_bytes: int, overlapped: bool = False) -> float:
    payload = memoryview(torch.randn(DENSE_FLOATS).numpy()).cast("B")

    def round_trip() -> float:
        start = time.perf_counter()
        echo.echo_bytes(payload, chunk_bytes, overlapped)
        return time.perf_counter() - start

    seconds = best_of(repeats, round_trip)
    return 2 * len(payload) / seconds / 1e9


def sparse_rows_per_second(client: ParameterServerClient, name: str, rows: int, repeats: int) -> float:
    zeros = tensor_pb2.Initializer(kind="zeros")
    client.create_variable(
        name,
        shape=(rows, EMBEDDING_DIM),
        initializer=zeros,
        optimizer=OptimizerSpec("Adagrad", {"lr": 0.1}),
        partitioner=FixedShardsPartitioner(2),
    )
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        indices = torch.randint(0, rows, (SPARSE_ROWS,), generator=generator)
        start = time.perf_counter()
        looked_up = client.pull_rows(name, indices).tensors[name]
        client.push({name: RowGradient(indices, torch.ones_like(looked_up))})
        return time.perf_counter() - start

    return SPARSE_ROWS / best_of(repeats, step)


def sparse_rows_at(threads: int | None, rows: int, repeats: int, ps_args: tuple[str, ...], chunk_bytes: int) -> float:
    """sparse_rows on a fresh 2-server cluster: default thread counts (None), or every process at
    ``threads`` (the servers through OMP_NUM_THREADS, this process through torch)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    try:
        with LocalCluster(num_ps=2, num_workers=0, env=env, extra_ps_args=ps_args) as cluster:
            config = ClientConfig(chunk_bytes=chunk_bytes, call_timeout=600, retry_deadline=600)
            with ParameterServerClient(cluster.parameter_servers, config) as client:
                return sparse_rows_per_second(client, "table", rows, repeats)
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--table-rows", type=int, default=10_000_000, help="rows of the large embedding table")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the sparse_rows_threads comparison")
    args = parser.parse_args(argv)

    tcp = tcp_loopback_gbps(1 << 30)
    print(f"raw TCP loopback (one way, another process): {tcp:.2f} GB/s")
    echo = EchoServer()
    try:
        echo_rate = echo_gbps(echo, args.repeats, args.chunk_bytes)
        overlapped_rate = echo_gbps(echo, args.repeats, args.chunk_bytes, overlapped=True)
    finally:
        echo.close()
    print(
        f"bare gRPC echo of {DENSE_FLOATS * 4 / 1e6:.0f} MB in {args.chunk_bytes} B chunks, "
        f"upload then download: {echo_rate:.2f} GB/s (overlapped: {overlapped_rate:.2f} GB/s)"
    )

    ps_args = ("--chunk-bytes", str(args.chunk_bytes), "--max-workers", "4")
    with LocalCluster(num_ps=2, num_workers=0, extra_ps_args=ps_args) as cluster:
        config = ClientConfig(chunk_bytes=args.chunk_bytes, call_timeout=600, retry_deadline=600)
        with ParameterServerClient(cluster.parameter_servers, config) as client:
            dense = dense_push_pull_gbps(client, args.repeats)
            print(f"dense push+pull: {dense:.2f} GB/s")
            small = sparse_rows_per_second(client, "table_small", 100_000, args.repeats * 4)
            large = sparse_rows_per_second(client, "table_large", args.table_rows, args.repeats * 4)
            print(f"sparse rows/s: {large:.0f} on {args.table_rows} rows, {small:.0f} on 100k rows")
    by_default: list[float] = []
    one_thread: list[float] = []
    for round_ in range(args.rounds):  # the sides take turns, so drifts of a shared machine hit both
        by_default.append(sparse_rows_at(None, 100_000, args.repeats * 4, ps_args, args.chunk_bytes))
        one_thread.append(sparse_rows_at(1, 100_000, args.repeats * 4, ps_args, args.chunk_bytes))
        print(
            f"  [sparse_rows_threads round {round_ + 1}/{args.rounds}] default threads {by_default[-1]:.0f} rows/s, "
            f"one thread per process {one_thread[-1]:.0f} rows/s",
            flush=True,
        )

    results = [
        Result(
            "dense_push_pull", dense, "GB/s", echo_rate, "bare gRPC echo, identity serializers, upload then download"
        ),
        Result("sparse_rows", large, "rows/s", small, "same on a 100k-row table"),
        Result(
            "sparse_rows_threads",
            statistics.median(by_default),
            "rows/s",
            statistics.median(one_thread),
            f"one torch thread per process (OMP_NUM_THREADS=1), 100k-row table, median of {args.rounds}",
        ),
    ]
    print_report("ps_dataplane", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
