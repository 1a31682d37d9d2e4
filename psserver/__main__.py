"""``paramserve ps``: run one parameter server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from paramserve.psserver.protocol.streams import DEFAULT_CHUNK_BYTES
from paramserve.psserver.runtime.command_line import (
    add_server_arguments,
    check_port_file,
    configure_logging,
    non_negative_int,
    port_number,
    positive_int,
    resolve_address,
    resolve_tls,
    resolve_token,
    resolve_torch_threads,
    run_reporting_errors,
    serve_until_signal,
)
from paramserve.psserver.runtime.memory import limit_arenas
from paramserve.psserver.runtime.security import ClientTls, writable_directory
from paramserve.psserver.server import ServerConfig, build_server
from paramserve.psserver.steps.engine import DEFAULT_MAX_PULL_BYTES, DEFAULT_MAX_PUSH_BYTES
from paramserve.psserver.store.shard_store import StoreConfig


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve ps", description=__doc__)
    add_server_arguments(parser)
    data = parser.add_argument_group("data plane")
    data.add_argument(
        "--data-port",
        type=port_number,
        default=0,
        help="TCP port of the step data plane, which carries training steps without gRPC's per-call "
        "cost (clients find it through the gRPC port; default: a free one). Open it in firewalls "
        "beside the gRPC port, or fix it here to do so",
    )
    data.add_argument(
        "--no-data-plane",
        action="store_true",
        help="serve training steps over gRPC only (slower; for networks that pass nothing but gRPC)",
    )
    data.add_argument(
        "--chunk-bytes",
        type=positive_int,
        default=DEFAULT_CHUNK_BYTES,
        help="largest data chunk this server sends (default: %(default)s)",
    )
    data.add_argument(
        "--max-push-bytes",
        type=positive_int,
        default=DEFAULT_MAX_PUSH_BYTES,
        help="largest gradient part one push may declare; checked, with the shard's shape and dtype, "
        "before its bytes are received (default: %(default)s)",
    )
    data.add_argument(
        "--max-pull-bytes",
        type=positive_int,
        default=DEFAULT_MAX_PULL_BYTES,
        help="most tensor bytes one read request may ask for (default: %(default)s)",
    )
    data.add_argument(
        "--max-shard-bytes",
        type=positive_int,
        help="largest shard (value and optimizer slots) a variable may be created with (default: half "
        "this machine's memory)",
    )
    data.add_argument(
        "--idempotency-capacity",
        type=positive_int,
        default=65536,
        help="push keys remembered per shard for exactly-once updates (default: %(default)s)",
    )
    data.add_argument(
        "--allow-nonfinite", action="store_true", help="apply gradients holding NaN/Inf instead of rejecting them"
    )
    data.add_argument(
        "--max-staleness",
        type=non_negative_int,
        help="reject pushes computed more than this many versions ago (default: no bound)",
    )
    data.add_argument(
        "--replica-tls-ca",
        type=pathlib.Path,
        help="PEM CA bundle verifying this server's backups when it is a replicated primary and the servers "
        "serve TLS; it presents its own --tls-cert and --tls-key to them (default: none, and such a "
        "primary refuses backups)",
    )
    data.add_argument(
        "--checkpoint-root",
        type=pathlib.Path,
        help="Save and Restore act only under this directory (relative paths are taken from it). "
        "Default: anywhere this user may write when a token is set; a server without a token "
        "refuses Save and Restore unless it has a root",
    )
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    """The server's configuration; raises ConfigurationError (or exits through ``parser``)
    for a setting it cannot start with, before anything starts."""
    if args.chunk_bytes > args.max_message_bytes - (1 << 20):
        parser.error("--chunk-bytes must be at least 1 MiB below --max-message-bytes")
    host, port = resolve_address(args, parser, "ps", os.environ)
    token = resolve_token(args, os.environ)
    if args.replica_tls_ca is not None and args.tls_cert is None:
        parser.error("--replica-tls-ca needs --tls-cert and --tls-key: the servers it verifies serve TLS")
    replica_tls = (
        ClientTls(args.replica_tls_ca, args.tls_cert, args.tls_key) if args.replica_tls_ca is not None else None
    )
    return ServerConfig(
        host=host,
        port=port,
        metrics_port=args.metrics_port,
        max_workers=args.max_workers,
        chunk_bytes=args.chunk_bytes,
        max_message_bytes=args.max_message_bytes,
        max_push_bytes=args.max_push_bytes,
        max_pull_bytes=args.max_pull_bytes,
        max_shard_bytes=args.max_shard_bytes,
        checkpoint_root=writable_directory(args.checkpoint_root, "--checkpoint-root") if args.checkpoint_root else None,
        token=token,
        torch_threads=resolve_torch_threads(args, parser),
        tls=resolve_tls(args, parser),
        replica_tls=replica_tls,
        insecure=args.insecure,
        max_connections=args.max_connections,
        data_port=None if args.no_data_plane else args.data_port,
        store=StoreConfig(
            idempotency_capacity=args.idempotency_capacity,
            allow_nonfinite=args.allow_nonfinite,
            max_staleness=args.max_staleness,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run_reporting_errors(run, parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    limit_arenas()  # before the server's threads exist (psserver/runtime/memory.py)
    configure_logging(args.log_level, "ps")
    config = config_from_args(args, parser)
    check_port_file(args.port_file)
    server = build_server(config)
    serve_until_signal(server, args.port_file, args.grace_seconds, "paramserve.ps", args.stop_when_stdin_closes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
