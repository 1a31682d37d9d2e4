"""The health probe: is the server at ``host:port`` SERVING? (``paramserve-health``)

Container health checks run it every few seconds in every container, so it imports
only grpc and the standard ``grpc.health.v1`` messages: no torch, and no other
paramserve module (this package's ``__init__`` imports nothing eagerly). Its CPU per
probe is measured by ``benchmarks/health_probe.py`` (figure in deploy/README.md).
Kubernetes needs no probe process: its kubelet speaks ``grpc.health.v1`` itself.

Exit status: 0 when the server reports SERVING, 1 otherwise (NOT_SERVING, unknown
service, unreachable), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

UNREACHABLE = "UNREACHABLE"


def check(address: str, timeout: float, service: str = "") -> str:
    """The server's health status name (SERVING, NOT_SERVING, ...), UNREACHABLE when no answer
    came within ``timeout`` seconds, or the status code name of a failed call (e.g.
    NOT_FOUND for a service the server does not know)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            code = err.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return UNREACHABLE
            return str(code.name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("address", help="host:port of a parameter server or worker")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for the answer (default: %(default)s)")
    parser.add_argument("--service", default="",
                        help="service name to ask about (default: the whole server)")
    parser.add_argument("--quiet", action="store_true", help="print nothing; the exit status says it")
    return parser


def probe(args: argparse.Namespace) -> int:
    """Checks once, prints ``address: STATUS`` unless quiet; the exit status."""
    status = check(args.address, args.timeout, args.service)
    if not args.quiet:
        print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="paramserve-health", description=__doc__))
    return probe(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
