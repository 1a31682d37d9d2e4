"""Serving: the process plumbing the parameter server and the worker share.

Both kinds of server are a plain-Python core behind a thin servicer; everything
around the servicer is here, once:

- the error boundary: core errors -> one status code each, named in trailing
  metadata; anything else -> INTERNAL (never UNKNOWN);
- interceptors: a shared-token check and per-RPC Prometheus metrics;
- channel and server options (no SO_REUSEPORT, message limits), TLS, the
  port file that tells a launcher which port a server bound;
- ``GrpcService``: a started server with health checking and metrics;
- the command line both ``paramserve ps`` and ``paramserve worker`` take
  (network, security, logging flags) and the serve-until-signal loop.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from paramserve.psserver import cpus
from paramserve.psserver.atomic_files import atomic_write
from paramserve.psserver.errors import (
    ERROR_METADATA_KEY,
    ERROR_VARIABLE_METADATA_KEY,
    InvalidRequestError,
    ParamServeError,
)
from paramserve.psserver.metrics_http import MetricsEndpoint, register_build_info, serve_metrics
from paramserve.psserver.tf_config import ClusterSpecError, task_address

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"
_T = TypeVar("_T")


# ---------------------------------------------------------------- error boundary


def abort_with(context: grpc.ServicerContext, err: ParamServeError) -> None:
    """Ends the RPC with err's status code; the client re-raises the same class."""
    trailers = [(ERROR_METADATA_KEY, type(err).__name__)]
    if err.variable:
        trailers.append((ERROR_VARIABLE_METADATA_KEY, err.variable))
    context.set_trailing_metadata(tuple(trailers))
    context.abort(getattr(grpc.StatusCode, err.code.value), err.message)


def _abort_internal(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    log.exception("internal error in %s", method)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "InternalError"),))
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


def unary_boundary(method: Callable[..., _T]) -> Callable[..., _T]:
    """Wraps a servicer method that returns one response."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> _T:
        try:
            return method(self, request, context)
        except ParamServeError as err:
            abort_with(context, err)
        except Exception as exc:  # noqa: BLE001 - the one place that turns surprises into INTERNAL
            if _is_abort(exc, context):
                raise
            _abort_internal(context, method.__name__, exc)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


def stream_boundary(method: Callable[..., Iterator[_T]]) -> Callable[..., Iterator[_T]]:
    """Wraps a servicer method that yields a response stream."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[_T]:
        try:
            yield from method(self, request, context)
        except ParamServeError as err:
            abort_with(context, err)
        except Exception as exc:  # noqa: BLE001
            if _is_abort(exc, context):
                raise
            _abort_internal(context, method.__name__, exc)

    return wrapper


def _is_abort(exc: Exception, context: grpc.ServicerContext) -> bool:
    # context.abort() raises a plain Exception after setting the code; let it through.
    return context.code() not in (None, grpc.StatusCode.OK)


def parse(message_cls: type[_T], raw: bytes) -> _T:
    """Parses a request message; garbage becomes INVALID_ARGUMENT, not INTERNAL."""
    try:
        return message_cls.FromString(raw)  # type: ignore[attr-defined]
    except Exception as err:  # noqa: BLE001 - DecodeError and friends
        raise InvalidRequestError(
            f"malformed {message_cls.__name__} message ({len(raw)} bytes): {err}"
        ) from None


# ---------------------------------------------------------------- metrics


class RpcMetrics:
    """Prometheus metrics of one server process, on a registry passed in (with the
    process's ``paramserve_build_info``)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        self.registry = registry
        self.role = role
        register_build_info(registry, role)
        self.rpcs = Counter(
            "paramserve_rpcs", "RPCs handled, by method and status code.",
            ["role", "method", "code"], registry=registry,
        )
        self.latency = Histogram(
            "paramserve_rpc_duration_seconds", "Time to handle an RPC, including its streams.",
            ["role", "method"], registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.received = Counter(
            "paramserve_received_bytes", "Message bytes received.", ["role", "method"], registry=registry
        )
        self.sent = Counter(
            "paramserve_sent_bytes", "Message bytes sent.", ["role", "method"], registry=registry
        )

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.rpcs.labels(self.role, method, code.name).inc()
        self.latency.labels(self.role, method).observe(seconds)


# ---------------------------------------------------------------- interceptors


def _rebuild_handler(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool, bool], Callable]) -> grpc.RpcMethodHandler:
    """A handler of the same kind whose behaviour is wrap(behaviour, request_streaming, response_streaming)."""
    req, resp = handler.request_streaming, handler.response_streaming
    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }
    factory, behaviour = kinds[(req, resp)]
    return factory(
        wrap(behaviour, req, resp),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (health checks are exempt,
    so orchestrators can probe without the secret)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_SERVICE_PREFIX):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return handler
        reason = "no token" if not presented else "a wrong token"
        message = (
            f"call to {handler_call_details.method} carried {reason}: pass the cluster's shared "
            "token (paramserve --token-file, or PARAMSERVE_TOKEN) as 'authorization: Bearer <token>'"
        )

        def deny(behaviour: Callable, req: bool, resp: bool) -> Callable:
            def aborting(request: Any, context: grpc.ServicerContext) -> Any:
                context.set_trailing_metadata(((ERROR_METADATA_KEY, "AuthenticationError"),))
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return aborting

        return _rebuild_handler(handler, deny)


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC by method and status, times it, and counts message bytes.

    Handlers of paramserve take and return raw bytes (they parse messages
    themselves, so garbage gets INVALID_ARGUMENT), which is what lets this
    count bytes without serialising anything twice.
    """

    def __init__(self, metrics: RpcMetrics):
        self._metrics = metrics

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        metrics = self._metrics
        received = metrics.received.labels(metrics.role, method)
        sent = metrics.sent.labels(metrics.role, method)

        def count_in(items: Iterator[Any]) -> Iterator[Any]:
            for item in items:
                if isinstance(item, (bytes, bytearray)):
                    received.inc(len(item))
                yield item

        def measure(behaviour: Callable, req: bool, resp: bool) -> Callable:
            def finish(context: grpc.ServicerContext, start: float, failed: bool) -> None:
                code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
                if isinstance(code, int):  # pragma: no cover - defensive
                    code = grpc.StatusCode.UNKNOWN
                metrics.record(method, code, time.perf_counter() - start)

            def unary_response(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                request = count_in(request) if req else _count_one(request, received)
                try:
                    response = behaviour(request, context)
                except BaseException:
                    finish(context, start, True)
                    raise
                if isinstance(response, (bytes, bytearray)):
                    sent.inc(len(response))
                finish(context, start, False)
                return response

            def stream_response(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                request = count_in(request) if req else _count_one(request, received)
                try:
                    for item in behaviour(request, context):
                        if isinstance(item, (bytes, bytearray)):
                            sent.inc(len(item))
                        yield item
                except BaseException:
                    finish(context, start, True)
                    raise
                finish(context, start, False)

            return stream_response if resp else unary_response

        return _rebuild_handler(handler, measure)


def _count_one(request: Any, counter: Any) -> Any:
    if isinstance(request, (bytes, bytearray)):
        counter.inc(len(request))
    return request


# ---------------------------------------------------------------- options, TLS, port file


TCP_READ_OPTIONS: list[tuple[str, Any]] = [
    # gRPC starts reading sockets 8 KiB at a time and grows slowly: a 0.5 MB message then costs
    # several times the CPU of the bytes (measured: a client receiving 0.47 MB spent 1.1 CPU-ms,
    # 0.37 with these). Tensor messages are large, so read large chunks from the start.
    ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 512 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        # gRPC sets SO_REUSEPORT by default: two servers could then share a port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *TCP_READ_OPTIONS,
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Fail fast on a dead peer instead of waiting for TCP timeouts.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.enable_retries", 0),  # retries are tenacity's job, in one place
        *TCP_READ_OPTIONS,
    ]


@dataclass(frozen=True)
class TlsConfig:
    """PEM files for TLS; with client_ca set, clients must present certificates too."""

    cert_file: pathlib.Path
    key_file: pathlib.Path
    client_ca_file: pathlib.Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


def write_port_file(path: pathlib.Path, port: int, metrics_port: int | None) -> None:
    """Atomically tells a launcher where this server listens."""
    payload = json.dumps({"port": port, "metrics_port": metrics_port, "pid": os.getpid()}).encode()
    atomic_write(path, lambda handle: handle.write(payload))


def read_token_file(path: pathlib.Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty; write the cluster's shared token into it")
    return token


# ---------------------------------------------------------------- a running server


class GrpcService:
    """A started gRPC server with health checking and (optionally) a metrics endpoint.

    Health reports NOT_SERVING until ``start()`` finishes and again from the
    first moment of a graceful ``stop()``, so load balancers drain it first.
    """

    def __init__(
        self,
        *,
        handlers: list[grpc.GenericRpcHandler],
        service_names: list[str],
        host: str,
        port: int,
        max_workers: int,
        max_message_bytes: int,
        metrics: RpcMetrics,
        token: str | None = None,
        tls: TlsConfig | None = None,
        metrics_port: int | None = None,
        thread_name: str = "paramserve-rpc",
    ):
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._health_pb2 = health_pb2
        self.metrics = metrics
        self.service_names = ["", *service_names]
        interceptors: list[grpc.ServerInterceptor] = [MetricsInterceptor(metrics)]
        if token:
            interceptors.append(AuthInterceptor(token))
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name)
        self.server = grpc.server(
            self._executor, interceptors=interceptors, options=server_options(max_message_bytes)
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_generic_rpc_handlers(tuple(handlers))
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{_bracket(host)}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.server_credentials())
        if self.port == 0:
            raise OSError(f"could not bind {address}: the port is taken or the host is not local")
        self.host = host
        self._metrics_port_requested = metrics_port
        self.metrics_port: int | None = None
        self._metrics_http: MetricsEndpoint | None = None
        self._stopped = False

    @classmethod
    def for_config(
        cls,
        config: Any,
        *,
        handlers: list[grpc.GenericRpcHandler],
        service_names: list[str],
        registry: CollectorRegistry,
        role: str,
    ) -> "GrpcService":
        """A service from a server config's common fields (host, port, max_workers,
        max_message_bytes, token, tls, metrics_port), with RPC metrics for ``role``."""
        return cls(
            handlers=handlers,
            service_names=service_names,
            host=config.host,
            port=config.port,
            max_workers=config.max_workers,
            max_message_bytes=config.max_message_bytes,
            metrics=RpcMetrics(registry, role=role),
            token=config.token,
            tls=config.tls,
            metrics_port=config.metrics_port,
            thread_name=f"paramserve-{role}",
        )

    def start(self) -> "GrpcService":
        self.server.start()
        if self._metrics_port_requested is not None:
            self._metrics_http = serve_metrics(self.metrics.registry, self.host, self._metrics_port_requested)
            self.metrics_port = self._metrics_http.port
        self._set_health(self._health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Graceful: health turns NOT_SERVING, new RPCs are refused, running ones get ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self._metrics_http is not None:
            self._metrics_http.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)

    def _set_health(self, status: int) -> None:
        for name in self.service_names:
            self.health.set(name, status)


class RunningService:
    """What every running paramserve server exposes (mixed into their dataclasses,
    which hold the ``service``)."""

    service: GrpcService

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def metrics_port(self) -> int | None:
        return self.service.metrics_port

    @property
    def address(self) -> str:
        return f"{_bracket(self.service.host)}:{self.port}"

    def stop(self, grace: float | None = 5.0) -> None:
        self.service.stop(grace)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ---------------------------------------------------------------- the command line of every server

TOKEN_ENV = "PARAMSERVE_TOKEN"
DEFAULT_HOST = "127.0.0.1"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every paramserve server takes (parameter server and worker alike)."""
    net = parser.add_argument_group("network")
    net.add_argument("--host", help=f"address to listen on (default: the host of TF_CONFIG's task, else {DEFAULT_HOST}; "
                                    "0.0.0.0 for all)")
    net.add_argument("--port", type=int, help="gRPC port; 0 picks a free one (default: the port of TF_CONFIG's task, "
                                              "else 0)")
    net.add_argument("--port-file", type=pathlib.Path, help="once serving, atomically write {port, metrics_port, pid} as JSON here")
    net.add_argument("--metrics-port", type=int, help="serve Prometheus metrics over HTTP on this port (0: a free one; default: off)")
    net.add_argument("--max-workers", type=int, default=16, help="RPC handler threads (default: %(default)s)")
    net.add_argument("--max-message-bytes", type=int, default=64 << 20, help="largest gRPC message accepted (default: %(default)s); bulk data is chunked below it")
    net.add_argument("--grace-seconds", type=float, default=5.0, help="on SIGTERM, time running RPCs get to finish (default: %(default)s)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch intra-op threads (default: this process's share of the CPUs it may use: usable "
                             "CPUs // PARAMSERVE_PROCESSES_PER_HOST, which local clusters set; see psserver/cpus.py)")
    sec = parser.add_argument_group("security")
    sec.add_argument("--token-file", type=pathlib.Path, help=f"file holding the cluster's shared token; calls without it get UNAUTHENTICATED (or set {TOKEN_ENV})")
    sec.add_argument("--tls-cert", type=pathlib.Path, help="PEM certificate chain: serve TLS (needs --tls-key)")
    sec.add_argument("--tls-key", type=pathlib.Path, help="PEM private key for --tls-cert")
    sec.add_argument("--tls-client-ca", type=pathlib.Path, help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help=f"how much to log: {', '.join(LOG_LEVELS)} (default: %(default)s)")


def resolve_address(args: argparse.Namespace, parser: argparse.ArgumentParser, role: str,
                    environ: Mapping[str, str]) -> tuple[str, int]:
    """Where the server listens: ``--host``/``--port``, else TF_CONFIG's task (a ``role`` task:
    "ps" or "worker"), else 127.0.0.1 and a free port. Exits through ``parser.error`` when
    TF_CONFIG is invalid or names another role."""
    try:
        task = task_address(role, environ) if args.host is None or args.port is None else None
    except ClusterSpecError as err:
        parser.error(str(err))
    host = args.host if args.host is not None else task[0] if task else DEFAULT_HOST
    port = args.port if args.port is not None else task[1] if task else 0
    if task:
        log.info("listening on %s:%d, as TF_CONFIG's %s task", host, port, role)
    return host, port


def resolve_token(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> str | None:
    if args.token_file:
        return read_token_file(args.token_file)
    return environ.get(TOKEN_ENV) or None


def resolve_torch_threads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """--torch-threads, else this process's share of the usable CPUs (psserver.cpus)."""
    try:
        return cpus.torch_threads(args.torch_threads)
    except ValueError as err:
        parser.error(f"--torch-threads: {err}")


def resolve_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsConfig | None:
    if not args.tls_cert and not args.tls_key:
        if args.tls_client_ca:
            parser.error("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        parser.error("TLS needs both --tls-cert and --tls-key")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)


def serve_until_signal(server: RunningService, port_file: pathlib.Path | None, grace: float, name: str) -> None:
    """Blocks until SIGTERM/SIGINT, then stops ``server`` gracefully."""
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    logging.getLogger(name).info("serving on port %d (metrics port %s, %d torch threads)", server.port,
                                 server.metrics_port, torch.get_num_threads())
    if port_file:  # last: a launcher that sees the file may read everything logged before it
        write_port_file(port_file, server.port, server.metrics_port)
    stop_requested.wait()
    logging.getLogger(name).info("stopping: draining for up to %.1fs", grace)
    server.stop(grace)


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
