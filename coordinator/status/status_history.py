"""The charts of the status page: the run's counters sampled over the whole run, and their points.

Plain Python, no HTTP and no threads of its own (``coordinator.status_page`` samples the run):
``History`` keeps samples of the run's counters taken at regular times, bounded: when full it
drops every other sample and keeps one in two from then on, so it always spans the whole run. It
turns each sample into the charts' ``Point`` as it is taken, so a reader that holds the charts
gets only the points after its own (``History.part``); ``series`` is the charts' data from a list
of samples, all at once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["History", "Point", "Sample", "columns", "point", "rounded", "series"]


@dataclass(frozen=True)
class Sample:
    """The run's counters at one time (cumulative counts; ``queued`` and ``running`` now)."""

    time: float
    scheduled: int
    done: int
    failed: int
    steps: int
    queued: int
    running: int
    samples: float | None = None
    loss: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


class Point(NamedTuple):
    """One point of the charts: the interval between two samples, at its end time ``t``, with the
    rates of the cumulative counters over it and the gauges and reported values at its end."""

    t: float
    scheduled_per_s: float | None
    done_per_s: float | None
    failed_per_s: float | None
    steps_per_s: float | None
    samples_per_s: float | None
    queued: int
    running: int
    loss: float | None
    metrics: Mapping[str, float | None]


COLUMNS = Point._fields[:-1]
"""The series' columns besides ``metrics`` (one per reported metric name)."""


def point(before: Sample, after: Sample) -> Point:
    """The charts' point for the interval from ``before`` to ``after``."""
    seconds = after.time - before.time
    return Point(
        round(after.time, 3),
        _rate(before.scheduled, after.scheduled, seconds),
        _rate(before.done, after.done, seconds),
        _rate(before.failed, after.failed, seconds),
        _rate(before.steps, after.steps, seconds),
        _rate(before.samples, after.samples, seconds),
        after.queued,
        after.running,
        rounded(after.loss),
        {name: rounded(value) for name, value in after.metrics.items()},
    )


def columns(points: Sequence[Point]) -> dict[str, Any]:
    """``points`` as the series' columns: one list per column, and ``metrics``: one list per
    metric name any of them has (None where a point has no value)."""
    out: dict[str, Any] = {name: [p[i] for p in points] for i, name in enumerate(COLUMNS)}
    names = sorted({name for p in points for name in p.metrics})
    out["metrics"] = {name: [p.metrics.get(name) for p in points] for name in names}
    return out


def series(samples: Sequence[Sample]) -> dict[str, Any]:
    """The charts' data: per interval between successive samples, its end time and the rates of
    the cumulative counters; the gauges and the reported values as sampled (``columns``)."""
    return columns([point(a, b) for a, b in zip(samples, samples[1:])])


class History:
    """Samples over the whole run in at most ``capacity`` (+1: the newest) entries, and the
    charts' points between them, each computed once, when its sample is taken. Thread-safe.

    The points between kept samples are final until the history is thinned (``layout`` counts
    the thinnings); the point from the last kept sample to a newer one not kept (the "tail") is
    replaced by the next. A reader that holds the first ``n`` final points of a layout needs only
    the points after them and the tail (``part``).
    """

    def __init__(self, capacity: int = 600):
        if capacity < 2 or capacity % 2:
            raise ValueError(f"capacity must be an even number >= 2, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._kept: list[Sample] = []
        self._points: list[Point] = []
        """Between successive kept samples: ``len(self._kept) - 1`` of them."""
        self._stride = 1
        self._offered = 0
        self._layout = 0
        self._newest: Sample | None = None
        self._series: dict[str, Any] | None = None

    def add(self, sample: Sample) -> None:
        with self._lock:
            self._newest, self._series = sample, None
            keep = self._offered % self._stride == 0
            self._offered += 1
            if not keep:
                return
            if self._kept:
                self._points.append(point(self._kept[-1], sample))
            self._kept.append(sample)
            if len(self._kept) > self._capacity:
                self._kept = self._kept[::2]  # the counters are cumulative: rates stay exact
                self._points = [point(a, b) for a, b in zip(self._kept, self._kept[1:])]
                self._stride *= 2
                self._layout += 1

    def samples(self) -> list[Sample]:
        """Oldest first, ending with the newest sample taken."""
        with self._lock:
            return self._kept + self._tail_sample()

    def position(self) -> tuple[int, int]:
        """Where the history stands: its layout and its final points (both only grow)."""
        with self._lock:
            return self._layout, len(self._points)

    def series(self) -> dict[str, Any]:
        """``series(self.samples())``, cached until the next sample."""
        with self._lock:
            return self._whole()

    def part(self, layout: int | None = None, held: int = 0) -> tuple[dict[str, Any], int, int]:
        """The series for a reader that holds ``held`` final points of ``layout`` (None: nothing):
        the columns of the points after them and the tail, with ``keep``, how many of its points
        the reader keeps (0 when the history was thinned since, or ``held`` is more than it has:
        the whole series); and the layout and final points the answer ends at."""
        with self._lock:
            keep = held if layout == self._layout and 0 <= held <= len(self._points) else 0
            part = columns(self._points[keep:] + self._tail()) if keep else self._whole()
            return {**part, "keep": keep}, self._layout, len(self._points)

    def _whole(self) -> dict[str, Any]:
        if self._series is None:
            self._series = columns(self._points + self._tail())
        return self._series

    def _tail_sample(self) -> list[Sample]:
        newest = self._newest
        return [] if newest is None or (self._kept and self._kept[-1] is newest) else [newest]

    def _tail(self) -> list[Point]:
        newest = self._newest
        if newest is None or not self._kept or self._kept[-1] is newest:
            return []
        return [point(self._kept[-1], newest)]


def _rate(before: float | None, after: float | None, seconds: float) -> float | None:
    if before is None or after is None or seconds <= 0:
        return None
    return rounded(max(0.0, after - before) / seconds)


def rounded(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those become null; the rest keeps 4 significant digits."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.4g}")
