"""How long hybrid training's dense group takes to form: the coordinator's rendezvous store
(coordinator/dispatch/dense_rounds.py) and --members worker processes forming a new generation
(worker/dense/group.py: DenseReplicas.begin_round), again and again.

    python benchmarks/dense_rendezvous.py [--json] [--members 2 3 4] [--formations 20]

The coordinator's side (DenseRounds, hosting its store on 127.0.0.1 under a token) plans each
generation; every member gets its round at the same moment (a line on its stdin) and reports how
long ``begin_round`` took it: connecting to the store, the gloo group's rendezvous, the exchange of
devices and of state versions. A formation's time is its slowest member's; the figure is the
median over --formations (after 2 not counted).

- dense_formation_ms_<members>: median ms to form a generation of that many members, beside the
  same with 2 members (the smallest group).
"""

from __future__ import annotations

import argparse
import inspect
import io
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import cloudpickle
import torch
from _common import Result, print_report

from paramserve.coordinator.dispatch.dense_rounds import DenseRounds, DenseSettings
from paramserve.wire.v1 import worker_pb2
from paramserve.worker.closure_access import LocalVariables
from paramserve.worker.dense.group import DenseReplicas
from paramserve.worker.messages import dense_round_from_proto, dense_round_to_proto

TOKEN = "dense-rendezvous-benchmark-token"
WARMUP = 2
VALUES = {"bias": torch.zeros(8), "weight": torch.zeros(8, 8)}


def initial_state() -> bytes:
    buffer = io.BytesIO()
    torch.save({"version": 0, "values": VALUES, "optimizer": None, "applied": []}, buffer)
    return buffer.getvalue()


def settings() -> DenseSettings:
    optimizer = cloudpickle.dumps((torch.optim.SGD, [(tuple(sorted(VALUES)), {"lr": 0.1})]))
    return DenseSettings(tuple(sorted(VALUES)), optimizer, 0)


def with_token(factory: type, *args: object, **kwargs: object) -> object:
    """``factory(*args, **kwargs)``, with the token where it takes one (older trees did not)."""
    if "token" in inspect.signature(factory).parameters:
        kwargs["token"] = TOKEN
    return factory(*args, **kwargs)


def member() -> int:
    """One member: a round per line of stdin (a DenseRound message, hex), a line of ms back."""
    torch.set_num_threads(1)
    replicas = with_token(DenseReplicas, LocalVariables())
    assert isinstance(replicas, DenseReplicas)
    print("ready", flush=True)
    for line in sys.stdin:
        round_ = dense_round_from_proto(worker_pb2.DenseRound.FromString(bytes.fromhex(line.strip())))
        started = time.perf_counter()
        replicas.begin_round(round_)
        print(f"{(time.perf_counter() - started) * 1000:.3f}", flush=True)
    replicas.close()
    return 0


def formations(members: int, count: int) -> list[float]:
    """ms of each formation (its slowest member) of ``count`` generations of ``members``."""
    rounds = with_token(DenseRounds, settings, initial_state, rendezvous_host="127.0.0.1", timeout=30.0)
    assert isinstance(rounds, DenseRounds)
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--member"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(members)
    ]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        names = [f"127.0.0.1:{6000 + rank}" for rank in range(members)]
        times = []
        for _ in range(count + WARMUP):
            lines = [dense_round_to_proto(r).SerializeToString().hex() + "\n" for r in rounds.rounds(names)]
            for process, line in zip(processes, lines):
                assert process.stdin is not None
                process.stdin.write(line)
                process.stdin.flush()
            times.append(max(float(p.stdout.readline()) for p in processes if p.stdout is not None))
            rounds.broke()  # the next round forms a new generation
        return times[WARMUP:]
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in processes:
            process.wait(60)
        rounds.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--members", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--formations", type=int, default=20)
    parser.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.member:
        return member()
    medians = {n: statistics.median(formations(n, args.formations)) for n in sorted(set([2, *args.members]))}
    results = [
        Result(f"dense_formation_ms_{n}", medians[n], "ms", medians[2], "2 members, same run") for n in args.members
    ]
    print_report("forming hybrid training's dense group", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
