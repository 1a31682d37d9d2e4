"""``paramserve ps``: run one parameter server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import sys

from paramserve.psserver.server import ServerConfig, build_server
from paramserve.psserver.serving import (
    add_server_arguments,
    configure_logging,
    resolve_address,
    resolve_tls,
    resolve_token,
    resolve_torch_threads,
    serve_until_signal,
)
from paramserve.psserver.store import StoreConfig
from paramserve.psserver.streams import DEFAULT_CHUNK_BYTES


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve ps", description=__doc__)
    add_server_arguments(parser)
    data = parser.add_argument_group("data plane")
    data.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="largest data chunk this server sends (default: %(default)s)")
    data.add_argument("--max-push-bytes", type=int, default=16 << 30, help="largest gradient part accepted in one push (default: %(default)s)")
    data.add_argument("--idempotency-capacity", type=int, default=65536, help="push keys remembered per shard for exactly-once updates (default: %(default)s)")
    data.add_argument("--allow-nonfinite", action="store_true", help="apply gradients holding NaN/Inf instead of rejecting them")
    data.add_argument("--max-staleness", type=int, help="reject pushes computed more than this many versions ago (default: no bound)")
    return parser






def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerConfig:
    if args.chunk_bytes <= 0 or args.chunk_bytes > args.max_message_bytes - (1 << 20):
        parser.error("--chunk-bytes must be positive and at least 1 MiB below --max-message-bytes")
    host, port = resolve_address(args, parser, "ps", os.environ)
    return ServerConfig(
        host=host,
        port=port,
        metrics_port=args.metrics_port,
        max_workers=args.max_workers,
        chunk_bytes=args.chunk_bytes,
        max_message_bytes=args.max_message_bytes,
        max_push_bytes=args.max_push_bytes,
        token=resolve_token(args, os.environ),
        torch_threads=resolve_torch_threads(args, parser),
        tls=resolve_tls(args, parser),
        store=StoreConfig(
            idempotency_capacity=args.idempotency_capacity,
            allow_nonfinite=args.allow_nonfinite,
            max_staleness=args.max_staleness,
        ),
    )






def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(args.log_level, "ps")
    config = config_from_args(args, parser)
    server = build_server(config)
    serve_until_signal(server, args.port_file, args.grace_seconds, "paramserve.ps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
