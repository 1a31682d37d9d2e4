"""Serving: the process plumbing the parameter server and the worker share.

Both kinds of server are a plain-Python core behind a thin servicer; everything
around the servicer is here, once:

- the error boundary: core errors -> one status code each, named in trailing
  metadata (escaped to printable ASCII, bounded in size); anything else ->
  INTERNAL (never UNKNOWN);
- interceptors: the token check (before a request's body is read), reply
  signatures, and per-RPC Prometheus metrics (the rules are psserver.security's);
- server options (no SO_REUSEPORT, message, connection and HTTP/2
  limits), the port file that tells a launcher which port a server bound;
- ``GrpcService``: a started server with health checking and metrics, which
  refuses to listen beyond loopback unauthenticated;
- the command line both ``paramserve ps`` and ``paramserve worker`` take
  (network, security, limits, logging flags), its checked flag types, the
  one-line report of a bad configuration, and the serve-until-signal loop.
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
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from paramserve.psserver import cpus
from paramserve.psserver.atomic_files import atomic_write
from paramserve.psserver.channels import KEEPALIVE_TIME_MS, TCP_READ_OPTIONS
from paramserve.psserver.errors import (
    ERROR_METADATA_KEY,
    ERROR_VARIABLE_METADATA_KEY,
    ConfigurationError,
    InternalError,
    InvalidRequestError,
    MessageTooLargeError,
    ParamServeError,
)
from paramserve.psserver.memory import MemoryTrimmer
from paramserve.psserver.metadata import MAX_ERROR_METADATA_CHARS, metadata_value
from paramserve.psserver.metrics_http import MetricsEndpoint, register_build_info, serve_metrics
from paramserve.psserver.security import (
    AUTH_METADATA_KEY,
    REPLY_NONCE_METADATA_KEY,
    REPLY_SIGNATURE_METADATA_KEY,
    TlsConfig,
    bearer_metadata,
    check_exposure,
    check_token,
    is_reply_nonce,
    reply_key,
    reply_signature,
)
from paramserve.psserver.tf_config import ClusterSpecError, task_address

log = logging.getLogger(__name__)

HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"
_T = TypeVar("_T")


# ---------------------------------------------------------------- error boundary


def _encoded_chars(text: str) -> int:
    # gRPC percent-encodes an error's details: bytes outside printable ASCII, and '%', take 3.
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in text.encode("utf-8", "backslashreplace"))


def _prefix_within(text: str, budget: int) -> str:
    used = 0
    for index, char in enumerate(text):
        used += _encoded_chars(char)
        if used > budget:
            return text[:index]
    return text


def bounded_details(message: str, limit: int = MAX_ERROR_METADATA_CHARS) -> str:
    """``message`` with its middle cut out when gRPC's encoding of it would pass ``limit``
    characters (a longer status message makes a client fail the call with "Stream removed")."""
    if _encoded_chars(message) <= limit:
        return message
    half = (limit - 48) // 2
    head = _prefix_within(message, half)
    tail = _prefix_within(message[::-1], half)[::-1]
    return f"{head} [... {len(message) - len(head) - len(tail)} characters cut ...] {tail}"


def abort_with(context: grpc.ServicerContext, err: ParamServeError) -> NoReturn:
    """Ends the RPC with err's status code; the client re-raises the same class."""
    trailers = [(ERROR_METADATA_KEY, type(err).__name__)]
    if err.variable:
        trailers.append((ERROR_VARIABLE_METADATA_KEY, metadata_value(err.variable)))
    context.set_trailing_metadata(tuple(trailers))
    context.abort(getattr(grpc.StatusCode, err.code.value), bounded_details(err.message))
    raise AssertionError("unreachable: context.abort raises")


def _abort_internal(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    log.exception("internal error in %s", method)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, "InternalError"),))
    context.abort(grpc.StatusCode.INTERNAL, bounded_details(f"internal error in {method}: {type(exc).__name__}: {exc}"))


def _as_paramserve_error(exc: Exception) -> ParamServeError | None:
    """The client-caused problems that reach the boundary as Python's own errors."""
    if isinstance(exc, MemoryError):
        return MessageTooLargeError(
            "the server ran out of memory for this request; send smaller requests, or give the server more memory"
        )
    if isinstance(exc, RecursionError):
        return InvalidRequestError("the request nests too deeply to be read; flatten it")
    return None


def boundary_error(method: str, exc: Exception) -> ParamServeError:
    """The typed error a surprise in ``method`` becomes at a boundary other than gRPC's (the data
    plane): a known client-caused problem, else InternalError (logged with its traceback)."""
    known = _as_paramserve_error(exc)
    if known is not None:
        return known
    log.error("internal error in %s", method, exc_info=exc)
    return InternalError(bounded_details(f"internal error in {method}: {type(exc).__name__}: {exc}"))


def unary_boundary(method: Callable[..., _T]) -> Callable[..., _T]:
    """Wraps a servicer method that returns one response."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> _T:
        try:
            return method(self, request, context)
        except ParamServeError as err:
            abort_with(context, err)
        except Exception as exc:
            if _is_abort(exc, context):
                raise
            known = _as_paramserve_error(exc)
            if known is not None:
                abort_with(context, known)
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
        except Exception as exc:
            if _is_abort(exc, context):
                raise
            known = _as_paramserve_error(exc)
            if known is not None:
                abort_with(context, known)
            _abort_internal(context, method.__name__, exc)

    return wrapper


def _is_abort(exc: Exception, context: grpc.ServicerContext) -> bool:
    # context.abort() raises a plain Exception after setting the code; let it through.
    return context.code() not in (None, grpc.StatusCode.OK)


def parse(message_cls: type[_T], raw: bytes) -> _T:
    """Parses a request message; garbage becomes INVALID_ARGUMENT, not INTERNAL."""
    try:
        return message_cls.FromString(raw)  # type: ignore[attr-defined]
    except Exception as err:
        raise InvalidRequestError(f"malformed {message_cls.__name__} message ({len(raw)} bytes): {err}") from None


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


# ---------------------------------------------------------------- options, TLS, port file


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
        # or gRPC's default (one ping per 5 minutes) ends such a call with GOAWAY "too_many_pings".
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        *TCP_READ_OPTIONS,
    ]


def write_port_file(path: pathlib.Path, port: int, metrics_port: int | None) -> None:
    """Atomically tells a launcher where this server listens."""
    payload = json.dumps({"port": port, "metrics_port": metrics_port, "pid": os.getpid()}).encode()
    atomic_write(path, lambda handle: handle.write(payload))


def read_token_file(path: pathlib.Path, flag: str = "--token-file") -> str:
    """The token in ``path``; raises ConfigurationError when it cannot be read or is empty."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigurationError(
            f"{flag} {path}: cannot read it ({reason}); give a file holding the cluster's shared token"
        ) from None
    token = check_token(text, f"{flag} {path}")
    assert token is not None
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


# ---------------------------------------------------------------- the command line of every server

TOKEN_ENV = "PARAMSERVE_TOKEN"
DEFAULT_HOST = "127.0.0.1"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (a free one) to 65535."""
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 1 to 65535, or 0 for a free one")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give 1 or more")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: give 0 or more")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: give a number above 0")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every paramserve server takes (parameter server and worker alike)."""
    net = parser.add_argument_group("network")
    net.add_argument(
        "--host",
        help=f"address to listen on (default: the host of TF_CONFIG's task, else {DEFAULT_HOST}; "
        "0.0.0.0 for all, which needs a token or client certificates, or --insecure)",
    )
    net.add_argument(
        "--port",
        type=port_number,
        help="gRPC port, 1-65535; 0 picks a free one (default: the port of TF_CONFIG's task, else 0)",
    )
    net.add_argument(
        "--port-file", type=pathlib.Path, help="once serving, atomically write {port, metrics_port, pid} as JSON here"
    )
    net.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve Prometheus metrics over HTTP on this port (0: a free one; default: off)",
    )
    net.add_argument("--max-workers", type=positive_int, default=16, help="RPC handler threads (default: %(default)s)")
    net.add_argument(
        "--max-message-bytes",
        type=positive_int,
        default=64 << 20,
        help="largest gRPC message accepted (default: %(default)s); bulk data is chunked below it",
    )
    net.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections accepted at once (default: %(default)s); bounds what HTTP/2 header floods can hold",
    )
    net.add_argument(
        "--grace-seconds",
        type=float,
        default=5.0,
        help="on SIGTERM, time running RPCs get to finish (default: %(default)s)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (default: this process's share of the CPUs it may use: usable "
        "CPUs // PARAMSERVE_PROCESSES_PER_HOST, which local clusters set; see psserver/cpus.py)",
    )
    sec = parser.add_argument_group("security")
    sec.add_argument(
        "--token-file",
        type=pathlib.Path,
        help=f"file holding the cluster's shared token; calls without it get UNAUTHENTICATED (or set {TOKEN_ENV}; "
        "an empty one is an error)",
    )
    sec.add_argument("--tls-cert", type=pathlib.Path, help="PEM certificate chain: serve TLS (needs --tls-key)")
    sec.add_argument("--tls-key", type=pathlib.Path, help="PEM private key for --tls-cert")
    sec.add_argument(
        "--tls-client-ca",
        type=pathlib.Path,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback with neither a token nor client certificates (anyone who "
        "can reach the port can call it; a worker runs any code it is sent). Logs a warning",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=LOG_LEVELS,
        help=f"how much to log: {', '.join(LOG_LEVELS)} (default: %(default)s)",
    )


def resolve_address(
    args: argparse.Namespace, parser: argparse.ArgumentParser, role: str, environ: Mapping[str, str]
) -> tuple[str, int]:
    """Where the server listens: ``--host``/``--port``, else TF_CONFIG's task (a ``role`` task:
    "ps" or "worker"), else 127.0.0.1 and a free port. Exits through ``parser.error`` when
    TF_CONFIG is invalid or names another role."""
    try:
        task = task_address(role, environ) if args.host is None or args.port is None else None
    except ClusterSpecError as err:
        parser.error(str(err))
    host = args.host if args.host is not None else task[0] if task else DEFAULT_HOST
    port = args.port if args.port is not None else task[1] if task else 0
    if not 0 <= port <= 65535:
        parser.error(f"TF_CONFIG's {role} task has port {port}: give 1 to 65535")
    if task:
        log.info("listening on %s:%d, as TF_CONFIG's %s task", host, port, role)
    return host, port


def resolve_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--token-file, else PARAMSERVE_TOKEN, else None (no authentication). Raises
    ConfigurationError for a file that cannot be read and for an empty token: an empty
    PARAMSERVE_TOKEN is a mistake, not a request to run without authentication."""
    if args.token_file:
        return read_token_file(args.token_file)
    return check_token(environ.get(TOKEN_ENV), TOKEN_ENV)


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
    problem = tls_files_problem(args.tls_cert, args.tls_key, args.tls_client_ca)
    if problem is not None:
        parser.error(problem)
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)


def tls_files_problem(cert: pathlib.Path, key: pathlib.Path, client_ca: pathlib.Path | None) -> str | None:
    """What is wrong with a server's TLS files, or None: checked before serving, so that a bad
    certificate is not reported as a port that cannot be bound."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert), str(key))
    except FileNotFoundError as err:
        return f"--tls-cert/--tls-key: {err.filename} does not exist"
    except (ssl.SSLError, OSError) as err:
        return (
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate chain and its private key "
            f"({getattr(err, 'reason', None) or err}): give the files your CA issued for this server"
        )
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except (ssl.SSLError, OSError) as err:
            return f"--tls-client-ca {client_ca} is not a PEM CA bundle ({getattr(err, 'reason', None) or err})"
    return None


def check_port_file(path: pathlib.Path | None) -> None:
    """Raises ConfigurationError when ``path``'s directory cannot take the port file: checked
    before serving, so a launcher never waits for a file that cannot be written."""
    if path is None:
        return
    directory = path.parent if str(path.parent) else pathlib.Path(".")
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"--port-file {path}: its directory {directory} does not exist or is not writable by this user"
        )


def run_reporting_errors(
    runner: Callable[[argparse.Namespace, argparse.ArgumentParser], int],
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
) -> int:
    """``runner(args, parser)``; a ConfigurationError (a setting the command cannot start with)
    ends it with one line on stderr and exit status 2, with the traceback only under ``--debug``."""
    try:
        return runner(args, parser)
    except ConfigurationError as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def serve_until_signal(server: RunningService, port_file: pathlib.Path | None, grace: float, name: str) -> None:
    """Blocks until SIGTERM/SIGINT, then stops ``server`` gracefully."""
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    logging.getLogger(name).info(
        "serving on port %d (metrics port %s, %d torch threads)",
        server.port,
        server.metrics_port,
        torch.get_num_threads(),
    )
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
