"""Serving: the gRPC server the parameter server and the worker share.

Both kinds of server are a plain-Python core behind a thin servicer (whose error boundary is
psserver.error_boundary); the gRPC server around the servicer is here, once:

- interceptors: the token check (before a request's body is read), reply
  signatures, and per-RPC Prometheus metrics (the rules are psserver.security's);
- server options (no SO_REUSEPORT, message, connection and HTTP/2
  limits), and the file descriptors they need;
- ``GrpcService``: a started server with health checking and metrics, which
  refuses to listen beyond loopback unauthenticated.

The command line both ``paramserve ps`` and ``paramserve worker`` take, and the
serve-until-signal loop, are psserver.command_line's.
"""

from __future__ import annotations

import functools
import hmac
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from paramserve.psserver.protocol.errors import ERROR_METADATA_KEY, ConfigurationError
from paramserve.psserver.runtime.channels import KEEPALIVE_TIME_MS, TCP_READ_OPTIONS
from paramserve.psserver.runtime.memory import MemoryTrimmer
from paramserve.psserver.runtime.metrics_http import MetricsEndpoint, register_build_info, serve_metrics
from paramserve.psserver.runtime.security import (
    AUTH_METADATA_KEY,
    REPLY_NONCE_METADATA_KEY,
    REPLY_SIGNATURE_METADATA_KEY,
    TlsConfig,
    bearer_metadata,
    check_exposure,
    is_reply_nonce,
    reply_key,
    reply_signature,
)

log = logging.getLogger(__name__)

HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"


# ---------------------------------------------------------------- metrics


class RpcMetrics:
    """Prometheus metrics of one server process, on a registry passed in (with the
    process's ``paramserve_build_info``)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        self.registry = registry
        self.role = role
        register_build_info(registry, role)
        self.rpcs = Counter(
            "paramserve_rpcs",
            "RPCs handled, by method and status code.",
            ["role", "method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "paramserve_rpc_duration_seconds",
            "Time to handle an RPC, including its streams.",
            ["role", "method"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.received = Counter(
            "paramserve_received_bytes", "Message bytes received.", ["role", "method"], registry=registry
        )
        self.sent = Counter("paramserve_sent_bytes", "Message bytes sent.", ["role", "method"], registry=registry)

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.record_call(method, code.name, seconds)

    def record_call(self, method: str, code: str, seconds: float, received: int = 0, sent: int = 0) -> None:
        """One call by its status code's name (the data plane's steps count here as method
        ``DataPlaneStep``, with their frame bytes)."""
        self.rpcs.labels(self.role, method, code).inc()
        self.latency.labels(self.role, method).observe(seconds)
        if received:
            self.received.labels(self.role, method).inc(received)
        if sent:
            self.sent.labels(self.role, method).inc(sent)


# ---------------------------------------------------------------- interceptors


def _rebuild_handler(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool, bool], Callable]
) -> grpc.RpcMethodHandler:
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
    """Rejects calls that do not present the credential derived from the cluster's token
    (security.bearer_metadata; health checks are exempt, so orchestrators can probe without
    the secret). A refused call ends before its request is read: an unauthenticated caller
    cannot make the server buffer a large message."""

    def __init__(self, token: str):
        self._expected = bearer_metadata(token)[1].encode()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_SERVICE_PREFIX):
            return handler
        presented = str(dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, ""))
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        reason = "no credential" if not presented else "a wrong credential"
        message = (
            f"call to {handler_call_details.method} carried {reason}: give the caller the cluster's shared "
            "token (paramserve --token-file, PARAMSERVE_TOKEN, or ClientConfig(token=...)); paramserve "
            "clients present a credential derived from it"
        )
        # A request-streaming handler that never reads: gRPC does not buffer the request first.
        return grpc.stream_stream_rpc_method_handler(functools.partial(_deny, message))


def _deny(message: str, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "AuthenticationError"),))
    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    yield from ()  # a generator: the handler of a streaming response


class ReplySigningInterceptor(grpc.ServerInterceptor):
    """Signs the reply of a unary call that sends a nonce (security.REPLY_NONCE_METADATA_KEY):
    HMAC-SHA256 under a key derived from the token, over the method, the nonce and the reply's
    bytes, in the ``paramserve-reply-signature`` trailer. A caller that checks it knows the
    reply comes from a holder of the token (the coordinator unpickles no other worker reply)."""

    def __init__(self, token: str):
        self._key = reply_key(token)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler.response_streaming:
            return handler
        nonce = str(dict(handler_call_details.invocation_metadata or ()).get(REPLY_NONCE_METADATA_KEY, ""))
        if not is_reply_nonce(nonce):
            return handler  # nobody asked (or asked wrongly): an unsigned reply, which a checking caller refuses
        key, method = self._key, handler_call_details.method

        def sign(behaviour: Callable, req: bool, resp: bool) -> Callable:
            def signed(request: Any, context: grpc.ServicerContext) -> Any:
                response = behaviour(request, context)
                if isinstance(response, (bytes, bytearray)):
                    signature = reply_signature(key, method, nonce, bytes(response))
                    context.set_trailing_metadata(((REPLY_SIGNATURE_METADATA_KEY, signature),))
                return response

            return signed

        return _rebuild_handler(handler, sign)


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


# ---------------------------------------------------------------- options and descriptors


DEFAULT_MAX_CONNECTIONS = 1024
SETTINGS_TIMEOUT_MS = 10_000
MAX_CONNECTION_IDLE_MS = 300_000
SPARE_DESCRIPTORS = 128
"""Descriptors a server needs beyond its connections: listeners, files, the metrics endpoint."""


def ensure_descriptors(max_connections: int, listeners: int) -> int:
    """Makes sure this process may open the descriptors ``max_connections`` connections on each of
    ``listeners`` listeners need (plus SPARE_DESCRIPTORS): raises the soft limit towards the hard
    one when it is short (systemd's default soft limit, 1024, is below what the default
    --max-connections needs), and raises ConfigurationError naming both when even the hard limit
    is. Returns the soft limit now in force. A server short of descriptors would otherwise fail to
    accept connections it promised to take."""
    import resource

    needed = max_connections * listeners + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigurationError(
            f"--max-connections {max_connections} needs {needed} file descriptors, but this process may open "
            f"{hard} at most (ulimit -n; soft limit {soft}): lower --max-connections to "
            f"{max(1, (hard - SPARE_DESCRIPTORS) // listeners)} or raise the limit (ulimit -Hn, LimitNOFILE=)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


def server_options(max_message_bytes: int, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> list[tuple[str, Any]]:
    return [
        # gRPC sets SO_REUSEPORT by default: two servers could then share a port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # gRPC applies its metadata size limits only once a peer acknowledges the server's HTTP/2
        # SETTINGS; until then one connection may hold up to 16 MiB of request headers. Peers that
        # never acknowledge are dropped after this long, idle connections after five minutes, and
        # connections are capped: together they bound what header floods can hold (ARCHITECTURE.md).
        ("grpc.http2.settings_timeout", SETTINGS_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_allowed_incoming_connections", max_connections),
        # Clients ping during calls that move no data for a while (a long closure): allow their rate,
        # or gRPC's default (one ping per 5 minutes) ends such a call with GOAWAY "too_many_pings"
        # at its third ping (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is spelt so; an
        # unknown key is ignored silently, as a misspelt one was until 2026-11-26).
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        *TCP_READ_OPTIONS,
    ]


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
        insecure: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ):
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        warning = check_exposure(host, authenticated=bool(token) or bool(tls and tls.client_ca_file), insecure=insecure)
        if warning:
            log.warning("WARNING: %s", warning)
        self._health_pb2 = health_pb2
        self.metrics = metrics
        self.service_names = ["", *service_names]
        interceptors: list[grpc.ServerInterceptor] = [MetricsInterceptor(metrics)]
        if token:
            interceptors += [AuthInterceptor(token), ReplySigningInterceptor(token)]
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name)
        self.server = grpc.server(
            self._executor, interceptors=interceptors, options=server_options(max_message_bytes, max_connections)
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_generic_rpc_handlers(tuple(handlers))
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = _bind(self.server, f"{_bracket(host)}:{port}", tls)
        self.host = host
        self._metrics_port_requested = metrics_port
        self.metrics_port: int | None = None
        self._metrics_http: MetricsEndpoint | None = None
        self._stopped = False
        self._trimmer = MemoryTrimmer()

    @classmethod
    def for_config(
        cls,
        config: Any,
        *,
        handlers: list[grpc.GenericRpcHandler],
        service_names: list[str],
        registry: CollectorRegistry,
        role: str,
    ) -> GrpcService:
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
            insecure=config.insecure,
            max_connections=config.max_connections,
        )

    def start(self) -> GrpcService:
        self.server.start()
        if self._metrics_port_requested is not None:
            try:
                self._metrics_http = serve_metrics(self.metrics.registry, self.host, self._metrics_port_requested)
            except OSError as err:
                self.stop(grace=0)
                raise ConfigurationError(
                    f"cannot serve metrics on {self.host}:{self._metrics_port_requested}: {err.strerror or err}; "
                    "choose another --metrics-port (0 picks a free one)"
                ) from None
            self.metrics_port = self._metrics_http.port
        self._trimmer.start()
        self._set_health(self._health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 5.0) -> None:
        """Graceful: health turns NOT_SERVING, new RPCs are refused, running ones get ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self._trimmer.stop()
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

    def structure_sizes(self) -> dict[str, int]:
        """The sizes of what this server keeps per worker, key or connection, for its diagnostics
        (psserver/runtime/diagnostics.py); a server with such structures says so."""
        return {}


def _bind(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Adds the listening port; raises ConfigurationError when it cannot be bound."""
    why = (
        f"cannot listen on {address}: the port is in use, or the host is not an address of this machine; "
        "choose another --port (0 picks a free one) or --host"
    )
    if _port_is_taken(address):
        raise ConfigurationError(why)  # before gRPC tries, which logs its own lines about it
    try:
        port = (
            server.add_insecure_port(address)
            if tls is None
            else server.add_secure_port(address, tls.server_credentials())
        )
    except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...") for a busy port
        raise ConfigurationError(why) from None
    if port == 0:
        raise ConfigurationError(why)
    return port


def _port_is_taken(address: str) -> bool:
    """Whether something listens on ``address``'s fixed port already (port 0: never)."""
    host, _, port = address.rpartition(":")
    if port == "0":
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False  # let gRPC report it
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(sockaddr)
            except OSError:
                return True
    return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
