"""``paramserve demo``: asynchronous parameter-server training on a local cluster.

Starts two parameter servers and two workers on 127.0.0.1, trains an MLP on
scikit-learn's bundled digits dataset with a ClusterCoordinator, writes
checkpoints, and reports test accuracy. It prints the address of the
coordinator's status page (workers, servers, live charts, events) as it starts.
The model and its data are coordinator/demos/digits.py; this module is the command.
Every process it starts is stopped on the way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.remote_value import RemoteValue, RemoteValueState

log = logging.getLogger("paramserve.demo")


@dataclass
class DemoSummary:
    test_accuracy: float
    steps: int
    duration_s: float
    checkpoint_dir: str
    workers: int
    parameter_servers: int
    final_loss: float
    state_dict: str
    status_url: str | None
    resumed_from: int = 0
    """The step of the checkpoint this run resumed from (0: a fresh start)."""
    closures: dict[str, int] | None = None
    """This run's closures as the coordinator counted them: scheduled, done, failed, retried (calls
    that failed and went back to the queue) and the steps of those done (each closure's steps count
    once, however often it was sent)."""


def run(args: argparse.Namespace) -> DemoSummary:
    from tqdm import tqdm

    from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager, export_state_dict
    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
    from paramserve.psserver.client.ps_client import ClientConfig
    from paramserve.psserver.protocol.partition import MinSizePartitioner
    from paramserve.psserver.runtime.security import writable_directory

    started = time.perf_counter()
    checkpoint_dir = (
        writable_directory(pathlib.Path(args.checkpoint_dir), "--checkpoint-dir")
        if args.checkpoint_dir
        else pathlib.Path(tempfile.mkdtemp(prefix="paramserve-demo-"))
    )
    _, _, x_test, y_test = digits_split(args.seed)
    with _cluster(args) as (spec, token):
        strategy = ParameterServerStrategy(
            spec,
            variable_partitioner=MinSizePartitioner(min_shard_bytes=16 << 10, max_shards=spec.num_ps()),
            token=token,
            client_config=ClientConfig(
                tls_root_certificates=args.tls_ca, tls_cert_chain=args.tls_cert, tls_private_key=args.tls_key
            ),
            ps_replicas=args.ps_replicas,
        )
        torch.manual_seed(args.seed)
        with strategy.scope():
            model = MLP(args.hidden)
        optimizer = strategy.optimizer(torch.optim.Adam, lr=args.lr)
        manager = CheckpointManager(strategy, checkpoint_dir, max_to_keep=3)
        step = resumed_from = manager.restore_or_initialize() or 0
        with ClusterCoordinator(
            strategy,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            status_port=None if args.no_status_page else args.status_port,
            status_host=args.status_host,
        ) as coordinator:
            status_url = advertised(coordinator.status_url, args.status_address)
            if status_url is not None:
                print(f"status page: {status_url}", file=sys.stderr, flush=True)
            batches = iter(coordinator.create_per_worker_dataset(_dataset_fn(args)))
            last = None
            reported: RemoteValue[Any] | None = None
            # A terminal gets a progress bar; a log (kubectl logs -f, docker logs) a line per checkpoint.
            lines = not args.quiet and not sys.stderr.isatty()
            if lines and step:
                print(f"resumed from the checkpoint at step {step}", file=sys.stderr, flush=True)
            with tqdm(
                total=args.steps,
                initial=min(step, args.steps),
                unit="step",
                disable=args.quiet or lines,
                file=sys.stderr,
            ) as bar:
                while step < args.steps:
                    steps = min(args.steps_per_execution, args.steps - step)
                    last = coordinator.schedule(train_step, args=(batches, model, optimizer), steps=steps)
                    step += steps
                    bar.update(steps)
                    reported = _report_finished(coordinator, reported, last, step, args.batch_size)
                    if step % args.checkpoint_every < steps or step == args.steps:
                        coordinator.join()
                        manager.save(step)
                        bar.set_postfix(loss=f"{float(last.fetch()):.3f}")
                        if lines:
                            print(
                                progress_line(step, args.steps, float(last.fetch()), coordinator.num_workers),
                                file=sys.stderr,
                                flush=True,
                            )
            coordinator.join()
            final_loss = float(last.fetch()) if last is not None else float("nan")
            workers = coordinator.num_workers
            counted = coordinator.telemetry.run.view(workers=False, events=False)
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean())
        exported = export_state_dict(strategy, checkpoint_dir / "model_state_dict.pt", model)
        strategy.close()
    return DemoSummary(
        test_accuracy=accuracy,
        steps=step,
        duration_s=round(time.perf_counter() - started, 2),
        checkpoint_dir=str(checkpoint_dir),
        workers=workers,
        parameter_servers=spec.num_ps(),
        final_loss=final_loss,
        state_dict=str(exported),
        status_url=status_url,
        resumed_from=resumed_from,
        closures={
            "scheduled": counted.scheduled,
            "done": counted.done,
            "failed": counted.failed,
            "retried": counted.retried,
            "steps": counted.steps,
        },
    )


def exit_on_sigterm() -> None:
    """SIGTERM (Kubernetes deleting the coordinator's pod, ``docker stop``) ends the demo as Ctrl-C
    does: its processes stopped, its coordinator shut down, exit status 143. Without a handler a
    container's first process (PID 1) ignores SIGTERM and is killed only when the grace period ends,
    which kept the Job's next pod (the one that resumes) waiting 30 s."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def progress_line(step: int, steps: int, loss: float, workers: int) -> str:
    """What a log shows at each checkpoint, in place of the terminal's progress bar."""
    return f"step {step}/{steps} ({100 * step / steps:.0f}%) loss {loss:.4f}, {workers} workers; checkpoint saved"


def advertised(url: str | None, address: str | None) -> str | None:
    """The status page's ``url`` with its host and port replaced by ``address`` (``host:port``, e.g.
    where ``kubectl port-forward`` serves it), its key kept; ``url`` itself without an address."""
    if url is None or not address:
        return url
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, address, parts.path, parts.query, parts.fragment))


def _report_finished(
    coordinator: Any, watched: RemoteValue[Any] | None, newest: RemoteValue[Any], step: int, batch_size: int
) -> RemoteValue[Any]:
    """Reports the loss of ``watched`` to the status page once it finished (never waits); returns
    the closure to watch next. Its step is about ``step``: only a few closures run at a time."""
    if watched is None:
        return newest
    if not watched.done():
        return watched
    if watched.state is RemoteValueState.READY:
        coordinator.report(step=step, loss=float(watched.fetch()), samples=step * batch_size)
    return newest


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[tuple[Any, str | None]]:
    """The cluster to train on: described by the environment, or started here."""
    from paramserve.coordinator.cluster import ClusterSpec
    from paramserve.coordinator.local_cluster import LocalCluster
    from paramserve.psserver.runtime.security import TOKEN_ENV, check_token, read_token_file

    if args.cluster_from_env:
        token = (
            read_token_file(args.token_file) if args.token_file else check_token(os.environ.get(TOKEN_ENV), TOKEN_ENV)
        )
        yield ClusterSpec.from_env(), token
        return
    token = secrets.token_hex(16)
    with LocalCluster(
        num_ps=args.ps,
        num_workers=args.workers,
        token=token,
        extra_ps_args=_tls_args(args, "ps"),
        extra_worker_args=_tls_args(args, "worker"),
    ) as cluster:
        yield cluster.spec, token


def _tls_args(args: argparse.Namespace, role: str) -> list[str]:
    """The servers' TLS flags: every server presents --tls-cert and requires client certificates
    signed by --tls-ca (mutual TLS); a worker presents the same certificate to the servers."""
    if args.tls_ca is None:
        return []
    served = ["--tls-cert", str(args.tls_cert), "--tls-key", str(args.tls_key), "--tls-client-ca", str(args.tls_ca)]
    return served + (["--ps-tls-ca" if role == "worker" else "--replica-tls-ca", str(args.tls_ca)])


def _dataset_fn(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import functools

    return functools.partial(worker_batches, batch_size=args.batch_size, seed=args.seed)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=1200, help="training steps in all (default: %(default)s)")
    parser.add_argument(
        "--steps-per-execution", type=int, default=4, help="steps packed into one closure (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per-step batch (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units (default: %(default)s)")
    parser.add_argument("--ps", type=int, default=2, help="parameter servers to start (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="workers to start (default: %(default)s)")
    parser.add_argument(
        "--ps-replicas",
        type=int,
        help="servers per shard group: a primary and backups that apply every push before it is "
        "acknowledged (default: PARAMSERVE_PS_REPLICAS, else 1; --ps must be a multiple)",
    )
    parser.add_argument(
        "--checkpoint-dir", help="where checkpoints go; an existing one is resumed (default: a new temp dir)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=400, help="steps between checkpoints (default: %(default)s)"
    )
    parser.add_argument(
        "--cluster-from-env",
        action="store_true",
        help="train on the cluster in PARAMSERVE_PS / PARAMSERVE_WORKERS or PARAMSERVE_WORKER_SERVICE / TF_CONFIG "
        "(token: --token-file or PARAMSERVE_TOKEN) instead of starting one",
    )
    parser.add_argument(
        "--token-file",
        type=pathlib.Path,
        help="with --cluster-from-env: file holding the cluster's shared token (a Compose or Kubernetes secret)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve the coordinator's Prometheus metrics on this port (0: a free one; default: none)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default: %(default)s; 0.0.0.0 in containers, "
        "for Prometheus to scrape it)",
    )
    parser.add_argument(
        "--status-port",
        type=int,
        default=0,
        help="serve the coordinator's status page on this port (default: a free one; the address is printed)",
    )
    parser.add_argument(
        "--status-host",
        default="127.0.0.1",
        help="address the status page listens on (default: %(default)s; beyond loopback it asks for the key "
        "derived from the cluster's token, which the printed address carries)",
    )
    parser.add_argument(
        "--status-address",
        help="host:port to print in the status page's address instead of the one it listens on: where users "
        "reach it (e.g. 127.0.0.1:8080 for kubectl port-forward svc/coordinator 8080)",
    )
    parser.add_argument("--no-status-page", action="store_true", help="serve no status page")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the train/test split, the model's initial weights and the workers' shuffling: "
        "the same seed trains the same way up to the asynchrony of the workers (default: %(default)s)",
    )
    parser.add_argument(
        "--tls-ca",
        type=pathlib.Path,
        help="mutual TLS between every process: the CA bundle that signed --tls-cert (needs both)",
    )
    parser.add_argument(
        "--tls-cert",
        type=pathlib.Path,
        help="PEM certificate every process presents (valid for 127.0.0.1, as a server and a client)",
    )
    parser.add_argument("--tls-key", type=pathlib.Path, help="PEM private key of --tls-cert")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (
        ("--steps", args.steps),
        ("--steps-per-execution", args.steps_per_execution),
        ("--ps", args.ps),
        ("--workers", args.workers),
        ("--checkpoint-every", args.checkpoint_every),
    ):
        if value < 1:
            parser.error(f"{name} must be at least 1")
    uneven = args.ps_replicas is not None and not args.cluster_from_env and args.ps % max(args.ps_replicas, 1)
    if args.ps_replicas is not None and (args.ps_replicas < 1 or uneven):
        parser.error(f"--ps-replicas must be at least 1 and divide --ps ({args.ps}), got {args.ps_replicas}")
    if len({args.tls_ca is None, args.tls_cert is None, args.tls_key is None}) > 1:
        parser.error("mutual TLS needs --tls-ca, --tls-cert and --tls-key together")
    if args.tls_ca is not None and args.cluster_from_env:
        parser.error("--tls-* start a cluster with TLS; with --cluster-from-env the cluster's own settings apply")
    exit_on_sigterm()
    summary = run(args)
    print(
        f"test accuracy {summary.test_accuracy:.4f} after {summary.steps} steps in {summary.duration_s:.1f}s "
        f"({summary.workers} workers, {summary.parameter_servers} parameter servers); "
        f"checkpoints in {summary.checkpoint_dir}"
    )
    if args.json:
        print(json.dumps(asdict(summary)))
    return 0
