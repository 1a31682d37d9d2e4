"""The status page in a real browser, as a person would see it during a run.

A local cluster (1 parameter server, 3 workers) trains the digits MLP with ``fit`` on a
coordinator that serves its status page; headless Chromium (tests/browser.py) opens the page and
this test checks what it shows: every worker, a killed worker shown as lost within 2 s, its
recovery and a checkpoint on the timeline, the charts drawn (from answers to ``?since=``: only
the points after the page's own), no console error, and the tables again with JavaScript off. A
second test checks that the charts the script merges from those answers are the whole series.
Both skip where no Chromium is installed (``apt-get install chromium``; ``.ci/run`` installs it
where it can). With ``PARAMSERVE_STATUS_SCREENSHOTS=DIR`` the screenshot taken while the worker
is lost is written to DIR (docs/ holds the one the docs show).
"""

from __future__ import annotations

import functools
import os
import pathlib
import threading
import time

import pytest
import torch
from torch import nn

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, worker_batches
from paramserve.coordinator.status.cluster_status import RunLog
from paramserve.coordinator.status.status_page import StatusPage, StatusSources
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.coordinator.training.callbacks import Callback
from paramserve.coordinator.training.loops import fit
from tests.browser import Browser, find_chromium

TOKEN = "status-page-browser-token-0123"
WORKERS = 3
LOST_WITHIN_SECONDS = 2.0
CHARTS = ("closures", "queue", "steps", "samples", "loss", "metric-accuracy")

pytestmark = pytest.mark.timeout(240)


class StopWhenTold(Callback):
    """Ends fit after the epoch in which ``stop`` was set (fit runs until the test is done)."""

    def __init__(self, stop: threading.Event):
        self._stop = stop

    def on_epoch_end(self, epoch, logs=None):
        if self._stop.is_set():
            self.state.stop_training = True


def rows(state: str | None = None) -> str:
    selector = "#workers-body tr" + (f'[data-state="{state}"]' if state else "")
    return f"Array.from(document.querySelectorAll('{selector}')).map(r => r.dataset.address)"


def event_rows(kind: str) -> str:
    return f"Array.from(document.querySelectorAll('#events-body tr[data-kind=\"{kind}\"]')).map(r => r.textContent)"


def drawn(chart: str) -> str:
    return f"Number(document.querySelector('#chart-{chart} svg').dataset.points || 0)"


def test_the_status_page_shows_the_cluster_a_lost_worker_and_its_recovery(start_cluster, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium on this machine: `apt-get install chromium` (Debian) runs this test")
    cluster = start_cluster(num_ps=1, num_workers=WORKERS, token=TOKEN)
    strategy = ParameterServerStrategy(cluster.spec, token=TOKEN)
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(64)
    optimizer = strategy.optimizer(torch.optim.Adam, lr=5e-3)
    stop, failures = threading.Event(), []
    with ClusterCoordinator(strategy, status_port=0) as coordinator:

        def train() -> None:
            try:
                fit(
                    model,
                    optimizer,
                    nn.CrossEntropyLoss(reduction="none"),
                    functools.partial(worker_batches, batch_size=32),
                    epochs=100_000,
                    steps_per_epoch=40,
                    steps_per_execution=2,
                    strategy=strategy,
                    coordinator=coordinator,
                    callbacks=[StopWhenTold(stop)],
                    verbose=False,
                )
            except BaseException as exc:  # reported by the test, not lost in the thread
                failures.append(exc)

        trainer = threading.Thread(target=train, name="test-fit", daemon=True)
        trainer.start()
        url = coordinator.status_url
        assert url is not None and "key=" in url
        try:
            with Browser(chromium) as browser:
                browser.open(url)
                addresses = sorted(browser.evaluate(rows()))
                assert addresses == sorted(cluster.spec.workers), "every worker listed from the first paint"
                for chart in CHARTS:  # fit reports loss, samples and accuracy through the coordinator
                    browser.wait_for(f"{drawn(chart)} >= 6", timeout=60)
                # The charts grow from answers that carry only the points after the page's own. On a
                # slow machine the first (whole) answer may already hold six points, so the page is
                # given a few polls (one a second) to ask for what it lacks.
                asked = "performance.getEntriesByType('resource').map(e => e.name).filter(n => n.includes('since='))"
                assert browser.wait_for(f"{asked}.length >= 3", timeout=15), "the script asks for what it lacks"
                growing = f"{drawn(CHARTS[0])}"
                before = browser.evaluate(growing)
                browser.wait_for(f"{growing} > {before}", timeout=15)  # answers with only new points still draw

                killed = cluster.spec.workers[1]
                cluster.kill_worker(1)
                gone = time.monotonic()
                assert browser.wait_for(rows("lost"), timeout=LOST_WITHIN_SECONDS + 1.0) == [killed]
                assert time.monotonic() - gone <= LOST_WITHIN_SECONDS
                assert browser.wait_for(event_rows("worker-lost"), timeout=5)
                # The server's row: its shards and the pushes per second its versions moved at.
                pushes = "document.querySelector('#servers-body tr td:nth-child(7)').textContent"
                assert float(browser.wait_for(f"Number({pushes}.replace(/,/g, '')) > 0 && {pushes}", timeout=30)) > 0
                memory = "document.querySelector('#servers-body tr td:nth-child(5)').textContent"
                assert browser.evaluate(memory).endswith("MiB"), "the server's resident memory is shown"
                device = "document.querySelector('#workers-body tr td:nth-child(3)').textContent"
                assert browser.wait_for(f"{device} == 'cpu' && {device}", timeout=10) == "cpu"
                screenshots = os.environ.get("PARAMSERVE_STATUS_SCREENSHOTS")
                browser.screenshot(tmp_path / "status-page.png")
                if screenshots:
                    browser.screenshot(pathlib.Path(screenshots) / "status-page-lost-worker.png")
                assert (tmp_path / "status-page.png").stat().st_size > 10_000

                cluster.restart_worker(1)
                assert killed in browser.wait_for(event_rows("worker-recovered"), timeout=60)[0]
                assert killed in browser.wait_for(rows("alive"), timeout=5)
                CheckpointManager(strategy, tmp_path / "checkpoints").save(step=1)
                [saved] = browser.wait_for(event_rows("checkpoint"), timeout=10)
                assert "step 1" in saved and "whole" in saved and "NOT whole" not in saved
                assert browser.errors == [], "the page logged errors"

                # Without JavaScript the same tables arrive rendered, and the charts say they need it.
                browser.send("Emulation.setScriptExecutionDisabled", {"value": True})
                browser.open(url)
                assert sorted(browser.evaluate(rows())) == sorted(cluster.spec.workers)
                assert browser.evaluate(event_rows("worker-lost"))
                assert browser.evaluate(f"{drawn('loss')}") == 0
                assert browser.errors == []
        finally:
            stop.set()
            trainer.join(120)
    strategy.close()
    assert not trainer.is_alive() and failures == []


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_page_s_charts_are_the_whole_series_merged_from_answers_to_since():
    """The script's merge: through thinnings of the history (a whole series resent), tails
    replaced, and a metric that first comes mid-run, what it draws is the whole series."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium on this machine: `apt-get install chromium` (Debian) runs this test")
    clock, depth = Clock(), [0]
    run = RunLog(clock)
    for i in range(3):
        run.worker_state(f"127.0.0.1:{7000 + i}", "up")
    sources = StatusSources(
        run=run,
        queued=lambda: depth[0],
        running=dict,
        in_flight=lambda: 1,
        checkpoint=lambda: None,
        parameter_servers=(),
    )
    page = StatusPage(sources, interval=3600.0, history=8, clock=clock)  # the test takes the samples
    page.start("127.0.0.1", 0)
    try:
        with Browser(chromium) as browser:
            browser.open(page.url)
            deadline = time.monotonic() + 10
            while page.cpu_seconds[1] == 0 and time.monotonic() < deadline:  # the sampler's own first sample
                time.sleep(0.01)
            for i in range(1, 26):
                clock.now += 1.0
                depth[0] = i % 5
                run.report(i, 1.0 / i, None, {"auc": i / 100} if i >= 10 else {})
                page.sample()
                if i % 3 and i != 25:
                    continue
                whole = page.status()["series"]
                span = f"-{whole['t'][-1] - whole['t'][0]:.0f} s" if len(whole["t"]) > 1 else None
                points = 2 * len(whole["t"]) if len(whole["t"]) > 1 else 0
                auc = sum(v is not None for v in whole["metrics"].get("auc", []))
                labels = "Array.from(document.querySelectorAll('#chart-queue svg text')).map(t => t.textContent)"
                browser.wait_for(f"{drawn('queue')} == {points} && {labels}.includes({span!r})", timeout=10)
                if auc > 1:
                    browser.wait_for(f"{drawn('metric-auc')} == {auc}", timeout=10)
            asked = "performance.getEntriesByType('resource').filter(e => e.name.includes('since=')).length"
            assert browser.evaluate(asked) >= 5
            assert browser.errors == [], "the page logged errors"
    finally:
        page.stop(10)
