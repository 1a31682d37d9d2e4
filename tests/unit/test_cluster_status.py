"""The status page's core (coordinator.cluster_status, status_history), its HTML (status_html) and
the terminal's text (commands/status): pure logic, time passed in."""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import math
import re

import pytest
import torch
from prometheus_client import generate_latest

from paramserve.coordinator.commands.status import format_status, status_request
from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue
from paramserve.coordinator.errors import ClosureError
from paramserve.coordinator.status.cluster_status import (
    ALIVE,
    EVENTS_SHOWN,
    JOINING,
    LOST,
    STOPPED,
    Cursor,
    CursorError,
    Event,
    RunLog,
    ServerRates,
    ServerReading,
    StatusInputs,
    build_status,
    check_report,
    encode_status,
    events_after,
    parse_cursor,
    resume,
    status_key,
    worker_status,
)
from paramserve.coordinator.status.status_history import History, Sample, series
from paramserve.coordinator.status.status_html import CONTENT_SECURITY_POLICY, SCRIPT, STYLE, render_page
from paramserve.coordinator.status.telemetry import CoordinatorTelemetry
from paramserve.psserver.runtime.security import bearer_metadata


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def status_of(log: RunLog, now: float, samples: list[Sample] | None = None, **overrides: object) -> dict:
    inputs = {"now": now, "run": log.view(), "servers": [], "queued": 0, "running": {}, **overrides}
    workers = log.worker_table(inputs["running"])  # type: ignore[arg-type]
    return build_status(StatusInputs(series=series(samples or []), workers=workers, **inputs))  # type: ignore[arg-type]


# ---------------------------------------------------------------- workers


@pytest.mark.parametrize(
    ("previous", "reported", "shown"),
    [
        (None, "up", ALIVE),
        (None, "down", JOINING),  # probed before it serves (a worker found by name)
        (JOINING, "down", JOINING),
        (JOINING, "up", ALIVE),
        (ALIVE, "down", LOST),
        (LOST, "up", ALIVE),
        (LOST, "stopped", STOPPED),
        (ALIVE, "stopped", STOPPED),
    ],
)
def test_what_a_worker_shows_follows_its_dispatcher(previous, reported, shown):
    assert worker_status(previous, reported) == shown


def test_a_worker_lost_and_back_is_on_the_timeline_with_its_closures_counted():
    clock = Clock()
    log = RunLog(clock)
    queue = ClosureQueue(10, observer=log)
    log.worker_state("w:1", "up")
    log.worker_state("w:2", "up")
    closures = [Closure("step", b"", steps=3) for _ in range(3)]
    for closure in closures:
        queue.put(closure, timeout=1)
    clock.now = 1001.0
    first, second = queue.take("w:1", 2)
    queue.succeed(first, 1)
    log.closure_retried(second, "UNAVAILABLE")
    log.worker_state("w:1", "down")
    queue.put_back([second])
    [again] = queue.take("w:2", 1)
    queue.succeed(again, 2)
    clock.now = 1005.0
    log.worker_state("w:1", "up")

    view = log.view()
    workers = {w.address: w for w in view.workers}
    assert (workers["w:1"].done, workers["w:1"].retried, workers["w:1"].state) == (1, 1, ALIVE)
    assert (workers["w:2"].done, workers["w:2"].last_seen) == (1, 1001.0)
    assert (view.scheduled, view.done, view.retried, view.steps) == (3, 2, 1, 6)
    kinds = [(e.kind, e.subject) for e in view.events]
    assert kinds == [
        ("worker-joined", "w:1"),
        ("worker-joined", "w:2"),
        ("worker-lost", "w:1"),
        ("worker-recovered", "w:1"),
    ]
    assert view.events[-1].time == 1005.0


def test_a_failed_closure_is_an_error_event_with_its_first_line_and_counts_on_its_worker():
    log = RunLog(Clock())
    queue = ClosureQueue(10, observer=log)
    log.worker_state("w:1", "up")
    closure = Closure("train_step", b"")
    queue.put(closure, timeout=1)
    [taken] = queue.take("w:1", 1)
    error = ClosureError(remote_type="ValueError", message="bad batch\nsecond line", function_name="train_step")
    queue.fail(taken, error)
    view = log.view()
    assert view.failed == 1 and view.workers[0].failed == 1
    event = view.events[-1]
    assert (event.kind, event.subject) == ("error", "train_step")
    assert "bad batch" in event.message and "second line" not in event.message


def test_workers_leave_and_stop_with_an_event_each():
    log = RunLog(Clock())
    log.worker_state("w:1", "down")
    log.worker_state("w:1", "up")
    log.worker_state("w:2", "up")
    log.worker_state("w:2", "stopped")
    log.worker_state("w:1", None)
    view = log.view()
    assert [w.address for w in view.workers] == ["w:2"]
    assert [e.kind for e in view.events] == [
        "worker-joined",
        "worker-serving",
        "worker-joined",
        "worker-stopped",
        "worker-left",
    ]


def test_the_timeline_is_bounded_and_counts_what_it_dropped():
    log = RunLog(Clock(), max_events=5)
    for i in range(12):
        log.worker_state(f"w:{i}", "up")
    view = log.view()
    assert len(view.events) == 5 and view.events_total == 12
    assert view.events[-1].subject == "w:11"


# ---------------------------------------------------------------- recoveries, checkpoints, reports


def test_parameter_server_recoveries_and_checkpoints_reach_the_timeline_and_the_server_rows():
    clock = Clock()
    telemetry = CoordinatorTelemetry.build(clock=clock)
    telemetry.parameter_server_recovering("ps:1")
    assert telemetry.run.view().servers["ps:1"].recovering
    rates = ServerRates()
    rates.update(1000.0, [ServerReading("ps:1", None, reachable=False)])
    rows = rates.rows(["ps:1"], telemetry.run.view().servers)
    assert rows[0]["state"] == "recovering"
    assert status_of(telemetry.run, 1000.0, servers=rows)["state"] == "recovering"
    clock.now = 1003.0
    telemetry.parameter_server_recovered("ps:1", "restored", 1.25)
    telemetry.run.checkpoint(400, "/ckpt/ckpt-00000400", 1004.0, 3 << 20, True)
    view = telemetry.run.view()
    row = rates.rows(["ps:1"], view.servers)[0]
    assert (row["state"], row["recoveries"], row["last_recovery"], row["last_recovery_time"]) == (
        "unreachable",
        1,
        "restored",
        1003.0,
    )
    assert [e.kind for e in view.events] == ["ps-recovering", "ps-recovered", "checkpoint"]
    assert "1.25s" in view.events[1].message
    assert view.events[2].message == "step 400, /ckpt/ckpt-00000400, 3.0 MiB, whole"
    telemetry.parameter_server_recovered("ps:1", "failed", 0.0)
    assert telemetry.run.view().events[-1].kind == "ps-recovery-failed"


def test_reports_keep_what_they_leave_out_and_take_tensors():
    telemetry = CoordinatorTelemetry.build(clock=Clock())
    telemetry.report(10, loss=torch.tensor(0.5), samples=640, accuracy=0.75)
    telemetry.report(20, auc=torch.tensor([0.9]))
    report = telemetry.run.view().report
    assert report is not None
    assert (report.step, report.loss, report.samples) == (20, 0.5, 640.0)
    assert report.metrics == {"accuracy": 0.75, "auc": pytest.approx(0.9)}


@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        ({"loss": "low"}, "loss must be a number"),
        ({"loss": torch.ones(2)}, "loss must be a number"),
        ({"step": None, "accuracy": object()}, "accuracy must be a number"),
        ({"x" * 65: 1.0}, "1 to 64 characters"),
        ({f"m{i}": 1.0 for i in range(33)}, "at most 32 metrics"),
    ],
)
def test_a_report_that_is_not_numbers_is_refused_naming_the_value(arguments, names):
    arguments = dict(arguments)
    step, loss, samples = arguments.pop("step", None), arguments.pop("loss", None), arguments.pop("samples", None)
    with pytest.raises(ValueError, match=names):
        check_report(step, loss, samples, arguments)


# ---------------------------------------------------------------- history and series


def sample(t: float, done: int, **fields: object) -> Sample:
    values = {"scheduled": done, "done": done, "failed": 0, "steps": 2 * done, "queued": 1, "running": 2, **fields}
    return Sample(time=t, **values)  # type: ignore[arg-type]


def test_history_stays_bounded_and_spans_the_whole_run():
    history = History(capacity=8)
    for i in range(100):
        history.add(sample(float(i), 10 * i))
    samples = history.samples()
    assert len(samples) <= 9
    assert samples[0].time == 0.0 and samples[-1].time == 99.0
    spacing = {b.time - a.time for a, b in zip(samples[:-2], samples[1:-1])}
    assert len(spacing) == 1, "kept samples are evenly spaced"
    # Cumulative counters: every rate computed from the kept samples is still exact.
    assert set(build_series_rates(samples)) == {10.0}
    assert history.series() is history.series(), "computed once per sample"
    history.add(sample(100.0, 1000))
    assert history.series()["t"][-1] == 100.0


def build_series_rates(samples: list[Sample]) -> list[float | None]:
    return status_of(RunLog(Clock()), 0.0, samples=samples)["series"]["done_per_s"]


def test_series_are_rates_of_the_counters_and_the_sampled_values():
    samples = [
        sample(0.0, 0),
        sample(2.0, 10, samples=640.0, loss=2.0, metrics={"accuracy": 0.5}),
        sample(3.0, 40, samples=1280.0, loss=float("nan"), metrics={"accuracy": 0.75}),
    ]
    series = status_of(RunLog(Clock()), 3.0, samples=samples)["series"]
    assert series["t"] == [2.0, 3.0]
    assert series["done_per_s"] == [5.0, 30.0]
    assert series["steps_per_s"] == [10.0, 60.0]
    assert series["samples_per_s"] == [None, 640.0]  # unknown before the first report
    assert series["loss"] == [2.0, None]  # NaN is not JSON: null
    assert series["metrics"] == {"accuracy": [0.5, 0.75]}
    assert series["queued"] == [1, 1] and series["running"] == [2, 2]


def test_history_series_is_the_series_of_its_samples_through_thinnings():
    history = History(capacity=6)
    for i in range(40):
        history.add(sample(float(i), i * i, metrics={"m": float(i)} if i > 3 else {}))
        assert history.series() == series(history.samples()), f"after sample {i}"


def merged(held: dict | None, answer: dict) -> dict:
    """What the page's script does with an answer (status_html.SCRIPT's merge), in Python."""
    if answer["since"] is None:
        return answer
    assert held is not None and answer["since"] == held["cursor"]
    keep, fresh = answer["series"]["keep"], len(answer["series"]["t"])

    def padded(values: list | None, length: int) -> list:
        kept = list(values or [])[:length]
        return kept + [None] * (length - len(kept))

    merged_series: dict = {"keep": 0, "metrics": {}}
    for key, values in answer["series"].items():
        if key not in ("keep", "metrics"):
            merged_series[key] = padded(held["series"][key], keep) + values
    for name in sorted({*held["series"]["metrics"], *answer["series"]["metrics"]}):
        merged_series["metrics"][name] = padded(held["series"]["metrics"].get(name), keep) + padded(
            answer["series"]["metrics"].get(name), fresh
        )
    events = (held["events"] + answer["events"])[-EVENTS_SHOWN:]
    return {**answer, "series": merged_series, "events": events}


def test_a_reader_that_merges_the_points_after_its_cursor_holds_the_whole_series():
    history, log, held = History(capacity=8), RunLog(Clock()), None
    keeps = []
    for i in range(60):
        history.add(sample(float(i), 3 * i, metrics={"auc": i / 100} if i >= 5 else {}))
        if i % 7 == 0:
            log.worker_state(f"w:{i}", "up")
        if i % 3:  # the reader polls now and then, the sampler runs on
            continue
        layout, points = history.position()
        view = log.view()
        since = parse_cursor(held["cursor"]) if held is not None else None
        since = resume(since, Cursor("5eed1", layout, points, view.events_total))
        part, layout, points = history.part(since.layout, since.points) if since else history.part()
        cursor = Cursor("5eed1", layout, points, view.events_total)
        inputs = StatusInputs(float(i), view, part, [], 0, {}, log.worker_table({}), cursor=cursor, since=since)
        answer = json.loads(json.dumps(build_status(inputs)))
        keeps.append(answer["series"]["keep"])
        held = merged(held, answer)
        whole = {**series(history.samples()), "keep": 0}
        assert held["series"] == whole, f"after sample {i}"
        assert held["events"] == status_of(log, i)["events"]
    assert max(keeps) > 0 and 0 in keeps[1:], "answers continue the reader's series, and resend it once thinned"


def test_an_answer_for_a_reader_carries_only_the_newest_points():
    history = History(capacity=600)
    for i in range(500):
        history.add(sample(float(i), i))
    layout, points = history.position()
    assert (layout, points) == (0, 499)
    part, *_ = history.part(layout, points - 1)
    assert part["keep"] == 498 and part["t"] == [499.0]
    whole, *_ = history.part()
    assert whole["keep"] == 0 and len(whole["t"]) == 499
    assert history.part(layout, points + 1)[0]["keep"] == 0, "more points than there are: the whole series"
    assert history.part(layout + 1, 3)[0]["keep"] == 0, "another layout: the whole series"


def test_the_newest_sample_not_kept_is_a_tail_point_replaced_by_the_next():
    history = History(capacity=6)
    for i in range(7):  # thinned once: one sample in two kept from now on
        history.add(sample(float(i), i))
    layout, points = history.position()
    assert (layout, points) == (1, 3)
    history.add(sample(7.0, 7))  # not kept: the tail
    part, layout_now, points_now = history.part(layout, points)
    assert (part["keep"], part["t"], layout_now, points_now) == (3, [7.0], 1, 3)
    history.add(sample(8.0, 8))  # kept: its point, from 6 to 8, replaces the tail's
    part, *_ = history.part(layout, points)
    assert (part["keep"], part["t"], part["done_per_s"]) == (3, [8.0], [1.0])


def test_a_cursor_reads_back_from_its_text():
    cursor = Cursor("3f9a1c2e", 2, 57, 12)
    assert str(cursor) == "3f9a1c2e.2.57.12" and parse_cursor(str(cursor)) == cursor


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "3f9a.0.57",
        "3f9a.0.57.12.1",
        "zz.0.0.0",
        "3f9a.-1.0.0",
        "3f9a.0.1e3.0",
        "3f9a.0.0." + "9" * 16,
        "3F9A.0.0.0",
        " 3f9a.0.0.0",
        "3f9a.0.0.0\n",
        "<script>.0.0.0" + "x" * 100,
    ],
)
def test_a_since_that_is_no_cursor_is_refused_naming_the_parameter_and_the_fix(text):
    with pytest.raises(CursorError) as refused:
        parse_cursor(text)
    message = str(refused.value)
    assert message.startswith("since= takes the cursor of the last /status.json answer")
    assert "leave since= out" in message and len(message) < 300


NOW = Cursor("5eed1", 2, 40, 30)


@pytest.mark.parametrize(
    ("since", "resumed"),
    [
        (None, None),
        (Cursor("5eed1", 2, 40, 30), Cursor("5eed1", 2, 40, 30)),  # nothing new: an answer of nothing new
        (Cursor("5eed1", 2, 12, 7), Cursor("5eed1", 2, 12, 7)),
        (Cursor("5eed1", 1, 300, 7), Cursor("5eed1", 1, 300, 7)),  # thinned since: whole series, new events
        (Cursor("5eed0", 2, 12, 7), None),  # a restarted coordinator's page: another run
        (Cursor("5eed1", 2, 12, 31), None),  # more events than the run had: the whole status
        (Cursor("5eed1", 2, 41, 7), None),  # more points than the layout has
        (Cursor("5eed1", 3, 0, 7), None),  # a layout it has not reached
    ],
)
def test_an_answer_continues_the_reader_s_cursor_unless_it_is_of_another_run_or_ahead(since, resumed):
    assert resume(since, NOW) == resumed


def test_events_after_a_cursor_are_the_new_ones_and_at_most_the_newest_shown():
    events = [Event(float(i), "error", f"e{i}", "") for i in range(150)]
    total = 400  # the log dropped older ones
    assert events_after(events, total, None) == events[-EVENTS_SHOWN:]
    assert events_after(events, total, total) == []
    assert events_after(events, total, total - 3) == events[-3:]
    assert events_after(events, total, 10) == events[-EVENTS_SHOWN:]
    assert events_after([], 0, 0) == []


# ---------------------------------------------------------------- parameter servers


def test_pushes_per_second_follow_the_fastest_shard_and_restart_with_a_new_incarnation():
    rates = ServerRates()
    rates.update(9.0, [ServerReading("ps:1", "inc-a", True, {}, 0)])  # before the variables exist
    rates.update(10.0, [ServerReading("ps:1", "inc-a", True, {"w/0": 5, "b/0": 5}, 4096)])
    assert rates.rows(["ps:1"], {})[0]["pushes_per_s"] is None, "no shard to compare: unknown, not 0"
    rates.update(12.0, [ServerReading("ps:1", "inc-a", True, {"w/0": 25, "b/0": 9}, 4096)])
    [row] = rates.rows(["ps:1"], {})
    assert (row["state"], row["shards"], row["bytes"], row["version"], row["pushes_per_s"]) == (
        "serving",
        2,
        4096,
        25,
        10.0,
    )
    rates.update(13.0, [ServerReading("ps:1", "inc-b", True, {"w/0": 0}, 2048)])
    [row] = rates.rows(["ps:1"], {})
    assert (row["pushes_per_s"], row["shards"], row["incarnation"]) == (None, 1, "inc-b")
    rates.update(14.0, [ServerReading("ps:1", None, reachable=True)])
    assert rates.rows(["ps:1", "ps:2"], {})[0]["state"] == "busy"
    assert rates.rows(["ps:1", "ps:2"], {})[1]["state"] == "unknown"


# ---------------------------------------------------------------- the status


def test_the_status_lists_problems_first_and_is_strict_json():
    log = RunLog(Clock())
    for i in range(4):
        log.worker_state(f"w:{i}", "up")
    log.worker_state("w:2", "down")
    log.worker_state("w:5", "down")  # joining
    log.report(7, float("inf"), None, {})
    status = status_of(log, 1010.0, queued=3, running={"w:0": 2})
    assert [w["address"] for w in status["workers"]] == ["w:2", "w:5", "w:0", "w:1", "w:3"]
    assert status["summary"]["workers"] == {"alive": 3, "joining": 1, "lost": 1, "stopped": 0, "total": 5}
    assert status["summary"]["closures"]["running"] == 2 and status["workers"][2]["running"] == 2
    assert status["summary"]["loss"] is None and status["summary"]["step"] == 7
    assert status["state"] == "training"
    json.dumps(status, allow_nan=False)


def test_the_worker_table_is_json_rows_problems_first_and_kept_until_a_worker_changes():
    clock = Clock(1000.123)
    log = RunLog(clock)
    queue = ClosureQueue(10, observer=log)
    hostile = 'w"\\</script>:1'
    for address in ("w:1", hostile, "w:3"):
        log.worker_state(address, "up")
    clock.now = 1002.456
    log.worker_state("w:3", "down")
    log.worker_device("w:1", "cuda:0")
    table = log.worker_table({"w:1": 2})
    assert table.counts == {"alive": 2, "joining": 0, "lost": 1, "stopped": 0, "total": 3}
    rows = table.rows()
    assert [r["address"] for r in rows] == ["w:3", "w:1", hostile]
    assert rows[1] == {
        "address": "w:1",
        "state": "alive",
        "since": 1000.12,
        "running": 2,
        "done": 0,
        "failed": 0,
        "retried": 0,
        "last_seen": None,
        "device": "cuda:0",
    }
    assert rows[0]["since"] == 1002.46 and rows[2]["device"] is None and rows[2]["running"] == 0
    assert log.worker_table({"w:1": 2}) is table, "nothing changed: the same table"
    assert log.worker_table({"w:1": 1}) is not table, "other closures in flight"
    table = log.worker_table({})
    log.worker_device("w:1", "cuda:0")
    assert log.worker_table({}) is table, "the same device again changes nothing"
    closure = Closure("step", b"")
    queue.put(closure, timeout=1)
    [taken] = queue.take("w:1", 1)
    queue.succeed(taken, 1)
    changed = log.worker_table({})
    assert changed is not table and (changed.rows()[1]["done"], changed.rows()[1]["last_seen"]) == (1, 1002.46)


def test_the_status_as_json_is_the_status():
    log = RunLog(Clock())
    for i in range(5):
        log.worker_state(f"w:{i}", "up")
    log.worker_state("w:2", "down")
    log.report(3, 0.5, float("nan"), {"auc": 0.75})
    running = {"w:0": 1, "w:4": 2}
    inputs = StatusInputs(
        now=1001.0,
        run=log.view(),
        series=series([sample(999.0, 0), sample(1000.0, 4)]),
        servers=[],
        queued=2,
        running=running,
        workers=log.worker_table(running),
        cursor=Cursor("ab", 0, 1, 6),
    )
    assert json.loads(encode_status(inputs)) == build_status(inputs)
    assert build_status(inputs)["cursor"] == "ab.0.1.6" and build_status(inputs)["since"] is None


# ---------------------------------------------------------------- the page


class _Collect(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and any(name == "data-address" for name, _ in attrs):
            self.rows.append(dict(attrs))

    def handle_data(self, data):
        self.text.append(data)


def test_the_page_renders_every_row_without_javascript_and_escapes_what_it_shows():
    log = RunLog(Clock())
    hostile = '<script>alert("x")</script>:1'
    for i in range(256):
        log.worker_state(f"10.0.{i // 100}.{i % 100}:2222", "up")
    log.worker_state(hostile, "down")
    page = render_page(status_of(log, 1000.0), query="?key=abc")
    collected = _Collect()
    collected.feed(page)
    workers = [row for row in collected.rows if row.get("data-state") is not None]
    assert len(workers) == 257
    assert hostile not in page and html.escape(hostile) in page
    assert page.count("<script>") == 1, "only the page's own script"
    assert 'data-query="?key=abc"' in page
    assert '<meta http-equiv="refresh"' in page  # inside <noscript>: it updates itself without JavaScript


def test_the_content_security_policy_allows_exactly_the_page_s_script_and_style():
    for text in (SCRIPT, STYLE):
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert re.search(r"connect-src 'self'", CONTENT_SECURITY_POLICY)


# ---------------------------------------------------------------- the terminal and the key


def test_the_terminal_prints_the_same_facts():
    clock = Clock()
    log = RunLog(clock)
    log.worker_state("w:1", "up")
    log.worker_state("w:2", "up")
    log.worker_state("w:2", "down")
    log.report(120, 0.25, 7680, {"accuracy": 0.875})
    samples = [sample(990.0, 0), sample(1000.0, 100)]
    rates = ServerRates()
    rates.update(1000.0, [ServerReading("ps:1", "inc-a", True, {"w/0": 3}, 1536)])
    status = json.loads(json.dumps(status_of(log, 1000.0, samples=samples, servers=rates.rows(["ps:1"], {}))))
    text = format_status(status, events=2)
    lines = text.splitlines()
    assert "steps run (20/s)" in lines[1] and "loss 0.25" in lines[1] and "accuracy 0.875" in lines[1]
    assert "2 (1 alive, 0 joining, 1 lost, 0 stopped)" in text
    assert re.search(r"w:2\s+lost", text) and re.search(r"w:1\s+alive", text)
    assert re.search(r"ps:1\s+serving\s+1\s+1.5 KiB", text)
    assert "events: 3 (newest 2)" in text and "worker-lost" in text


def test_the_page_s_key_is_derived_and_never_the_call_credential():
    token = "t" * 32
    key = status_key(token)
    assert key == status_key(token) and key != status_key("u" * 32)
    assert token not in key and key not in bearer_metadata(token)[1]
    with_token = status_request("127.0.0.1:8000", token)
    assert with_token.full_url == "http://127.0.0.1:8000/status.json"
    assert with_token.get_header("Authorization") == f"Bearer {key}"
    from_url = status_request("http://h:1/?key=abc", token)
    assert from_url.full_url == "http://h:1/status.json?key=abc" and from_url.get_header("Authorization") is None
    with pytest.raises(ValueError):
        status_request("ftp://h:1/", None)


def test_no_number_of_the_status_is_infinite():
    log = RunLog(Clock())
    log.report(None, math.inf, math.nan, {"m": -math.inf})
    status = status_of(log, 1000.0, samples=[sample(0.0, 0), sample(1.0, 1, loss=math.nan)])
    json.dumps(status, allow_nan=False)


def test_the_page_shows_where_each_worker_computes_and_each_servers_memory():
    clock = Clock()
    telemetry = CoordinatorTelemetry.build(clock=clock)
    telemetry.worker_state("w:1", "up")
    telemetry.worker_state("w:2", "up")
    telemetry.worker_device("w:1", "cuda:0")
    telemetry.worker_device("w:9", "cpu")  # a worker the page does not know (left already): nothing to show
    rates = ServerRates()
    rates.update(1000.0, [ServerReading("ps:1", "inc", True, {"v/0": 3}, 1 << 20, 300 << 20)])
    status = status_of(telemetry.run, 1000.0, servers=rates.rows(["ps:1"], telemetry.run.view().servers))
    assert {w["address"]: w["device"] for w in status["workers"]} == {"w:1": "cuda:0", "w:2": None}
    assert status["servers"][0]["memory"] == 300 << 20
    page = render_page(status)
    assert "cuda:0" in page and "300.0 MiB" in page, "the page without JavaScript shows them too"


def test_the_workers_row_reads_reach_the_summary_the_page_the_metrics_and_the_command_line():
    telemetry = CoordinatorTelemetry.build(clock=Clock())
    status = status_of(telemetry.run, 1010.0)
    assert status["summary"]["rows"] == {"pulled": 0, "cached": 0, "hit_rate": None, "ages": {}}
    assert "rows:" not in format_status(status), "no lookups yet: no line"

    telemetry.rows_read(30, 0, {})
    telemetry.rows_read(10, 60, {1: 20, 2: 5, 40: 30, 3: 5})
    rows = status_of(telemetry.run, 1011.0)["summary"]["rows"]
    assert rows == {"pulled": 40, "cached": 60, "hit_rate": 0.6, "ages": {"1": 20, "2": 5, "3": 5, "32+": 30}}
    assert list(rows["ages"]) == ["1", "2", "3", "32+"], "youngest first; ages over 32 share a label"

    status = status_of(telemetry.run, 1011.0)
    page = render_page(status)
    assert '<dd id="r-hit">0.6</dd>' in page and '<dd id="r-ages">1: 20, 2: 5, 3: 5, 32+: 30</dd>' in page
    assert "rows: 40 pulled, 60 cached (hit rate 0.6; cached rows by age in steps: 1: 20, 2: 5, 3: 5, 32+: 30)" in (
        format_status(status)
    )
    telemetry.rows_read(-5, -1, {-3: 4, 2: -1})  # a broken worker's answer: nothing counted, nothing raised
    assert status_of(telemetry.run, 1012.0)["summary"]["rows"] == rows
    text = generate_latest(telemetry.registry).decode()
    assert 'paramserve_coordinator_rows_total{source="cached"} 60.0' in text
    assert 'paramserve_coordinator_row_cache_staleness_steps_total{age="32+"} 30.0' in text
