"""The cluster's status as a person reads it: the core of the status page and ``paramserve status``.

Plain Python, no HTTP and no threads of its own (``coordinator.status_page`` serves it):

- ``RunLog`` keeps what the coordinator's telemetry hears: each worker's state and its closures
  done, failed and retried; the parameter servers' recoveries; what the program reports
  (``ClusterCoordinator.report``: step, loss, samples, metrics); and one bounded timeline of
  events (workers joining, lost and back, recoveries, checkpoints, errors). Thread-safe; the
  clock is injected. ``RunLog.worker_table`` gives the workers' rows already as JSON text
  (``WorkerTable``), kept until a worker changes.
- ``ServerRates`` turns the parameter servers' probes into rows, with pushes per second from the
  change of their shards' versions.
- ``build_status`` is the pure function from those and the charts' series
  (``coordinator.status_history``) to the JSON-ready dict that the page renders
  and ``paramserve status`` prints; ``encode_status`` is the same status as the JSON text that
  ``/status.json`` serves, the workers' rows put in as they were encoded.
- ``Cursor`` is where a reader of ``/status.json`` stands (``?since=``: the ``cursor`` of the last
  answer it read); ``parse_cursor`` reads one and ``resume`` decides whether an answer can
  continue it or must be the whole status.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import hmac
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paramserve.coordinator.status.status_history import rounded
from paramserve.worker.row_cache import age_label

if TYPE_CHECKING:
    from paramserve.coordinator.dispatch.closures import Closure

__all__ = [
    "ALIVE",
    "Cursor",
    "CursorError",
    "Event",
    "JOINING",
    "LOST",
    "RunLog",
    "STOPPED",
    "ServerReading",
    "ServerRates",
    "StatusInputs",
    "WorkerTable",
    "build_status",
    "bytes_text",
    "check_report",
    "encode_status",
    "events_after",
    "parse_cursor",
    "resume",
    "status_key",
]

ALIVE, JOINING, LOST, STOPPED = "alive", "joining", "lost", "stopped"
"""A worker as the page shows it: takes closures; not served yet since it joined; its last call
failed and it is probed; given up (its probes ran out, or the coordinator stopped)."""
WORKER_ORDER = {LOST: 0, JOINING: 1, STOPPED: 2, ALIVE: 3}
"""Workers that need a look first."""
MAX_METRICS = 32
MAX_NAME_CHARS = 64
EVENTS_SHOWN = 100
"""Events in one status (the newest); the log keeps more."""
SCHEMA = 1
_KEY_CONTEXT = b"paramserve/v1/status"


def status_key(token: str) -> str:
    """The status page's key for a cluster with ``token``: HMAC-SHA256(token, "paramserve/v1/status").
    It reads the page and nothing else, and the token cannot be recovered from it (the page's
    address may carry it: ``ClusterCoordinator.status_url``)."""
    return hmac.new(token.encode(), _KEY_CONTEXT, hashlib.sha256).hexdigest()


def worker_status(previous: str | None, reported: str) -> str:
    """What the page shows for a worker whose dispatcher reported ``reported`` ("up", "down",
    "stopped"; coordinator.dispatcher.WorkerState) after it showed ``previous`` (None: new)."""
    if reported == "up":
        return ALIVE
    if reported == "down":
        return JOINING if previous in (None, JOINING) else LOST
    return STOPPED


@dataclass(frozen=True)
class Event:
    """One entry of the timeline: ``kind`` is one of EVENT_KINDS; ``subject`` what it is about."""

    time: float
    kind: str
    subject: str
    message: str


EVENT_KINDS = (
    "worker-joined",
    "worker-serving",
    "worker-lost",
    "worker-recovered",
    "worker-stopped",
    "worker-left",
    "ps-recovering",
    "ps-recovered",
    "ps-recovery-failed",
    "checkpoint",
    "error",
)


@dataclass
class WorkerFacts:
    """One worker as the page shows it."""

    address: str
    order: int
    state: str
    since: float
    done: int = 0
    failed: int = 0
    retried: int = 0
    last_seen: float | None = None
    device: str | None = None

    def copy(self) -> WorkerFacts:
        """A copy (the constructor: a quarter of ``copy.copy``'s cost, which 256 workers feel)."""
        return WorkerFacts(
            self.address,
            self.order,
            self.state,
            self.since,
            self.done,
            self.failed,
            self.retried,
            self.last_seen,
            self.device,
        )


@dataclass
class ServerLog:
    """What recovery told of one parameter server."""

    recovering: bool = False
    recoveries: int = 0
    last_result: str | None = None
    last_time: float | None = None


@dataclass(frozen=True)
class Report:
    """The program's latest ``ClusterCoordinator.report``."""

    time: float
    step: int | None
    loss: float | None
    samples: float | None
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class RunView:
    """A consistent copy of a RunLog."""

    started: float
    scheduled: int
    done: int
    failed: int
    cancelled: int
    retried: int
    steps: int
    workers: tuple[WorkerFacts, ...]
    servers: Mapping[str, ServerLog]
    report: Report | None
    events: tuple[Event, ...]
    events_total: int
    rows: Mapping[str, int] = field(default_factory=dict)
    """Distinct rows the workers' lookups 'pulled' and took from their row caches ('cached')."""
    row_ages: Mapping[str, int] = field(default_factory=dict)
    """The cached ones by age label (worker.row_cache.age_label)."""


def check_report(
    step: Any, loss: Any, samples: Any, metrics: Mapping[str, Any]
) -> tuple[int | None, float | None, float | None, dict[str, float]]:
    """``ClusterCoordinator.report``'s arguments as numbers; raises ValueError naming a bad one
    (a number is anything ``float()`` takes: ints, floats, one-element tensors)."""
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"report() takes at most {MAX_METRICS} metrics at a time, got {len(metrics)}")
    values = {name: _number(name, value) for name, value in metrics.items()}
    for name in values:
        if not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"a metric name has 1 to {MAX_NAME_CHARS} characters, got {name!r}")
    checked_step = None if step is None else int(_number("step", step))
    checked_loss = None if loss is None else _number("loss", loss)
    checked_samples = None if samples is None else _number("samples", samples)
    return checked_step, checked_loss, checked_samples, values


def _number(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"report(): {name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"report(): {name} must be a number, got {type(value).__name__}") from exc


class RunLog:
    """What the coordinator's telemetry heard, per worker and as a timeline (see the module).

    The observer methods run on the dispatch and recovery threads and are quick (one lock, no
    I/O). ``view()`` copies everything under that lock.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_events: int = 1000):
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._counts = collections.Counter[str]()
        self._rows = collections.Counter[str]()
        self._row_ages = collections.Counter[str]()
        self._workers: dict[str, WorkerFacts] = {}
        self._joined = 0
        self._servers: dict[str, ServerLog] = {}
        self._report: Report | None = None
        self._events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self._events_total = 0
        self._version = 0
        """Bumped whenever a worker's row changes: the last ``worker_table`` holds until then."""
        self._table: tuple[int, Mapping[str, int], WorkerTable] | None = None

    # ---------------------------------------------------------------- closures

    def closure_scheduled(self, closure: Closure) -> None:
        with self._lock:
            self._counts["scheduled"] += 1

    def closure_finished(self, closure: Closure) -> None:
        outcome, now = closure.state.value, self._clock()
        error = _error_line(closure) if outcome == "failed" else ""
        with self._lock:
            worker = self._workers.get(closure.worker or "")
            if outcome == "succeeded":
                self._counts["done"] += 1
                self._counts["steps"] += closure.steps
                if worker is not None:
                    worker.done += 1
                    worker.last_seen = now
                    self._version += 1
            elif outcome == "failed":
                self._counts["failed"] += 1
                if worker is not None:
                    worker.failed += 1
                    worker.last_seen = now
                    self._version += 1
                self._add(now, "error", closure.function_name, error)
            else:
                self._counts["cancelled"] += 1

    def closure_retried(self, closure: Closure, code: str) -> None:
        with self._lock:
            self._counts["retried"] += 1
            worker = self._workers.get(closure.worker or "")
            if worker is not None:
                worker.retried += 1
                self._version += 1

    def rows_read(self, pulled: int, cached: int, cached_by_age: Mapping[int, int]) -> None:
        with self._lock:
            self._rows["pulled"] += pulled
            self._rows["cached"] += cached
            for age, count in cached_by_age.items():
                self._row_ages[age_label(age)] += count

    # ---------------------------------------------------------------- workers

    def worker_device(self, address: str, device: str) -> None:
        with self._lock:
            worker = self._workers.get(address)
            if worker is not None and worker.device != (device or None):
                worker.device = device or None
                self._version += 1

    def worker_state(self, address: str, state: str | None) -> None:
        now = self._clock()
        with self._lock:
            worker = self._workers.get(address)
            self._version += 1
            if state is None:
                if worker is not None:
                    del self._workers[address]
                    self._add(now, "worker-left", address, "removed from the cluster")
                return
            shown = worker_status(worker.state if worker is not None else None, state)
            if worker is None:
                self._joined += 1
                self._workers[address] = WorkerFacts(address, self._joined, shown, now)
                self._add(
                    now, "worker-joined", address, "joined" if shown == ALIVE else "joined; probed until it serves"
                )
                return
            previous, worker.state = worker.state, shown
            if shown == previous:
                return
            worker.since = now
            if shown == ALIVE:
                worker.last_seen = now
                kind = "worker-serving" if previous == JOINING else "worker-recovered"
                self._add(now, kind, address, "serves" if previous == JOINING else "serves again after it was lost")
            elif shown == LOST:
                self._add(now, "worker-lost", address, "its call failed: closures went to other workers; probed")
            elif shown == STOPPED:
                self._add(now, "worker-stopped", address, "given up (it did not come back, or the coordinator stopped)")

    # ---------------------------------------------------------------- parameter servers and checkpoints

    def parameter_server_recovering(self, server: str) -> None:
        now = self._clock()
        with self._lock:
            self._servers.setdefault(server, ServerLog()).recovering = True
            self._add(now, "ps-recovering", server, "lost or restarted: training paused while it is recovered")

    def replica_rejoined(self, group: int, member: str, copied_bytes: int, seconds: float) -> None:
        now = self._clock()
        with self._lock:
            self._add(
                now,
                "ps-rejoined",
                member,
                f"rejoined shard group {group} as a backup: {copied_bytes} bytes copied in {seconds:.2f}s",
            )

    def parameter_server_recovered(self, server: str, result: str, seconds: float) -> None:
        now = self._clock()
        with self._lock:
            log = self._servers.setdefault(server, ServerLog())
            log.recovering, log.recoveries, log.last_result, log.last_time = False, log.recoveries + 1, result, now
            if result == "failed":
                self._add(now, "ps-recovery-failed", server, "not recovered: the queued closures failed")
            else:
                self._add(now, "ps-recovered", server, f"{result} in {seconds:.2f}s: training resumed")

    def dense_group_formed(self, generation: int, members: Sequence[str]) -> None:
        with self._lock:
            self._add(self._clock(), "dense-group", f"group {generation}", f"formed with {len(members)} workers")

    def dense_group_broke(self) -> None:
        with self._lock:
            self._add(
                self._clock(), "dense-group-broke", "dense group", "a worker left mid-round: its closures run again"
            )

    def checkpoint(self, step: int, path: str, written_at: float, size: int | None, whole: bool | None) -> None:
        """A checkpoint was written or restored (``size`` in bytes and ``whole``: None when its
        directory is not on this machine)."""
        parts = [f"step {step}", path]
        if size is not None:
            parts.append(bytes_text(size))
        if whole is not None:
            parts.append("whole" if whole else "NOT whole")
        with self._lock:
            self._add(written_at, "checkpoint", f"step {step}", ", ".join(parts))

    # ---------------------------------------------------------------- the program

    def report(self, step: int | None, loss: float | None, samples: float | None, metrics: Mapping[str, float]) -> None:
        """The program's own figures (checked by ``check_report``); what it leaves out keeps its
        last value."""
        now = self._clock()
        with self._lock:
            last = self._report
            if last is not None:
                step = last.step if step is None else step
                loss = last.loss if loss is None else loss
                samples = last.samples if samples is None else samples
                metrics = {**last.metrics, **metrics}
                if len(metrics) > MAX_METRICS:
                    raise ValueError(f"report() keeps at most {MAX_METRICS} metrics in a run")
            self._report = Report(now, step, loss, samples, dict(metrics))

    # ---------------------------------------------------------------- reading

    def view(self, *, workers: bool = True, events: bool = True) -> RunView:
        """A copy of everything, or of all but the workers and the events (``worker_table`` gives
        the workers' rows without copying each worker)."""
        with self._lock:
            c = self._counts
            return RunView(
                started=self._started,
                scheduled=c["scheduled"],
                done=c["done"],
                failed=c["failed"],
                cancelled=c["cancelled"],
                retried=c["retried"],
                steps=c["steps"],
                workers=tuple(w.copy() for w in self._workers.values()) if workers else (),
                servers={a: copy.copy(s) for a, s in self._servers.items()},
                report=self._report,
                events=tuple(self._events) if events else (),
                events_total=self._events_total,
                rows=dict(self._rows),
                row_ages=dict(self._row_ages),
            )

    def worker_table(self, running: Mapping[str, int]) -> WorkerTable:
        """The workers' rows (the module's ``worker_table``) with ``running``, the closures in
        flight by worker address: the same table again while no worker changed and ``running``
        is the same."""
        with self._lock:
            if self._table is not None and self._table[0] == self._version and self._table[1] == running:
                return self._table[2]
            table = worker_table(self._workers.values(), running)
            self._table = (self._version, dict(running), table)
            return table

    def _add(self, when: float, kind: str, subject: str, message: str) -> None:
        self._events.append(Event(when, kind, subject, message))
        self._events_total += 1


def _error_line(closure: Closure) -> str:
    """The first line of a failed closure's error (its RemoteValue raises it)."""
    try:
        closure.remote_value.fetch(timeout=0)
    except Exception as exc:  # the error it holds, whatever its type
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    return "failed"


# -------------------------------------------------------------------- parameter servers


@dataclass(frozen=True)
class ServerReading:
    """One probe of a parameter server: what it holds (``versions``: each shard's version), or
    None when it did not answer (``reachable``: its port still accepts connections: busy)."""

    address: str
    incarnation: str | None
    reachable: bool = False
    versions: Mapping[str, int] = field(default_factory=dict)
    bytes: int = 0
    memory: int = 0
    """The server process's resident bytes (0: unknown)."""


class ServerRates:
    """The servers' rows from successive readings: pushes per second is the fastest-moving shard's
    version change per second (every push bumps the version of each shard it updates)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, ServerReading]] = {}
        self._rates: dict[str, float | None] = {}
        self._latest: dict[str, ServerReading] = {}

    def update(self, now: float, readings: Iterable[ServerReading]) -> None:
        """Takes one round of probes taken at ``now``."""
        for reading in readings:
            self._latest[reading.address] = reading
            previous = self._last.get(reading.address)
            if reading.incarnation is None:
                self._rates[reading.address] = None
                continue  # keep the last answer: the rate resumes from it
            rate = None
            if previous is not None and previous[1].incarnation == reading.incarnation and now > previous[0]:
                before = previous[1].versions
                changes = [v - before[ref] for ref, v in reading.versions.items() if ref in before]
                rate = max(0, *changes) / (now - previous[0]) if changes else None  # no shard to compare yet
            self._rates[reading.address] = rate
            self._last[reading.address] = (now, reading)

    def rows(self, addresses: Sequence[str], logs: Mapping[str, ServerLog]) -> list[dict[str, Any]]:
        """One row per server of ``addresses``, with what recovery told of it (``logs``)."""
        return [
            _server_row(a, self._latest.get(a), self._last.get(a), self._rates.get(a), logs.get(a)) for a in addresses
        ]


def _server_row(
    address: str,
    reading: ServerReading | None,
    answered: tuple[float, ServerReading] | None,
    rate: float | None,
    log: ServerLog | None,
) -> dict[str, Any]:
    held = answered[1] if answered is not None else None
    if log is not None and log.recovering:
        state = "recovering"
    elif reading is None:
        state = "unknown"
    elif reading.incarnation is not None:
        state = "serving"
    else:
        state = "busy" if reading.reachable else "unreachable"
    return {
        "address": address,
        "state": state,
        "shards": len(held.versions) if held is not None else None,
        "bytes": held.bytes if held is not None else None,
        "memory": held.memory or None if held is not None else None,
        "version": max(held.versions.values(), default=0) if held is not None else None,
        "pushes_per_s": rounded(rate),
        "incarnation": held.incarnation[:8] if held is not None and held.incarnation else None,
        "recoveries": log.recoveries if log is not None else 0,
        "last_recovery": log.last_result if log is not None else None,
        "last_recovery_time": log.last_time if log is not None else None,
    }


# -------------------------------------------------------------------- the status


class CursorError(ValueError):
    """A ``since`` that is not a cursor this page gave (the message names it and the fix)."""


_CURSOR = re.compile(r"([0-9a-f]{1,16})\.([0-9]{1,15})\.([0-9]{1,15})\.([0-9]{1,15})")


@dataclass(frozen=True)
class Cursor:
    """Where a reader of ``/status.json`` stands: the status it holds ends at the ``run``'s
    history ``layout`` with ``points`` final chart points, and ``events`` events of the run.
    Its text (``str``) is the answer's ``cursor``, which the reader sends back as ``?since=``."""

    run: str
    """The page that answered (a restarted coordinator's page has another)."""
    layout: int
    points: int
    events: int

    def __str__(self) -> str:
        return f"{self.run}.{self.layout}.{self.points}.{self.events}"


def parse_cursor(text: str) -> Cursor:
    """The cursor ``text`` (what ``str(Cursor)`` gives); raises CursorError naming ``since`` and
    the fix for anything else."""
    found = _CURSOR.fullmatch(text)
    if found is None:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise CursorError(
            f'since= takes the cursor of the last /status.json answer (its "cursor", e.g. '
            f"since=3f9a1c2e.0.57.12), got {shown!r}: send back the cursor as it came, or leave since= "
            "out for the whole status"
        )
    run, layout, points, events = found.groups()
    return Cursor(run, int(layout), int(points), int(events))


def resume(since: Cursor | None, now: Cursor) -> Cursor | None:
    """The cursor an answer continues, for a reader at ``since`` when the page stands at ``now``:
    ``since``, or None (the whole status) when there is none, it is of another run (the
    coordinator restarted) or it is ahead of the page (more events or chart points than it has)."""
    if since is None or since.run != now.run or since.events > now.events or since.layout > now.layout:
        return None
    if since.layout == now.layout and since.points > now.points:
        return None
    return since


def events_after(events: Sequence[Event], total: int, after: int | None) -> Sequence[Event]:
    """Of a run's newest ``events`` (its ``total`` so far), the newest EVENTS_SHOWN; with ``after``,
    only those after the run's first ``after``."""
    shown = events[-EVENTS_SHOWN:]
    if after is None:
        return shown
    new = min(len(shown), max(0, total - after))
    return shown[len(shown) - new :]


@dataclass(frozen=True)
class WorkerTable:
    """The workers as the status shows them: their rows as one JSON array, problems first
    (``text``), and how many are in each state, and in all (``counts``)."""

    text: str
    counts: Mapping[str, int]

    def rows(self) -> list[dict[str, Any]]:
        """The rows as dicts."""
        rows: list[dict[str, Any]] = json.loads(self.text)
        return rows


def worker_table(workers: Iterable[WorkerFacts], running: Mapping[str, int]) -> WorkerTable:
    """The rows of ``workers``, with ``running`` (closures in flight by worker address).

    Each row is formatted as JSON text at once: the page asks for them every second, and a dict
    per row would be hundreds of objects for the garbage collector to count (and to run for, on
    the page's thread, in a coordinator that allocates many of its own)."""
    ordered = sorted(workers, key=_problems_first)
    counts = dict.fromkeys((ALIVE, JOINING, LOST, STOPPED), 0)
    for worker in ordered:
        counts[worker.state] = counts.get(worker.state, 0) + 1
    counts["total"] = len(ordered)
    text = "[" + ",".join([_worker_json(w, running.get(w.address, 0)) for w in ordered]) + "]"
    return WorkerTable(text, counts)


def _problems_first(worker: WorkerFacts) -> int:
    return WORKER_ORDER.get(worker.state, 9) << 40 | worker.order  # one int: no tuple per worker


def _worker_json(worker: WorkerFacts, running: int) -> str:
    """One worker's row: address, state, since, running, done, failed, retried, last_seen (times
    to the hundredth of a second) and device."""
    w = worker
    return (
        f'{{"address":{_string_json(w.address)},"state":{_string_json(w.state)},"since":{_seconds_json(w.since)},'
        f'"running":{int(running)},"done":{w.done},"failed":{w.failed},"retried":{w.retried},'
        f'"last_seen":{_seconds_json(w.last_seen)},"device":{_string_json(w.device)}}}'
    )


@functools.lru_cache(maxsize=4096)
def _string_json(text: str | None) -> str:
    """A string (addresses, states, devices: a few, met every second) or None as JSON."""
    return json.dumps(text)


def _seconds_json(seconds: float | None) -> str:
    """A time to the hundredth of a second (what ``round(seconds, 2)`` gives) as JSON."""
    return f"{seconds:.2f}" if seconds is not None and math.isfinite(seconds) else "null"


@dataclass(frozen=True)
class StatusInputs:
    """Everything ``build_status`` reads, taken at one time ``now`` (Unix seconds)."""

    now: float
    run: RunView
    series: Mapping[str, Any]
    """The charts' data (``series``: ``History.series()``; ``History.part``: the points after the
    reader's, with ``keep``)."""
    servers: Sequence[Mapping[str, Any]]
    queued: int
    running: Mapping[str, int]
    """Closures in flight by worker address."""
    workers: WorkerTable
    """The workers' rows (``RunLog.worker_table(running)``)."""
    cursor: Cursor | None = None
    """Where this status ends (the reader's next ``since``)."""
    since: Cursor | None = None
    """The cursor this status continues (``resume``): its events are those after the reader's and
    its series the points after the reader's first ``series["keep"]``; None: the whole status."""


def build_status(inputs: StatusInputs) -> dict[str, Any]:
    """The status as a JSON-ready dict (schema ``SCHEMA``): summary, workers (problems first),
    parameter servers, the charts' series and the newest events (with ``since``: the events after
    the reader's), and the ``cursor`` it ends at."""
    return {**_status(inputs), "workers": inputs.workers.rows()}


def encode_status(inputs: StatusInputs) -> bytes:
    """``build_status(inputs)`` as strict JSON (no NaN), with the workers' rows as they were
    encoded (``WorkerTable.text``)."""
    head = json.dumps(_status(inputs), separators=(",", ":"), allow_nan=False)
    return f'{head[:-1]},"workers":{inputs.workers.text}}}'.encode()


def _status(inputs: StatusInputs) -> dict[str, Any]:
    """The status but its workers' rows."""
    run, now = inputs.run, inputs.now
    running = sum(inputs.running.values())
    report = run.report
    since = inputs.since.events if inputs.since is not None else None
    return {
        "schema": SCHEMA,
        "time": now,
        "started": run.started,
        "state": _headline(inputs, running),
        "summary": {
            "workers": dict(inputs.workers.counts),
            "closures": {
                "scheduled": run.scheduled,
                "queued": inputs.queued,
                "running": running,
                "done": run.done,
                "failed": run.failed,
                "cancelled": run.cancelled,
                "retried": run.retried,
            },
            "steps": run.steps,
            "step": report.step if report is not None else None,
            "loss": rounded(report.loss) if report is not None else None,
            "samples": rounded(report.samples) if report is not None else None,
            "metrics": {k: rounded(v) for k, v in sorted(report.metrics.items())} if report is not None else {},
            "reported": report.time if report is not None else None,
            "rows": _rows(run),
        },
        "servers": list(inputs.servers),
        "series": inputs.series,
        "events": [_event_row(e) for e in events_after(run.events, run.events_total, since)],
        "events_total": run.events_total,
        "cursor": str(inputs.cursor) if inputs.cursor is not None else None,
        "since": str(inputs.since) if inputs.since is not None else None,
    }


def _rows(run: RunView) -> dict[str, Any]:
    """The workers' lookups: rows pulled and cached, the hit rate (None before any lookup) and the
    cached rows' ages, youngest first."""
    pulled, cached = run.rows.get("pulled", 0), run.rows.get("cached", 0)
    ages = sorted(run.row_ages.items(), key=lambda item: int(item[0].rstrip("+")) + item[0].endswith("+"))
    return {
        "pulled": pulled,
        "cached": cached,
        "hit_rate": rounded(cached / (pulled + cached)) if pulled + cached else None,
        "ages": dict(ages),
    }


def _headline(inputs: StatusInputs, running: int) -> str:
    if any(s.get("state") == "recovering" for s in inputs.servers):
        return "recovering"
    if running or inputs.queued:
        return "training"
    return "idle"


def _event_row(event: Event) -> dict[str, Any]:
    return {"time": event.time, "kind": event.kind, "subject": event.subject, "message": event.message}


def bytes_text(size: float) -> str:
    """A size as the page and the terminal print it (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop returns
