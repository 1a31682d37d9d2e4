"""Shared pieces of the benchmarks: baselines measured in the same run, and the report format."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass

import grpc
import torch
import torch.nn.functional as F
from torch import nn

ECHO_METHOD = "/paramserve.bench.Echo/Stream"
COLLECT_METHOD = "/paramserve.bench.Echo/Collect"
UNARY_METHOD = "/paramserve.bench.Echo/Unary"


@dataclass
class Result:
    metric: str
    value: float
    unit: str
    baseline: float
    baseline_name: str

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")


# ------------------------------------------------------------------ the training benchmarks' model

SMALL = (784, 256, 128, 10)
"""MLP 784-256-128-10: 0.94 MB of float32."""
LARGE = (784, 4096, 2048, 10)
"""MLP 784-4096-2048-10: 11.6M parameters, 46.5 MB of float32."""
BATCH = 64


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def fixed_batch(index: int, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed random batch per trainer (seeded by its index), reused every step."""
    generator = torch.Generator().manual_seed(1000 + index)
    return (
        torch.randn(BATCH, sizes[0], generator=generator),
        torch.randint(0, sizes[-1], (BATCH,), generator=generator),
    )


# What the training benchmarks' workers run. Workers import these (BENCHMARKS_DIR is on their
# PYTHONPATH, as a deployment ships its code in the image), so closures name them by reference.

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))


def worker_environment() -> dict[str, str]:
    """Environment for cluster processes: one torch thread, and this directory importable."""
    path = os.pathsep.join(p for p in (BENCHMARKS_DIR, os.environ.get("PYTHONPATH", "")) if p)
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path}


def noop() -> int:
    return 1


def make_batch(sizes: tuple[int, ...]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A per-worker resource: each worker builds its own fixed batch from these sizes."""

    def batch(context: object) -> tuple[torch.Tensor, torch.Tensor]:
        return fixed_batch(context.worker_index, sizes)

    return batch


def train_step(
    batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer
) -> torch.Tensor:
    x, y = batch
    device = next(model.parameters()).device
    if x.device != device:  # a GPU worker's parameters live on its device
        x, y = x.to(device), y.to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def one_torch_thread() -> None:
    """One intra-op thread in this process and its children (both sides of a comparison alike)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """Median of ``repeats`` timings (seconds) after one warm-up run."""
    run()
    return statistics.median(run() for _ in range(repeats))


def print_report(benchmark: str, results: list[Result], as_json: bool) -> None:
    width = max(len(r.metric) for r in results)
    print(f"\n{benchmark}")
    print(f"{'metric'.ljust(width)}  {'value':>12}  {'baseline':>12}  ratio  unit   (baseline)")
    for r in results:
        print(
            f"{r.metric.ljust(width)}  {r.value:12.4g}  {r.baseline:12.4g}  {r.ratio:5.2f}  {r.unit:6} "
            f"({r.baseline_name})"
        )
    if as_json:
        payload = {
            "benchmark": benchmark,
            "results": [{**{k: v for k, v in asdict(r).items()}, "ratio": r.ratio} for r in results],
        }
        print(json.dumps(payload))


# ------------------------------------------------------------------ raw TCP loopback


def _tcp_sink(port_queue: multiprocessing.Queue[int], total: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        connection, _ = server.accept()
        with connection:
            buffer = bytearray(4 << 20)
            view = memoryview(buffer)
            received = 0
            while received < total:
                n = connection.recv_into(view)
                if not n:
                    break
                received += n
            connection.sendall(b"k")


def tcp_loopback_gbps(total_bytes: int) -> float:
    """One-way throughput of a plain TCP socket on 127.0.0.1 to another process (GB/s)."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sink = context.Process(target=_tcp_sink, args=(ports, total_bytes), daemon=True)
    sink.start()
    port = ports.get(timeout=60)
    payload = memoryview(bytearray(4 << 20))
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        start = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            sock.sendall(payload[: min(len(payload), total_bytes - sent)])
            sent += min(len(payload), total_bytes - sent)
        sock.recv(1)
        seconds = time.perf_counter() - start
    sink.join(timeout=30)
    return total_bytes / seconds / 1e9


# ------------------------------------------------------------------ bare gRPC echo server (another process)


def _echo_server(port_queue: multiprocessing.Queue[int], max_message: int) -> None:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
        ],
    )
    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(lambda requests, context: requests),
        # Receives every chunk, then sends them all back: upload, then download, like push then pull.
        "Collect": grpc.stream_stream_rpc_method_handler(lambda requests, context: iter(list(requests))),
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("paramserve.bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    server.wait_for_termination()


class EchoServer:
    """A gRPC server in another process that echoes raw bytes (identity serialisers):
    the fastest gRPC can carry bytes, the baseline for the data plane."""

    def __init__(self, max_message: int = 64 << 20):
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        self._process = context.Process(target=_echo_server, args=(ports, max_message), daemon=True)
        self._process.start()
        self.port = ports.get(timeout=60)
        options = [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options)
        self.stream = self.channel.stream_stream(ECHO_METHOD)
        self.collect = self.channel.stream_stream(COLLECT_METHOD)
        self.unary = self.channel.unary_unary(UNARY_METHOD)
        grpc.channel_ready_future(self.channel).result(timeout=60)

    def echo_bytes(self, payload: memoryview, chunk_bytes: int, overlapped: bool = False) -> int:
        """Sends payload in chunks and reads every chunk back; returns bytes moved (both ways).

        overlapped=False: the server receives everything, then answers (upload then
        download, as a push followed by a pull). True: chunks come back as they arrive.
        """
        chunks = (payload[i : i + chunk_bytes].tobytes() for i in range(0, len(payload), chunk_bytes))
        call = self.stream if overlapped else self.collect
        received = sum(len(c) for c in call(chunks, timeout=120))
        return len(payload) + received

    def close(self) -> None:
        self.channel.close()
        self._process.terminate()
        self._process.join(timeout=30)


# ------------------------------------------------------------------ many workers in few processes


def serve_workers(
    count: int, addresses: multiprocessing.Queue[list[str]], stop: multiprocessing.synchronize.Event
) -> None:
    """Runs ``count`` real worker gRPC servers in this process (spawn target) until ``stop``."""
    from paramserve.worker.server import WorkerConfig, build_worker

    torch.set_num_threads(1)
    workers = [build_worker(WorkerConfig(host="127.0.0.1", port=0, max_workers=2)) for _ in range(count)]
    addresses.put([f"127.0.0.1:{worker.port}" for worker in workers])
    stop.wait()
    for worker in workers:
        worker.stop(grace=None)


def memory_mb(pid: int, field: str) -> float:
    """A memory figure of a live process in MB: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def process_threads_and_rss_mb(pid: int) -> tuple[int, float]:
    """Live OS threads and resident memory (MB) of a process, from /proc."""
    threads = rss_kb = 0
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return threads, rss_kb / 1024
