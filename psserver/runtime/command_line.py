"""The command line every paramserve server takes (``paramserve ps`` and ``paramserve worker``).

- the network, security, limits and logging flags, and their checked argparse types;
- resolving them: the address (else TF_CONFIG's task), the token (``--token-file``, else
  ``PARAMSERVE_TOKEN``), TLS files checked before serving, torch threads;
- the port file that tells a launcher which port a server bound;
- the one-line report of a bad configuration (the coordinator's commands use it too), and the
  serve-until-signal loop.

Apart from serving.py, which builds and runs the gRPC server: this is the process around it
(argparse, signals, logging), which a server started from Python never touches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping

import torch

from paramserve.psserver.protocol.errors import ConfigurationError
from paramserve.psserver.runtime import cpus
from paramserve.psserver.runtime.atomic_files import atomic_write
from paramserve.psserver.runtime.diagnostics import from_environment
from paramserve.psserver.runtime.security import TOKEN_ENV, TlsConfig, check_token, read_token_file, tls_files_problem
from paramserve.psserver.runtime.serving import DEFAULT_MAX_CONNECTIONS, RunningService
from paramserve.psserver.runtime.tf_config import ClusterSpecError, task_address

__all__ = [
    "DEFAULT_HOST",
    "LOG_LEVELS",
    "add_server_arguments",
    "check_port_file",
    "configure_logging",
    "non_negative_int",
    "port_number",
    "positive_float",
    "positive_int",
    "resolve_address",
    "resolve_tls",
    "resolve_token",
    "resolve_torch_threads",
    "run_reporting_errors",
    "serve_until_signal",
    "write_port_file",
]

log = logging.getLogger(__name__)

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
        "--stop-when-stdin-closes",
        action="store_true",
        help="stop gracefully, as on SIGTERM, once standard input reaches its end: a launcher holding the "
        "pipe's other end (LocalCluster) takes its servers with it however it ends, SIGKILL included",
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
        "CPUs // PARAMSERVE_PROCESSES_PER_HOST, which local clusters set; see psserver/runtime/cpus.py)",
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


def write_port_file(path: pathlib.Path, port: int, metrics_port: int | None) -> None:
    """Atomically tells a launcher where this server listens."""
    payload = json.dumps({"port": port, "metrics_port": metrics_port, "pid": os.getpid()}).encode()
    atomic_write(path, lambda handle: handle.write(payload))


SIGNAL_POLL_SECONDS = 0.25
"""How soon the main thread runs a signal's handler at the latest (see serve_until_signal)."""


def serve_until_signal(
    server: RunningService,
    port_file: pathlib.Path | None,
    grace: float,
    name: str,
    stop_when_stdin_closes: bool = False,
) -> None:
    """Blocks until SIGTERM/SIGINT (or, with ``stop_when_stdin_closes``, the end of standard
    input), then stops ``server`` gracefully."""
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    if stop_when_stdin_closes:
        watch_launcher(sys.stdin.fileno(), stop_requested, logging.getLogger(name))
    logging.getLogger(name).info(
        "serving on port %d (metrics port %s, %d torch threads)",
        server.port,
        server.metrics_port,
        torch.get_num_threads(),
    )
    diagnostics = from_environment(name.rsplit(".", 1)[-1], server.structure_sizes)
    if diagnostics is not None:  # PARAMSERVE_DIAGNOSTICS: a dump on SIGUSR1 (runtime/diagnostics.py)
        diagnostics.install()
    if port_file:  # last: a launcher that sees the file may read everything logged before it
        write_port_file(port_file, server.port, server.metrics_port)
    # In short waits, not one: a signal the kernel hands to another thread (gRPC's, the data
    # plane's) only sets a flag, and Python runs the handler in this thread once it next wakes,
    # which a single wait() may never do. (On a loaded machine a server once logged nothing for
    # 30 s after its SIGTERM; whether this was why is not known.)
    while not stop_requested.wait(SIGNAL_POLL_SECONDS):
        pass
    logging.getLogger(name).info("stopping: draining for up to %.1fs", grace)
    server.stop(grace)


def watch_launcher(stdin: int, stop_requested: threading.Event, log: logging.Logger) -> threading.Thread:
    """Sets ``stop_requested`` once file descriptor ``stdin`` ends: the launcher's end of the
    pipe closed, which the kernel does when the launcher exits by any means (a SIGKILL, an OOM
    kill), where no atexit hook or signal handler of its own runs. Bytes written to the pipe are
    ignored. It reads the descriptor itself, not ``sys.stdin``: a daemon thread blocked inside
    a buffered reader makes the interpreter abort at exit (it cannot take the reader's lock)."""

    def watch() -> None:
        while os.read(stdin, 4096):
            pass
        log.warning("the launcher is gone (standard input closed): stopping")
        stop_requested.set()

    thread = threading.Thread(target=watch, name="paramserve-launcher-watch", daemon=True)
    thread.start()
    return thread


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
