"""``paramserve health ADDRESS``: exit 0 when the server at ADDRESS reports SERVING.

For scripts; uses the standard grpc.health.v1 service, over TLS when ``--tls-ca`` is given
(with a client certificate for servers that require mutual TLS: ``--tls-cert`` and
``--tls-key``). Container health checks use ``paramserve-health``
(``paramserve.psserver.runtime.health_probe``): the same question in plaintext, without loading
torch.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserve.psserver.runtime.tf_config import ClusterSpecError, parse_address


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve health", description=__doc__)
    parser.add_argument("address", help="host:port of a parameter server or worker")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: %(default)s)"
    )
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--tls-ca", type=pathlib.Path, help="PEM CA bundle: speak TLS and verify the server with it")
    parser.add_argument(
        "--tls-cert", type=pathlib.Path, help="PEM client certificate, for a server that requires mutual TLS"
    )
    parser.add_argument("--tls-key", type=pathlib.Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="name to check the server's certificate for (default: the address's host)"
    )
    return parser


def credentials(
    ca: pathlib.Path, cert: pathlib.Path | None = None, key: pathlib.Path | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files. Raises ValueError naming a file that cannot be read."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")

    def read(path: pathlib.Path | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None

    return grpc.ssl_channel_credentials(read(ca, "--tls-ca"), read(key, "--tls-key"), read(cert, "--tls-cert"))


def check(
    address: str,
    timeout: float,
    service: str = "",
    tls: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> str:
    """The server's health status name, or UNREACHABLE."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            return (
                "UNREACHABLE"
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else err.code().name
            )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        parse_address(args.address)
    except ClusterSpecError as err:  # a typo must not look like a dead server
        parser.error(str(err))
    if (args.tls_cert or args.tls_key or args.tls_server_name) and not args.tls_ca:
        parser.error("--tls-cert, --tls-key and --tls-server-name need --tls-ca")
    try:
        tls = credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    except ValueError as err:
        parser.error(str(err))
    status = check(args.address, args.timeout, args.service, tls, args.tls_server_name)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    parsed_parser = build_parser()
    sys.exit(main(parsed_parser.parse_args(), parsed_parser))
