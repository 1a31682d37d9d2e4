"""The peer baseline: a plain torch.distributed.rpc parameter server, as a new user would write it.

1 PS process holds the model; 2 trainer processes (multiprocessing "spawn", TensorPipe over
127.0.0.1). One torch thread per process. Two forms:

- one round trip (``one_round_trip=True``, the strong peer, as Ray's asynchronous parameter
  server and a competent torch.distributed.rpc user write it): each trainer step is a local
  forward and backward, then one RPC that pushes the gradients, has the PS apply them with
  torch.optim.SGD under a lock, and returns the updated parameters (cloned under the same
  lock), which the next step computes with;
- two RPCs per step: a pull of every parameter, then the push (the form a first attempt
  takes; kept beside the other as a figure).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import MLP, fixed_batch, free_port, one_torch_thread

RPC_TIMEOUT_S = 120.0
_PS: dict[str, Any] = {}  # lives in the PS process only


def _ps_init(sizes: tuple[int, ...], lr: float) -> None:
    torch.manual_seed(0)
    params = list(MLP(sizes).parameters())
    _PS.update(params=params, optimizer=torch.optim.SGD(params, lr=lr), lock=threading.Lock())


def ps_pull() -> list[torch.Tensor]:
    with _PS["lock"]:
        return [p.detach().clone() for p in _PS["params"]]


def _apply(grads: list[torch.Tensor]) -> None:
    """One SGD step with ``grads``; the caller holds the lock."""
    for param, grad in zip(_PS["params"], grads):
        param.grad = grad
    _PS["optimizer"].step()
    for param in _PS["params"]:
        param.grad = None


def ps_push(grads: list[torch.Tensor]) -> None:
    with _PS["lock"]:
        _apply(grads)


def ps_push_and_pull(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Applies ``grads`` and returns the parameters as they are right after: one round trip."""
    with _PS["lock"]:
        _apply(grads)
        return [p.detach().clone() for p in _PS["params"]]


def _process(
    rank: int,
    port: int,
    sizes: tuple[int, ...],
    lr: float,
    warmup: int,
    steps: int,
    barrier: Any,
    results: Any,
    one_round_trip: bool,
) -> None:
    one_torch_thread()
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    from torch.distributed import rpc

    try:
        if rank == 0:
            _ps_init(sizes, lr)
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16, rpc_timeout=RPC_TIMEOUT_S
        )
        rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=3, rpc_backend_options=options)
        if rank == 0:
            barrier.wait(timeout=RPC_TIMEOUT_S)  # the trainers warmed up
            cpu = time.process_time()
            barrier.wait(timeout=RPC_TIMEOUT_S)  # the trainers are done
            results.put(("ps", time.process_time() - cpu))
        else:
            model = MLP(sizes)
            params = list(model.parameters())
            x, y = fixed_batch(rank - 1, sizes)

            def load(values: list[torch.Tensor]) -> None:
                with torch.no_grad():
                    for param, value in zip(params, values):
                        param.copy_(value)

            def step() -> None:
                if not one_round_trip:
                    load(rpc.rpc_sync("ps", ps_pull))
                for param in params:
                    param.grad = None
                F.cross_entropy(model(x), y).backward()
                grads = [p.grad for p in params]
                if one_round_trip:
                    load(rpc.rpc_sync("ps", ps_push_and_pull, args=(grads,)))
                else:
                    rpc.rpc_sync("ps", ps_push, args=(grads,))

            if one_round_trip:
                load(rpc.rpc_sync("ps", ps_pull))  # the first values; every push returns the next

            for _ in range(warmup):
                step()
            barrier.wait(timeout=RPC_TIMEOUT_S)
            start, cpu = time.monotonic(), time.process_time()
            for _ in range(steps):
                step()
            results.put(("trainer", (start, time.monotonic(), steps, time.process_time() - cpu)))
            barrier.wait(timeout=RPC_TIMEOUT_S)
        rpc.shutdown(graceful=True)
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise


@dataclass
class RpcRun:
    steps_per_s: float
    cpu_ms_per_step: float


def run_rpc_ps(
    sizes: tuple[int, ...], lr: float, steps: int, warmup: int, timeout: float = 300.0, *, one_round_trip: bool = True
) -> RpcRun:
    """Trains ``steps`` steps (summed over the 2 trainers) after ``warmup`` each; start-up excluded.
    ``one_round_trip``: each step's push returns the new parameters (else a pull, then a push)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_process,
            args=(rank, port, sizes, lr, warmup, steps // 2, barrier, results, one_round_trip),
            daemon=True,
        )
        for rank in range(3)
    ]
    for process in processes:
        process.start()
    got: list[tuple[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < 3:
            try:
                item = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError(f"the rpc parameter server failed or timed out (got {got})") from None
                continue
            if item[0] == "error":
                raise RuntimeError(f"an rpc process failed:\n{item[1]}")
            got.append(item)
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    trainers = [value for kind, value in got if kind == "trainer"]
    total = sum(t[2] for t in trainers)
    seconds = max(t[1] for t in trainers) - min(t[0] for t in trainers)
    cpu = sum(value for kind, value in got if kind == "ps") + sum(t[3] for t in trainers)
    return RpcRun(total / seconds, 1000 * cpu / total)
