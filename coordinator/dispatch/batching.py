"""How many queued closures one RunClosures call carries: ``BatchSizer``, a pure decision.

No clocks, threads or I/O here: the dispatch loop asks for a batch size and the dispatchers
report the durations they measured. Apart from dispatch so that the sizing rule stands alone
(and is unit-tested) like the failure policy (coordinator.failures).
"""

from __future__ import annotations

__all__ = ["BATCH_SECONDS", "ROUND_FACTOR", "BatchSizer"]


BATCH_SECONDS = 0.1
"""How long a batch of closures lasts on a worker by default (CoordinatorConfig.batch_seconds).
Each RunClosures call costs a millisecond or two of coordinator and worker CPU and a gap in the
worker's work; at 0.1 s a batch of 4 ms training steps carries 16 (max_batch) of them, which
on 2 cores took the small-model benchmark from ~180 to ~250-300 steps/s. A closure keeps its id
in a batch, so one retried after its worker died mid-batch still applies its pushes once."""


ROUND_FACTOR = 4
"""A hybrid-training round's share per worker lasts this many batches' time: a round costs more
than a call (every member waits for the slowest, then one more collective ends the round), and
its closures wait for no free worker (every worker has its share)."""


class BatchSizer:
    """How many queued closures one RunClosures call carries.

    A batch saves a round trip per closure (about a millisecond of coordinator and worker
    time), which matters only for closures of a few milliseconds; and its closures run one
    after another on one worker. So a batch is sized to last about ``target_seconds`` at the
    recent closure duration (an exponential average of what workers report), never more than
    ``max_batch``, and is 1 until a duration is known.

    Within that, a batch takes no more than one worker's share of the queue, counting every
    worker of the cluster (a closure another worker could start now, or once it is back up,
    is not held back), with one exception: closures that together run in less time than a
    call costs beyond its closures (its overhead: round trip, (un)marshalling, the
    coordinator's and the worker's handling, measured on every call) are batched even while
    other workers are free. Sending each of them alone would cost more than running them one
    after another, so holding one behind the others at most doubles its wait, and a large
    cluster of idle workers does not turn a backlog of short closures into one call each.
    """

    def __init__(self, max_batch: int = 16, target_seconds: float = BATCH_SECONDS, smoothing: float = 0.2):
        if target_seconds <= 0:
            raise ValueError(f"target_seconds must be > 0, got {target_seconds}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.target_seconds = target_seconds
        self._smoothing = smoothing
        self._seconds: float | None = None
        self._call_overhead: float | None = None

    def observe(self, seconds: float) -> None:
        """A closure ran for ``seconds`` on a worker."""
        if seconds >= 0:
            self._seconds = self._averaged(self._seconds, seconds)

    def observe_call(self, seconds: float, closure_seconds: float) -> None:
        """A call took ``seconds`` from send to reply, ``closure_seconds`` of which its
        closures ran on the worker."""
        if seconds >= 0 and closure_seconds >= 0:
            self._call_overhead = self._averaged(self._call_overhead, max(0.0, seconds - closure_seconds))

    @property
    def call_overhead(self) -> float:
        """The recent seconds a call costs beyond its closures (0 until a call is seen)."""
        return self._call_overhead or 0.0

    def _averaged(self, average: float | None, sample: float) -> float:
        return sample if average is None else average + self._smoothing * (sample - average)

    def size(self, queued: int, workers: int) -> int:
        if self._seconds is None or queued <= 1:
            return 1
        seconds = max(self._seconds, 1e-6)
        share = max(1, queued // max(1, workers))
        cheaper_than_a_call = int(self.call_overhead / seconds)
        lasting = max(1, int(self.target_seconds / seconds))
        return min(self.max_batch, queued, lasting, max(share, cheaper_than_a_call))

    def round_share(self, queued: int, members: int) -> int:
        """Closures per member of a hybrid-training round: as ``size`` with ROUND_FACTOR times
        the target duration and ``max_batch``, and at most an even share of the queue."""
        if self._seconds is None or queued <= 1:
            return 1
        lasting = max(1, int(ROUND_FACTOR * self.target_seconds / max(self._seconds, 1e-6)))
        return min(self.max_batch * ROUND_FACTOR, max(1, -(-queued // max(1, members))), lasting)
