"""The coordinator's status page: the cluster, the training and its events in a browser.

``ClusterCoordinator(status_port=...)`` serves it at ``http://status_host:port/``, built from what
the coordinator's telemetry already keeps (``coordinator.cluster_status``), with nothing else to
run:

- ``/`` is HTML whose tables are rendered here, so it reads without JavaScript (and refreshes
  itself every few seconds then); a small inline script polls ``/status.json`` every second and
  redraws the tables, the charts and the timeline (``coordinator.status_html``);
- ``/status.json`` is the status itself, which ``paramserve status ADDRESS`` prints; with
  ``?since=CURSOR`` (the ``cursor`` of the answer before) only what the reader lacks of the charts
  and the timeline (``cluster_status.Cursor``), which is what the page's script asks for: an
  answer then costs the same however long the charts are; a cursor that is not one is 400;
- anything else is 404, any method but GET 405.

Threads, all named and stopped by ``stop()`` (``ClusterCoordinator.shutdown``):
``paramserve-status`` samples the run once a ``interval`` (the charts' history, bounded; the
parameter servers' shards and versions, probed with a deadline; new checkpoints),
``paramserve-status-http`` does every connection's I/O (``page_server.PageServer``: bounded
connections, a deadline for each request and reply, descriptors kept for the coordinator), and
``PageLimits.answer_threads`` threads ``paramserve-status-request_N`` turn whole requests into
replies (the standard library's ``BaseHTTPRequestHandler``, on the request's bytes).

Exposure: loopback by default. With the cluster's token every request must present the page's
key (``status_key``: derived from the token, read-only, so the address with ``?key=`` that
``status_url`` gives can be shared without sharing the token), as ``?key=`` or
``Authorization: Bearer``. Beyond loopback without a token the coordinator refuses to serve it
(``check_status_exposure``).
"""

from __future__ import annotations

import hmac
import http.server
import io
import logging
import math
import os
import pathlib
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointRecord
from paramserve.coordinator.status.cluster_status import (
    Cursor,
    CursorError,
    RunLog,
    ServerRates,
    ServerReading,
    StatusInputs,
    build_status,
    encode_status,
    parse_cursor,
    resume,
    status_key,
)
from paramserve.coordinator.status.page_server import PageLimits, PageServer
from paramserve.coordinator.status.status_history import History, Sample
from paramserve.coordinator.status.status_html import CONTENT_SECURITY_POLICY, render_page
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.client.probes import Prober
from paramserve.psserver.client.ps_client import ParameterServerClient
from paramserve.psserver.protocol.errors import ConfigurationError
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.psserver.runtime.security import is_loopback

__all__ = [
    "PageLimits",
    "SAMPLER_THREAD",
    "SERVER_THREAD",
    "StatusPage",
    "StatusSources",
    "check_status_exposure",
    "ServerProber",
    "ServerProbes",
    "status_key",
]

log = logging.getLogger(__name__)

SAMPLER_THREAD = "paramserve-status"
SERVER_THREAD = "paramserve-status-http"
REQUEST_THREADS = "paramserve-status-request"
PROBE_EVERY = 5
"""The servers are probed at every this many samples (their rows change slowly; a probe costs
the coordinator a ListShards call per server). Recoveries show at once: recovery reports them."""
PROBE_SECONDS = 0.5
"""Deadline of one probe of a parameter server (a lost one never holds up the sampler long)."""


def check_status_exposure(host: str, token: str | None) -> None:
    """Raises ConfigurationError when the page would serve beyond loopback with nothing to ask of
    its readers (the page shows addresses, errors and training figures)."""
    if token or is_loopback(host):
        return
    raise ConfigurationError(
        f"refusing to serve the status page on {host} without the cluster's token: anyone who can reach it "
        "would read the cluster's addresses, errors and training figures. Give the strategy the token "
        "(PARAMSERVE_TOKEN or token=: the page then asks for the key ClusterCoordinator.status_url carries), "
        "or serve it on 127.0.0.1 (status_host) and reach it over an SSH tunnel"
    )


@dataclass(frozen=True)
class StatusSources:
    """Where the page reads the run (each read is quick except ``probe_servers``, which the
    sampler thread calls with a deadline)."""

    run: RunLog
    queued: Callable[[], int]
    running: Callable[[], Mapping[str, int]]
    """Closures in flight by worker address."""
    in_flight: Callable[[], int]
    """Closures in flight (what ``running`` sums to, cheaper)."""
    checkpoint: Callable[[], CheckpointRecord | None]
    parameter_servers: tuple[str, ...]
    probe_servers: ServerProbes | None = None
    """Probes of the parameter servers (None: nothing to probe, e.g. a test double); the page
    closes it when it stops."""


class ServerProbes(Protocol):
    """One probe of every parameter server, and a way to let go of its connections."""

    def __call__(self) -> list[ServerReading]: ...

    def close(self) -> None: ...


class ServerProber:
    """Probes the servers of ``client`` for their shards (``ListShards``) within ``timeout`` each,
    over connections of its own (``psserver.probes.Prober``): a probe renewing its connection to
    a slow server never cancels one of the recovery monitor's."""

    def __init__(
        self, client: ParameterServerClient, timeout: float = PROBE_SECONDS, addresses: Sequence[str] | None = None
    ):
        """``addresses``: every server to show (default the client's; a replicated cluster's
        backups too, which its client does not call)."""
        config = client.config
        self._addresses = tuple(addresses) if addresses is not None else client.addresses
        self._timeout = timeout
        self._prober = Prober(
            self._addresses,
            lambda address: open_channel(address, config.client_tls(), channel_options(config.max_message_bytes)),
            config.token,
        )

    def __call__(self) -> list[ServerReading]:
        readings = []
        for index, address in enumerate(self._addresses):
            try:
                found = self._prober.probe(index, self._timeout, shards=True)
            except Exception as exc:  # a refusal (e.g. a token the server does not take): shown as lost
                log.debug("status page: probing %s failed: %s", address, exc)
                readings.append(ServerReading(address, None))
                continue
            versions = {str(info.ref): info.version for info in found.shards}
            size = sum(math.prod(info.shape) * info.dtype.itemsize for info in found.shards)
            readings.append(
                ServerReading(address, found.incarnation, found.reachable, versions, size, found.resident_bytes)
            )
        return readings

    def close(self) -> None:
        self._prober.close()


class StatusPage:
    """The page of one coordinator (see the module): ``start(host, port)``, then ``stop()``."""

    def __init__(
        self,
        sources: StatusSources,
        *,
        key: str | None = None,
        interval: float = 1.0,
        probe_every: int = PROBE_EVERY,
        history: int = 600,
        clock: Callable[[], float] = time.time,
        limits: PageLimits | None = None,
    ):
        """``limits``: what readers may hold of the page (connections, deadlines; default
        ``PageLimits()``, see ``page_server``)."""
        self._sources = sources
        self._limits = limits or PageLimits()
        self._key = key
        self._interval = interval
        self._probe_every = probe_every
        self._samples = 0
        self._clock = clock
        self._run_id = secrets.token_hex(4)  # in every cursor: a restarted coordinator's page is another run
        self._history = History(history)
        self._rates = ServerRates()
        self._lock = threading.Lock()  # the rates and the CPU accounting
        self._checkpoint: CheckpointRecord | None = None
        self._stopped = threading.Event()
        self._server: PageServer | None = None
        self._threads: list[threading.Thread] = []
        self._serving_cpu = 0.0
        self._sampling_cpu = 0.0
        self.host = ""
        self.port = 0

    # ---------------------------------------------------------------- lifecycle

    def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: a free port) and starts the threads; returns the port."""
        self._server = PageServer(
            (host, port),
            self._answer,
            self._limits,
            thread_name=SERVER_THREAD,
            request_threads=REQUEST_THREADS,
            on_cpu=self.count_serving,
        )
        self.host, self.port = host, self._server.port
        sampler = threading.Thread(target=self._sample_forever, name=SAMPLER_THREAD, daemon=True)
        self._threads = [sampler]
        sampler.start()
        self._server.start()
        log.info("status page at %s", self.url)
        return self.port

    @property
    def url(self) -> str:
        """The page's address, with its key when it needs one."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()
        query = f"?key={self._key}" if self._key else ""
        return f"http://{host}:{self.port}/{query}"

    def stop(self, timeout: float | None = None) -> bool:
        """Stops serving and sampling and joins every thread; True when none is left."""
        self._stopped.set()
        server, self._server = self._server, None
        served = server.stop(timeout) if server is not None else True
        for thread in self._threads:
            thread.join(timeout)
        if self._sources.probe_servers is not None:
            self._sources.probe_servers.close()
        return served and not any(thread.is_alive() for thread in self._threads)

    def dropped(self) -> dict[str, int]:
        """Connections the page dropped and the times it paused accepting, by reason
        (``page_server.PageServer.counts``)."""
        return self._server.counts() if self._server is not None else {}

    @property
    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds this page has cost the coordinator: answering requests, and sampling."""
        with self._lock:
            return self._serving_cpu, self._sampling_cpu

    # ---------------------------------------------------------------- reading the run

    def sample(self) -> None:
        """Takes one sample: the run's counters into the history, a new checkpoint, the servers' shards."""
        started = time.thread_time()
        sources, now = self._sources, self._clock()
        view = sources.run.view(workers=False, events=False)
        report = view.report
        self._history.add(
            Sample(
                time=now,
                scheduled=view.scheduled,
                done=view.done,
                failed=view.failed,
                steps=view.steps,
                queued=sources.queued(),
                running=sources.in_flight(),
                samples=report.samples if report is not None else None,
                loss=report.loss if report is not None else None,
                metrics=dict(report.metrics) if report is not None else {},
            )
        )
        self._note_checkpoint()
        self._samples += 1
        if sources.probe_servers is not None and (self._samples - 1) % self._probe_every == 0:
            readings = sources.probe_servers()
            with self._lock:
                self._rates.update(self._clock(), readings)
        with self._lock:
            self._sampling_cpu += time.thread_time() - started

    def status(self, since: Cursor | None = None) -> dict[str, Any]:
        """The status now (``cluster_status.build_status``); for a reader at ``since``, only the
        chart points and events it lacks when the answer can continue its cursor
        (``cluster_status.resume``), else the whole status."""
        return build_status(self._inputs(since))

    def status_json(self, since: Cursor | None = None) -> bytes:
        """``status(since)`` as the JSON ``/status.json`` serves (``cluster_status.encode_status``)."""
        return encode_status(self._inputs(since))

    def _inputs(self, since: Cursor | None) -> StatusInputs:
        sources = self._sources
        layout, points = self._history.position()
        view = sources.run.view(workers=False)
        since = resume(since, Cursor(self._run_id, layout, points, view.events_total))
        series, layout, points = self._history.part(since.layout, since.points) if since else self._history.part()
        with self._lock:
            servers = self._rates.rows(sources.parameter_servers, view.servers)
        running = sources.running()
        return StatusInputs(
            now=self._clock(),
            run=view,
            series=series,
            servers=servers,
            queued=sources.queued(),
            running=running,
            workers=sources.run.worker_table(running),
            cursor=Cursor(self._run_id, layout, points, view.events_total),
            since=since,
        )

    def _sample_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                self.sample()
            except Exception:
                log.exception("the status page could not sample the run")
            self._stopped.wait(self._interval)

    def _note_checkpoint(self) -> None:
        record = self._sources.checkpoint()
        if record is None or record == self._checkpoint:
            return
        self._checkpoint = record
        path = pathlib.Path(record.path)
        local = path.is_dir()
        self._sources.run.checkpoint(
            record.step,
            record.path,
            record.written_at,
            _directory_bytes(path) if local else None,
            checkpoint.is_whole(path) if local else None,
        )

    # ---------------------------------------------------------------- serving (request threads)

    def authorized(self, query_key: str | None, authorization: str | None) -> bool:
        if self._key is None:
            return True
        given = query_key or (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self._key.encode())

    def count_serving(self, seconds: float) -> None:
        with self._lock:
            self._serving_cpu += seconds

    def query(self) -> str:
        """What the page's script appends to ``status.json`` (the key, when there is one)."""
        return f"?key={self._key}" if self._key else ""

    def _answer(self, request: bytes, peer: Any) -> bytes:
        """One whole request's reply (on a request thread of the ``PageServer``)."""
        return _Exchange(request, peer, self).reply


def _since(values: list[str]) -> Cursor:
    """The one ``since`` of a request's query (CursorError for none or several)."""
    if len(values) != 1:
        raise CursorError(f"since= is given {len(values)} times: give it once, the cursor of the last answer")
    return parse_cursor(values[0])


def _directory_bytes(path: pathlib.Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (pathlib.Path(root) / name).stat().st_size
            except OSError:  # pruned meanwhile
                continue
    return total


_NO_SERVER: Any = None
"""What ``_Exchange`` gives as its server: ``BaseHTTPRequestHandler`` never reads it."""
_NO_SOCKET: Any = None
"""What ``_Exchange`` gives as its connection: it reads the request's bytes instead."""


class _Exchange(http.server.BaseHTTPRequestHandler):
    """One request answered from its bytes: the standard library parses it and writes the reply
    into ``reply`` (the ``PageServer`` moves the bytes, so no socket is touched here)."""

    server_version = "paramserve-status"
    sys_version = ""

    def __init__(self, request: bytes, peer: Any, page: StatusPage):
        self.page = page
        self._written = io.BytesIO()
        self._request = request
        self.reply = b""
        super().__init__(_NO_SOCKET, peer, _NO_SERVER)

    def setup(self) -> None:
        self.rfile = io.BytesIO(self._request)
        self.wfile = self._written

    def handle(self) -> None:
        self.handle_one_request()  # one request per connection: the page speaks HTTP/1.0

    def finish(self) -> None:
        self.reply = self._written.getvalue()

    def do_GET(self) -> None:
        page = self.page
        url = urllib.parse.urlsplit(self.path)
        if url.path not in ("/", "/index.html", "/status.json"):
            self._send(404, "text/plain; charset=utf-8", b"not found: the page is / and its data /status.json\n")
            return
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        if not page.authorized(query.get("key", [None])[0], self.headers.get("Authorization")):
            self._send(
                401,
                "text/plain; charset=utf-8",
                b"this page needs its key: open the address ClusterCoordinator.status_url (or paramserve demo) "
                b"gives, with ?key=, or pass the cluster's token to paramserve status\n",
            )
            return
        since = None
        if url.path == "/status.json" and "since" in query:
            try:
                since = _since(query["since"])
            except CursorError as err:
                self._send(400, "text/plain; charset=utf-8", f"{err}\n".encode())
                return
        if url.path == "/status.json":
            self._send(200, "application/json", page.status_json(since))
        else:
            html = render_page(page.status(), query=page.query())
            self._send(
                200, "text/html; charset=utf-8", html.encode(), {"Content-Security-Policy": CONTENT_SECURITY_POLICY}
            )

    def _refuse_method(self) -> None:
        self._send(405, "text/plain; charset=utf-8", b"only GET\n", {"Allow": "GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse_method

    def _send(self, code: int, content_type: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Frame-Options", "DENY")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("status page: %s %s", self.address_string(), format % args)
