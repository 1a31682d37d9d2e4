"""Replica threads of a strategy and the merge points where they meet in a ``strategy.run``.

``ReplicaThreads``: one persistent thread per replica, started by a strategy's first
``run`` and reused by the next ones (``close()`` joins them). One ``Rendezvous`` per run: at a
merge point (``optimizer.step()``, ``ReplicaContext.all_reduce``) every replica deposits its value; the last to
arrive combines them once, under the lock, and each replica takes its share.
A replica that returns or fails can never reach another merge point, so it
*departs*: replicas waiting (or arriving later) get ReplicaDeparted instead of
waiting forever.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paramserve.coordinator.strategies.base import Strategy, replica_thread_context
from paramserve.psserver.runtime.devices import computing_on


class ReplicaDeparted(RuntimeError):
    """A merge point that cannot complete: another replica stopped before reaching it."""


class _Failure:
    def __init__(self, error: BaseException, replica: int):
        self.error = error
        self.replica = replica


class Rendezvous:
    """Merge points shared by ``parties`` replica threads (one generation per merge point)."""

    def __init__(self, parties: int):
        self._parties = parties
        self._cond = threading.Condition()
        self._generation = 0
        self._slots: list[Any] = [None] * parties
        self._arrived = 0
        self._result: Any = None
        self._broken: str | None = None

    def exchange(self, replica: int, value: Any, combine: Callable[[list[Any]], Sequence[Any]]) -> Any:
        """Deposits ``value``; returns entry ``replica`` of ``combine(all values)``, which
        runs once, in the last replica to arrive. Every replica must call it in the same order.

        Raises:
            ReplicaDeparted: another replica finished or failed without reaching this point.
        """
        with self._cond:
            self._raise_if_broken(replica)
            generation = self._generation
            self._slots[replica] = value
            self._arrived += 1
            if self._arrived == self._parties:
                self._complete(replica, combine)
            else:
                self._cond.wait_for(lambda: self._generation != generation or self._broken is not None)
                if self._generation == generation:
                    self._raise_if_broken(replica)
            result = self._result  # stays until every replica (including this one) arrives again
        if isinstance(result, _Failure):
            if result.replica == replica:
                raise result.error
            raise ReplicaDeparted(f"the merge step run by replica {result.replica} failed") from result.error
        return result[replica]

    def _complete(self, replica: int, combine: Callable[[list[Any]], Sequence[Any]]) -> None:
        values, self._slots = self._slots, [None] * self._parties
        try:
            self._result = combine(values)
        except BaseException as error:  # every waiting replica must learn of it
            self._result = _Failure(error, replica)
        self._arrived = 0
        self._generation += 1
        self._cond.notify_all()

    def depart(self, replica: int, reason: str = "returned") -> None:
        """Replica ``replica`` will reach no further merge point."""
        with self._cond:
            if self._broken is None:
                self._broken = (
                    f"replica {replica} {reason} without reaching this merge point: every replica must "
                    "call the same merge points (optimizer.step(), all_reduce) the same number of times"
                )
            if self._arrived:
                self._cond.notify_all()

    def abort(self, reason: str) -> None:
        with self._cond:
            self._broken = reason
            self._cond.notify_all()

    def _raise_if_broken(self, replica: int) -> None:
        if self._broken is not None:
            raise ReplicaDeparted(f"replica {replica} cannot merge: {self._broken}")


replica_thread = threading.local()
"""While a thread runs one of a strategy's replicas (``run_replicas``): ``.strategy`` and its
``.replica`` id; otherwise None or unset (read them with a default). Read it through
``running_strategy`` and ``replica_of``; ``_capture``'s module redirection reads it directly,
as it runs on every attribute access of a distributed module and must stay one thread-local read."""


def running_strategy() -> Strategy | None:
    """The strategy whose replica this thread is running, if any."""
    return getattr(replica_thread, "strategy", None)


def replica_of(strategy: Strategy) -> int | None:
    """This thread's replica id when it is one of ``strategy``'s replica threads (a
    thread-local read: cheap enough for every attribute access of a distributed module)."""
    if getattr(replica_thread, "strategy", None) is not strategy:
        return None
    return replica_thread.replica


class ReplicaThreads:
    """One persistent, named (``<name>-replica-<r>``) thread per replica, reused by every
    ``run`` of one strategy: starting threads at each step costs more than a small model's
    step. Started at the first ``run``; ``close()`` stops and joins them (a later ``run``
    starts new ones). Idle threads also stop on their own when the owning strategy is
    garbage-collected (``stop_soon``). They are daemon threads: only an idle one can be
    left when the interpreter exits (a running one has its caller waiting in ``run``), and
    an idle one holds nothing, so it never keeps the process alive.
    """

    _IDLE_CHECK = 1.0
    """Seconds between an idle thread's checks of ``stop_soon``."""

    def __init__(self, name: str, count: int):
        self._name = name
        self._count = count
        self._reset()

    def _reset(self) -> None:
        """Fresh state: at construction, and in a child process after fork (the parent's
        threads do not exist there; the next run starts new ones)."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for a job
        self._done = threading.Condition(self._lock)  # the caller waits here for the workers
        self._threads: list[threading.Thread] = []
        self._jobs: list[Callable[[], None] | None] = [None] * self._count
        self._generation = 0  # one per submitted batch of jobs
        self._pending = 0
        self._stopping = False

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        return tuple(self._threads)

    def run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Runs ``jobs[r]`` in replica thread r and waits until every job has returned.
        Jobs must not raise. If the wait is interrupted (KeyboardInterrupt), the caller must
        make the jobs finish (abort their rendezvous) and then ``wait()`` for them."""
        with self._lock:
            if self._pending:
                raise RuntimeError(f"{self._name} replica threads are already running jobs")
            if not self._threads or self._stopping:
                self._start()
            self._jobs = list(jobs)
            self._pending = self._count
            self._generation += 1
            self._work.notify_all()
            while self._pending:
                self._done.wait()

    def wait(self) -> None:
        """Waits until no job is running."""
        with self._lock:
            while self._pending:
                self._done.wait()

    def stop(self) -> None:
        """Asks the threads to exit once idle, and wakes them (does not wait for them)."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()

    def stop_soon(self) -> None:
        """Asks the threads to exit once idle, without taking the lock: idle threads see it
        within ``_IDLE_CHECK`` seconds. For garbage-collection callbacks, which may run in
        any thread at any allocation, even one holding the lock."""
        self._stopping = True

    def close(self) -> None:
        """Stops the threads and joins them."""
        if threading.current_thread() in self._threads:
            raise RuntimeError(f"{self._name}.close() was called from one of its own replica threads")
        self.stop()
        for thread in self._threads:
            thread.join()
        with self._lock:
            if self._stopping:
                self._threads = []

    def _start(self) -> None:  # under the lock
        for thread in self._threads:  # stopping ones: they exit once idle (they are idle now)
            if thread is not threading.current_thread():
                self._lock.release()
                try:
                    thread.join()
                finally:
                    self._lock.acquire()
        self._stopping = False
        self._threads = [
            threading.Thread(
                target=self._serve, args=(r, self._generation), name=f"{self._name}-replica-{r}", daemon=True
            )
            for r in range(self._count)
        ]
        _live.add(self)
        for thread in self._threads:
            thread.start()

    def _serve(self, replica: int, seen: int) -> None:
        while True:
            with self._lock:
                while self._generation == seen and not self._stopping:
                    self._work.wait(self._IDLE_CHECK)
                if self._generation == seen:  # stopping, and no job for this thread
                    return
                seen = self._generation
                job, self._jobs[replica] = self._jobs[replica], None
            try:
                if job is not None:
                    job()
            finally:
                del job  # drop references to the run (and its strategy) while idle
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._done.notify_all()


_live: weakref.WeakSet[ReplicaThreads] = weakref.WeakSet()


def _reset_all_after_fork() -> None:
    for threads in list(_live):
        threads._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_after_fork)


def run_replicas(
    strategy: Strategy,
    devices: Sequence[torch.device],
    body: Callable[[int], Any],
    rendezvous: Rendezvous,
    threads: ReplicaThreads,
) -> list[Any]:
    """Runs ``body(replica_id)`` in each replica's thread of ``threads``, in replica context
    (a GPU replica's device current for CUDA, no default device: see psserver.devices), and
    waits for them all. Returns the results in replica order.

    Raises the first replica's own error (not a ReplicaDeparted it caused elsewhere),
    with a note naming the replica."""
    results: list[Any] = [None] * len(devices)
    errors: list[BaseException | None] = [None] * len(devices)
    grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: inherit the caller's

    def main(replica: int) -> None:
        reason = "returned"
        replica_thread.strategy, replica_thread.replica = strategy, replica
        try:
            with (
                replica_thread_context(strategy, replica),
                torch.set_grad_enabled(grad_enabled),
                computing_on(devices[replica]),
            ):
                results[replica] = body(replica)
        except BaseException as error:
            errors[replica], reason = error, f"failed ({type(error).__name__})"
        finally:
            replica_thread.strategy = replica_thread.replica = None
            rendezvous.depart(replica, reason)

    name = type(strategy).__name__
    try:
        threads.run([functools.partial(main, r) for r in range(len(devices))])
    finally:
        rendezvous.abort(f"{name}.run was interrupted")
        threads.wait()
    _raise_first(name, errors)
    return results


def _raise_first(name: str, errors: Sequence[BaseException | None]) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    replica, error = next(((r, e) for r, e in failed if not isinstance(e, ReplicaDeparted)), failed[0])
    error.add_note(f"raised in replica {replica} of {name}.run ({len(failed)} of {len(errors)} replicas failed)")
    raise error
