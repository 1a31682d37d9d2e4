"""Dynamic embedding tables under a stream of distinct ids: memory against a cap, eviction by
age, and what a live row costs as the table grows.

    python benchmarks/dynamic_embedding.py [--json] [--ids 10000000] [--cap-mb 128]
        [--batch 65536] [--ttl-rows 200000] [--rows 1000000,10000000]
        [--inc-rows 1000000] [--inc-steps 1000] [--inc-batch 1024] [--only cap,ttl,growth,incremental]

Two ``paramserve ps`` processes (one torch thread each); this process drives them through the
client a worker uses (one exchange per server for a lookup, one for the push of the row
gradients), with dim-16 float32 rows and Adagrad (value + sum: 128 bytes of state a row).

Resident memory is read 12 s after the last call, once the servers' trimmer has returned what
the calls freed (as ps_memory.py does).

- dyn_rss_vs_cap: --ids distinct ids (each looked up once and pushed once) stream through a
  table capped at --cap-mb per server (``max_bytes``); the larger server's resident growth
  (VmRSS after the stream, less before the table existed) beside the cap. The issue asks <= 1.1.
  Before the baseline is read, a small dynamic table is made, stepped and deleted (warm-up): the
  first dynamic lookup and push page in about 14 MB of torch's code (file-backed, shared, the
  same for a table of any size), which is the server's, not the table's. The report also gives
  each server's anonymous and file-backed growth (RssAnon, RssFile).
- dyn_ttl_evicted: --ttl-rows rows are made and updated once; then other ids' pushes advance
  the table past ``ttl_steps`` plus one sweep period (a tenth of the TTL): the share of those
  rows gone (exported live rows counted), beside all of them.
- dyn_bytes_per_row_<n>: tables grown to n live rows (no cap; one server process per size):
  resident growth per live row, beside dim x (1 + slots) x 4 = 128 bytes.
- dyn_us_per_row_<n>: at n live rows, the time a lookup and a push of a batch of existing ids
  take per row (median of 25 batches after 5 untimed ones: of 5, it swung by 15 % between
  runs). The rows are made in a random order of their ids, as ids arrive in a real stream, so
  a server's slots for a batch of ids are in no particular order.
- dyn_incremental_save_bytes: a table of --inc-rows live rows saved whole by a CheckpointManager
  (``full_every=10``), then --inc-steps steps of --inc-batch ids each (skewed: id =
  rows x u^2, u uniform), then saved again: the bytes of that delta checkpoint (its directory:
  manifest and files), beside the bytes of the rows those steps touched, dim x (1 + slots) x 4
  + 8 (the id) = 136 bytes a row. The issue asks <= 1.2.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from _common import Result, memory_mb, one_torch_thread, print_report, worker_environment

from paramserve.coordinator import (
    CheckpointManager,
    DynamicEmbedding,
    LocalCluster,
    ParameterServerStrategy,
)
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import RowGradient

DIM = 16
ROW_STATE_BYTES = DIM * 2 * 4  # value and Adagrad's sum, float32
SHAPE = {"t": (DIM, torch.float32)}
WARM_BATCHES = 5
"""Batches stepped before the timed ones: the first after the pause for the memory reading run
slower (pages the trim returned are faulted in again)."""
TRIM_WAIT_SECONDS = 12.0
"""Longer than the servers' trimming interval (psserver/runtime/memory.py): what a step freed is back."""


def cluster() -> LocalCluster:
    return LocalCluster(num_ps=2, num_workers=1, env=worker_environment(), extra_ps_args=["--torch-threads", "1"])


def table(client: ParameterServerClient, **settings: object) -> None:
    config = DynamicTableConfig(dim=DIM, optimizer=OptimizerSpec("Adagrad", {"lr": 0.01}), **settings)  # type: ignore[arg-type]
    client.dynamic.create("t", config)


def step(client: ParameterServerClient, ids: torch.Tensor, key: str) -> None:
    """A worker's step on the table: look the ids up, push a gradient for each."""
    found, versions = client.pull_unique_rows({"t": ids}, dynamic=SHAPE)
    client.push(
        {"t": RowGradient(found["t"].ids, torch.full((found["t"].ids.numel(), DIM), 0.01))},
        key=key,
        base_versions=versions,
    )


def rss(local: LocalCluster) -> list[float]:
    return [memory_mb(p.pid, "VmRSS") for p in local.processes if p.role == "ps"]


def rss_kinds(pid: int) -> tuple[float, float]:
    """(RssAnon, RssFile) of ``pid`` in MB."""
    return memory_mb(pid, "RssAnon"), memory_mb(pid, "RssFile")


def live(client: ParameterServerClient) -> list[int]:
    return [s.live_rows for per in client.dynamic.stats().values() for s in per]


def warm_up(client: ParameterServerClient) -> None:
    """A small dynamic table made, stepped and deleted: the code paths a table's calls run are
    paged in before the baseline (see the module docstring)."""
    table(client, max_bytes=1 << 20)
    for n in range(4):
        step(client, torch.arange(n * 4096, (n + 1) * 4096) * 2654435761, f"w{n}")
    client.delete_variable("t")
    time.sleep(TRIM_WAIT_SECONDS)


def stream_under_cap(ids: int, cap_mb: int, batch: int) -> Result:
    with cluster() as local:
        client = ParameterServerClient(local.spec.parameter_servers, ClientConfig())
        fresh = rss(local)
        warm_up(client)
        before = rss(local)
        kinds_before = [rss_kinds(p.pid) for p in local.processes if p.role == "ps"]
        table(client, max_bytes=cap_mb << 20)
        started = time.perf_counter()
        for n, start in enumerate(range(0, ids, batch)):
            step(client, torch.arange(start, min(ids, start + batch)) * 2654435761, f"s{n}")
        seconds = time.perf_counter() - started
        time.sleep(TRIM_WAIT_SECONDS)
        after = rss(local)
        kinds_after = [rss_kinds(p.pid) for p in local.processes if p.role == "ps"]
        rows = live(client)
        client.close()
    growth = max(a - b for a, b in zip(after, before))
    kinds = [tuple(round(a - b, 1) for a, b in zip(x, y)) for x, y in zip(kinds_after, kinds_before)]
    print(
        f"  [cap] {ids:,} ids in {seconds:.0f} s ({ids / seconds:,.0f} ids/s); live rows per server {rows}; "
        f"RSS growth {[round(a - b, 1) for a, b in zip(after, before)]} MB (anon, file: {kinds}; "
        f"from before the warm-up: {[round(a - b, 1) for a, b in zip(after, fresh)]}) against a cap of {cap_mb} MB",
        flush=True,
    )
    return Result("dyn_rss_vs_cap", growth, "MB", cap_mb, f"max_bytes per server ({ids:,} distinct ids)")


def ttl_eviction(rows: int, batch: int) -> Result:
    ttl = 20
    with cluster() as local:
        client = ParameterServerClient(local.spec.parameter_servers, ClientConfig())
        table(client, ttl_steps=ttl)
        old = torch.arange(rows)
        for n, start in enumerate(range(0, rows, batch)):
            step(client, old[start : start + batch], f"old{n}")
        made = sum(live(client))
        others = torch.arange(-1000, 0)
        # Every push advances both shards' step; ttl + one sweep period (ttl / 10) later.
        for n in range(ttl + max(1, ttl // 10) + 1):
            step(client, others, f"new{n}")
        held = torch.cat([s.ids for per in client.dynamic.export(["t"]).values() for s in per])
        left = int((held >= 0).sum())
        client.close()
    print(f"  [ttl] {made:,} rows made; {left:,} of them left one sweep period past their TTL", flush=True)
    return Result("dyn_ttl_evicted", (rows - left) / rows, "share", 1.0, f"{rows:,} rows past ttl_steps={ttl}")


def growth(sizes: list[int], batch: int) -> list[Result]:
    results = []
    for size in sizes:
        with cluster() as local:
            client = ParameterServerClient(local.spec.parameter_servers, ClientConfig())
            before = rss(local)
            table(client)
            arrival = torch.randperm(size, generator=torch.Generator().manual_seed(0))
            for start in range(0, size, batch):
                client.pull_unique_rows({"t": arrival[start : start + batch]}, dynamic=SHAPE)
            time.sleep(TRIM_WAIT_SECONDS)
            after = rss(local)
            held = sum(live(client))
            timings = []
            for n in range(WARM_BATCHES + 25):
                ids = torch.randint(0, size, (batch,)).unique()
                started = time.perf_counter()
                step(client, ids, f"t{n}")
                timings.append((time.perf_counter() - started) / ids.numel() * 1e6)
            del timings[:WARM_BATCHES]
            client.close()
        per_row = sum(a - b for a, b in zip(after, before)) * 2**20 / held
        cost = statistics.median(timings)
        print(f"  [{size:,} rows] {per_row:.0f} bytes a row resident; lookup + push {cost:.2f} us a row", flush=True)
        results.append(Result(f"dyn_bytes_per_row_{size}", per_row, "B", ROW_STATE_BYTES, "dim x (1 + slots) x 4"))
        results.append(Result(f"dyn_us_per_row_{size}", cost, "us", cost, "itself"))
    return results


def incremental_save(rows: int, steps: int, batch: int) -> Result:
    with cluster() as local, tempfile.TemporaryDirectory() as root:
        strategy = ParameterServerStrategy(local.spec)
        with strategy.scope():
            DynamicEmbedding(DIM, name="t")
        strategy.optimizer(torch.optim.Adagrad, lr=0.01)
        strategy.materialize()
        client = strategy.client
        for start in range(0, rows, 65536):
            client.pull_unique_rows({"t": torch.arange(start, min(rows, start + 65536))}, dynamic=SHAPE)
        manager = CheckpointManager(strategy, root, full_every=10)
        full = manager.save(0)
        generator = torch.Generator().manual_seed(0)
        touched = torch.zeros(rows, dtype=torch.bool)
        for n in range(steps):
            ids = (rows * torch.rand(batch, generator=generator) ** 2).long()
            step(client, ids, f"inc-{n}")
            touched[ids] = True
        started = time.perf_counter()
        delta = manager.save(steps)
        seconds = time.perf_counter() - started
        written = sum(f.stat().st_size for f in pathlib.Path(delta).iterdir())
        whole = sum(f.stat().st_size for f in pathlib.Path(full).iterdir())
        strategy.close()
    count = int(touched.sum())
    baseline = count * (ROW_STATE_BYTES + 8)
    print(
        f"  [incremental] {rows:,} rows saved whole ({whole / 2**20:.1f} MiB); {steps} steps touched {count:,} of "
        f"them; the delta: {written / 2**20:.1f} MiB in {seconds:.1f} s",
        flush=True,
    )
    return Result(
        "dyn_incremental_save_bytes", written, "B", baseline, f"{count:,} rows touched x (dim x (1 + slots) x 4 + 8)"
    )


GROUPS = ("cap", "ttl", "growth", "incremental")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ids", type=int, default=10_000_000)
    parser.add_argument("--cap-mb", type=int, default=128)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--ttl-rows", type=int, default=200_000)
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--inc-rows", type=int, default=1_000_000)
    parser.add_argument("--inc-steps", type=int, default=1000)
    parser.add_argument("--inc-batch", type=int, default=1024)
    parser.add_argument("--only", default=",".join(GROUPS), help=f"a comma-separated subset of {GROUPS}")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(GROUPS):
        parser.error(f"--only takes {GROUPS}, got {sorted(only - set(GROUPS))}")
    one_torch_thread()
    results = []
    if "cap" in only:
        results.append(stream_under_cap(args.ids, args.cap_mb, args.batch))
    if "ttl" in only:
        results.append(ttl_eviction(args.ttl_rows, args.batch))
    if "growth" in only:
        sized = growth([int(n) for n in args.rows.split(",")], args.batch)
        first_cost = sized[1].value
        for result in sized[1::2]:  # time per row at each size, beside the smallest's
            result.baseline, result.baseline_name = first_cost, "the smallest table's"
        results += sized
    if "incremental" in only:
        results.append(incremental_save(args.inc_rows, args.inc_steps, args.inc_batch))
    print_report("dynamic embedding tables", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
