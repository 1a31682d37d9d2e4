"""``paramserve health ADDRESS``: exit 0 when the server at ADDRESS reports SERVING.

For container health checks and scripts; uses the standard grpc.health.v1 service.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve health", description=__doc__)
    parser.add_argument("address", help="host:port of a parameter server or worker")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: %(default)s)")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    return parser


def check(address: str, timeout: float, service: str = "") -> str:
    """The server's health status name, or UNREACHABLE."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return "UNREACHABLE" if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    status = check(args.address, args.timeout, args.service)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    parsed_parser = build_parser()
    sys.exit(main(parsed_parser.parse_args(), parsed_parser))
