"""``paramserve worker``: run one worker (it runs the closures a coordinator sends) until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

import torch

from paramserve.psserver.runtime.command_line import (
    add_server_arguments,
    check_port_file,
    configure_logging,
    positive_float,
    resolve_address,
    resolve_tls,
    resolve_token,
    resolve_torch_threads,
    run_reporting_errors,
    serve_until_signal,
)
from paramserve.psserver.runtime.devices import unused_gpus_warning, worker_device
from paramserve.psserver.runtime.security import read_token_file
from paramserve.worker.server import WorkerConfig, build_worker


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve worker", description=__doc__)
    add_server_arguments(parser)
    work = parser.add_argument_group("worker")
    work.add_argument(
        "--ps-token-file",
        type=pathlib.Path,
        help="token presented to parameter servers (default: the worker's own token)",
    )
    work.add_argument(
        "--ps-tls-ca",
        type=pathlib.Path,
        help="PEM CA bundle to verify parameter servers that serve TLS (default: plaintext)",
    )
    work.add_argument(
        "--ps-tls-cert",
        type=pathlib.Path,
        help="PEM client certificate chain presented to parameter servers that require mutual TLS "
        "(default: --tls-cert, when --ps-tls-ca is given)",
    )
    work.add_argument("--ps-tls-key", type=pathlib.Path, help="PEM private key of --ps-tls-cert (default: --tls-key)")
    work.add_argument(
        "--ps-retry-deadline",
        type=positive_float,
        default=60.0,
        help="seconds a closure keeps retrying an unreachable parameter server (default: %(default)s)",
    )
    work.add_argument(
        "--device",
        help="where closures compute: 'cpu' or 'cuda:N'. Default, where CUDA is available: GPU "
        "LOCAL_RANK (modulo the visible GPUs) when LOCAL_RANK is set, else cuda:0 when "
        "CUDA_VISIBLE_DEVICES is set; otherwise the CPU",
    )
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> WorkerConfig:
    if (args.ps_tls_cert or args.ps_tls_key) and not args.ps_tls_ca:
        parser.error(
            "--ps-tls-cert and --ps-tls-key need --ps-tls-ca (the CA that verifies the parameter servers): "
            "without it the worker would talk to them in plaintext"
        )
    host, port = resolve_address(args, parser, "worker", os.environ)
    return WorkerConfig(
        host=host,
        port=port,
        metrics_port=args.metrics_port,
        max_workers=args.max_workers,
        max_message_bytes=args.max_message_bytes,
        token=resolve_token(args, os.environ),
        ps_token=read_token_file(args.ps_token_file, "--ps-token-file") if args.ps_token_file else None,
        tls=resolve_tls(args, parser),
        ps_root_certificates=args.ps_tls_ca,
        ps_cert_chain=(args.ps_tls_cert or args.tls_cert) if args.ps_tls_ca else None,
        ps_private_key=(args.ps_tls_key or args.tls_key) if args.ps_tls_ca else None,
        insecure=args.insecure,
        max_connections=args.max_connections,
        ps_retry_deadline=args.ps_retry_deadline,
        torch_threads=resolve_torch_threads(args, parser),
        device=resolve_device(args, parser),
    )


def resolve_device(args: argparse.Namespace, parser: argparse.ArgumentParser) -> torch.device:
    """--device, else the default the environment gives (psserver.devices.worker_device)."""
    try:
        return worker_device(args.device)
    except ValueError as err:
        parser.error(f"--device: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run_reporting_errors(run, parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(args.log_level, "worker")
    config = config_from_args(args, parser)
    check_port_file(args.port_file)
    logging.getLogger("paramserve.worker").info("closures compute on %s", config.device)
    idle_gpus = unused_gpus_warning(args.device)
    if idle_gpus is not None:
        logging.getLogger("paramserve.worker").warning("%s", idle_gpus)
    worker = build_worker(config)
    serve_until_signal(worker, args.port_file, args.grace_seconds, "paramserve.worker", args.stop_when_stdin_closes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
