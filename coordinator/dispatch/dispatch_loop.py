"""Dispatch: how scheduled closures reach the workers.

One thread, ``paramserve-dispatch``, runs an asyncio event loop that holds a
``Dispatcher`` per worker and talks to the workers with grpc.aio: however many
workers there are, the coordinator has one dispatch thread (threads do not grow
with the workers). When closures are queued and a worker is free, the loop hands
that worker a batch of them: one ``RunClosures`` call carries them, the worker runs
them in order and stops at the first that does not succeed. Each closure keeps its
own id, attempts and RemoteValue; batching only saves round trips. A batch forms
only from short closures under a backlog (``BatchSizer``): closures of one batch run
one after another on one worker, so a long closure is never held behind another
while a worker could start it.

Under hybrid training (``dense``) the loop runs rounds instead: every member of the workers'
dense group gets a call at once, and the next round waits for all of them
(``coordinator.dense_rounds``).

What a dispatcher sends and how it acts on each failure is ``coordinator.dispatcher``;
the call itself is ``coordinator.worker_transport``; batch sizes are
``coordinator.batching``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from paramserve.coordinator.dispatch.batching import BATCH_SECONDS, BatchSizer
from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue
from paramserve.coordinator.dispatch.dense_rounds import DenseRounds, round_shares
from paramserve.coordinator.dispatch.dispatcher import Dispatcher, ResourceSpecs, WireContext, WorkerState
from paramserve.coordinator.dispatch.failures import FailurePolicy
from paramserve.coordinator.dispatch.observer import NO_OBSERVER, CoordinatorObserver
from paramserve.coordinator.dispatch.worker_transport import RpcFailure, WorkerTransport
from paramserve.coordinator.errors import ClosureError
from paramserve.worker.dense.group import DenseRound

__all__ = ["DispatchLoop", "THREAD_NAME"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

THREAD_NAME = "paramserve-dispatch"


# ---------------------------------------------------------------- all workers, one loop


class DispatchLoop:
    """Every worker's dispatcher on one event loop in one thread (``paramserve-dispatch``).

    Free workers wait in a FIFO; each put to the queue wakes the loop, which gives the free
    workers batches (O(1) work per closure, whatever the number of workers). Workers may join
    and leave while closures run. Methods other than ``dispatchers`` are thread-safe.
    """

    def __init__(
        self,
        *,
        queue: ClosureQueue,
        specs: ResourceSpecs,
        policy: FailurePolicy,
        transport_factory: Callable[[str], WorkerTransport],
        cluster_context: Callable[[], WireContext],
        max_value_age: float = 0.0,
        overlap_pushes: bool = False,
        max_row_staleness: int = 0,
        max_batch: int = 16,
        batch_seconds: float = BATCH_SECONDS,
        on_server_failure: Callable[[str], None] | None = None,
        observer: CoordinatorObserver = NO_OBSERVER,
        dense: DenseRounds | None = None,
    ):
        self._sizer = BatchSizer(max_batch, batch_seconds)
        self._dense = dense
        self._round: set[asyncio.Task[Any]] | None = None  # the calls of the round running
        self._observer = observer
        self._on_server_failure = on_server_failure
        self._server_hold = False  # dispatch held since a closure saw a parameter server fail
        self._queue = queue
        self._specs = specs
        self._policy = policy
        self._transport_factory = transport_factory
        self._cluster_context = cluster_context
        self._max_value_age = max_value_age
        self._overlap_pushes = overlap_pushes
        self._max_row_staleness = max_row_staleness
        self._event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._dispatchers: dict[str, Dispatcher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._free: collections.deque[Dispatcher] = collections.deque()
        self._closure_calls: set[asyncio.Task[Any]] = set()  # calls carrying closures (not probes)
        self._drained: asyncio.Event | None = None  # set while none runs; made on the loop
        self._holds = 0
        self._stopped = False
        self._thread.start()
        queue.set_waker(self._wake)

    # ---------------------------------------------------------------- from any thread

    def add_worker(self, address: str, *, probe_first: bool = False) -> Dispatcher:
        """Starts dispatching to ``address`` with the smallest free worker index; with
        ``probe_first``, once its health check says it serves."""
        return self._call(self._add(address, probe_first))

    def remove_worker(self, address: str, timeout: float | None = None) -> None:
        """Stops dispatching to ``address``; the closures it was running go back to the queue."""
        self._call(self._remove(address), timeout)

    def num_workers(self) -> int:
        return len(self._dispatchers)

    def dispatchers(self) -> list[Dispatcher]:
        return sorted(self._dispatchers.values(), key=lambda d: d.index)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def stop(self, timeout: float | None = None) -> bool:
        """Cancels every call in progress (its closures go back to the queue, which the
        coordinator has closed by then), closes the connections and joins the thread.
        Returns whether the thread ended within ``timeout``."""
        if not self._stopped:
            self._stopped = True
            try:
                self._call(self._stop_all(), timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.error("the dispatch loop did not stop its workers within %ss", timeout)
            self._event_loop.call_soon_threadsafe(self._event_loop.stop)
        self._thread.join(timeout)
        if self._dense is not None and not self._thread.is_alive():
            self._dense.close()
        return not self._thread.is_alive()

    def cancel_running(self, timeout: float) -> int:
        """Asks every worker running closures to cancel them (Dispatcher.cancel_running);
        returns how many closures that concerned. Their calls answer them as cancelled."""
        return self._call(self._cancel_running(timeout))

    def release_server_hold(self) -> None:
        """Ends the hold a parameter server's failure put on dispatch (the recovery is over)."""
        self._call(self._release_server_hold())

    @contextlib.contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """No closure starts while inside, and entering waits until none is running: a point
        between closures, where every closure that finished has all its pushes applied and
        none is half done (checkpoints and restores are taken there). Closures queue up
        meanwhile. Raises TimeoutError (and resumes) when closures still run after
        ``timeout`` seconds. Nests; safe from any thread but the dispatch thread."""
        self._call(self._hold())
        try:
            self._call(self._wait_drained(), timeout)
        except BaseException:
            self._call(self._release())
            raise
        try:
            yield
        finally:
            self._call(self._release())

    def read_dense_state(self, timeout: float) -> bytes:
        """Hybrid training: the dense variables' state as a worker of the group holds it, read
        between rounds (empty when no worker holds any yet). Raises RuntimeError without a
        dense group, TimeoutError when rounds still run after ``timeout`` seconds."""
        if self._dense is None:
            raise RuntimeError("this coordinator's strategy has no replicated dense variables (sync_dense=False)")
        with self.paused(timeout):
            return self._call(self._read_dense(timeout), timeout)

    def _wake(self) -> None:
        if not self._stopped and not self._event_loop.is_closed():
            try:
                self._event_loop.call_soon_threadsafe(self._assign)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _call(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a DispatchLoop method was called from its own thread")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    # ---------------------------------------------------------------- on the loop

    def _serve(self) -> None:
        asyncio.set_event_loop(self._event_loop)
        try:
            self._event_loop.run_forever()
        finally:
            self._event_loop.run_until_complete(self._event_loop.shutdown_asyncgens())
            self._event_loop.close()

    async def _add(self, address: str, probe_first: bool = False) -> Dispatcher:
        if self._stopped:
            raise RuntimeError("the coordinator is shut down; it cannot add workers")
        if address in self._dispatchers:
            raise ValueError(f"worker {address} is already part of the cluster")
        used = {d.index for d in self._dispatchers.values()}
        index = next(i for i in range(len(used) + 1) if i not in used)
        dispatcher = Dispatcher(
            address,
            index,
            queue=self._queue,
            specs=self._specs,
            transport=self._transport_factory(address),
            cluster_context=self._cluster_context,
            num_workers=self.num_workers,
            policy=self._policy,
            max_value_age=self._max_value_age,
            overlap_pushes=self._overlap_pushes,
            max_row_staleness=self._max_row_staleness,
            sizer=self._sizer,
            observer=self._observer,
            server_failed=self._server_failed if self._on_server_failure is not None else None,
            probe_first=probe_first,
        )
        self._dispatchers[address] = dispatcher
        log.info("worker %d (%s) joined%s", index, address, " (probed first)" if probe_first else "")
        if dispatcher.state is WorkerState.DOWN:
            self._start(dispatcher, self._probe(dispatcher))
        else:
            self._free.append(dispatcher)
            self._assign()
        return dispatcher

    async def _remove(self, address: str) -> None:
        dispatcher = self._dispatchers.pop(address, None)
        if dispatcher is None:
            raise KeyError(f"worker {address} is not part of the cluster")
        await self._retire(dispatcher, "removed from the cluster")
        self._observer.worker_state(address, None)
        log.info("worker %d (%s) left", dispatcher.index, address)
        self._assign()

    async def _retire(self, dispatcher: Dispatcher, reason: str) -> None:
        if dispatcher in self._free:
            self._free.remove(dispatcher)
        task = self._tasks.pop(dispatcher.address, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        dispatcher.stop(reason)
        await dispatcher.close()

    async def _stop_all(self) -> None:
        for dispatcher in list(self._dispatchers.values()):
            await self._retire(dispatcher, "the coordinator stops")

    async def _cancel_running(self, timeout: float) -> int:
        counts = await asyncio.gather(*(d.cancel_running(timeout) for d in self._dispatchers.values()))
        return sum(counts)

    async def _hold(self) -> None:
        self._holds += 1

    def _server_failed(self, server: str) -> None:
        """A closure saw parameter server ``server`` fail (on the loop): no batch starts until
        its recovery releases the hold, so closures put back do not spend their waits on a
        server that is still down."""
        if not self._server_hold:
            self._server_hold = True
            self._holds += 1
        assert self._on_server_failure is not None
        self._on_server_failure(server)

    async def _release_server_hold(self) -> None:
        if self._server_hold:
            self._server_hold = False
            await self._release()

    async def _release(self) -> None:
        self._holds -= 1
        self._assign()

    async def _wait_drained(self) -> None:
        if self._drained is None:
            self._drained = asyncio.Event()
        if not self._closure_calls:
            self._drained.set()
        await self._drained.wait()

    async def _read_dense(self, timeout: float) -> bytes:
        assert self._dense is not None
        request = self._dense.read_request()
        for dispatcher in self.dispatchers():
            if dispatcher.state is not WorkerState.UP:
                continue
            try:
                return await dispatcher.read_dense_state(request, timeout)
            except RpcFailure as failure:
                log.warning(
                    "worker %s did not give its dense state: %s %s", dispatcher.address, failure.code, failure.details
                )
        return b""

    def _assign(self) -> None:
        """Gives free workers batches while closures are queued (unless paused)."""
        if self._dense is not None:
            self._assign_round()
            return
        while self._free and not self._stopped and not self._holds:
            queued = self._queue.num_queued
            if queued == 0:
                return
            dispatcher = self._free.popleft()
            batch = self._queue.take(dispatcher.address, self._sizer.size(queued, len(self._dispatchers)))
            if not batch:
                self._free.appendleft(dispatcher)
                return
            self._start(dispatcher, dispatcher.run(batch), carries_closures=True)

    def _assign_round(self) -> None:
        """Hybrid training: starts a round once every member of the group (every worker UP) is
        free and closures are queued; each member gets its share, possibly none."""
        if self._round is not None or self._stopped or self._holds or self._dense is None:
            return
        members = [d for d in self.dispatchers() if d.state is WorkerState.UP]
        queued = self._queue.num_queued
        if not members or queued == 0 or any(d not in self._free for d in members):
            return
        shares = round_shares(queued, len(members), self._sizer.round_share(queued, len(members)))
        batches: list[list[Closure]] = [self._queue.take(d.address, n) if n else [] for d, n in zip(members, shares)]
        if not any(batches):
            return
        try:
            member_rounds = self._dense.member_rounds([d.address for d in members])
        except Exception as exc:  # the user's setup (e.g. dense variables without an optimizer)
            self._fail_round(batches, exc)
            return
        longest = max(len(batch) for batch in batches)
        self._round = set()
        for dispatcher, batch, member_round in zip(members, batches, member_rounds):
            self._free.remove(dispatcher)
            self._round.add(
                self._start(dispatcher, self._in_round(dispatcher, batch, member_round, longest), carries_closures=True)
            )

    def _fail_round(self, batches: list[list[Closure]], exc: Exception) -> None:
        """A round that cannot be prepared fails its closures with the reason: putting them
        back would try again forever and leave join() waiting without end."""
        closures = [closure for batch in batches for closure in batch]
        log.error("the dense group's round could not be prepared: %s", exc)
        error = ClosureError(
            remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=f"the dense group's round could not be prepared: {exc}",
            function_name=closures[0].function_name,
            closure_id=closures[0].closure_id,
            remote_exception=exc,
        )
        self._queue.fail(closures[0], error, not_run=closures[1:])

    async def _in_round(
        self, dispatcher: Dispatcher, batch: list[Closure], member_round: DenseRound, longest: int
    ) -> None:
        """One member's call of the round. A call that fails (the worker died: its call fails at
        once), or a member removed mid-round, breaks the group, and gives its generation up at
        once: members still in its rendezvous stop waiting for one that will not come."""
        try:
            broke = await dispatcher.run_round(batch, member_round, longest)
        except asyncio.CancelledError:
            if self._dense is not None:
                self._dense.broke(f"worker {dispatcher.address} left during the round")
            raise
        if broke and self._dense is not None:
            self._dense.broke(f"the round broke at worker {dispatcher.address}")

    def _start(
        self, dispatcher: Dispatcher, work: Coroutine[Any, Any, Any], *, carries_closures: bool = False
    ) -> asyncio.Task[Any]:
        task = self._event_loop.create_task(work)
        self._tasks[dispatcher.address] = task
        if carries_closures:
            self._closure_calls.add(task)
            if self._drained is not None:
                self._drained.clear()
        task.add_done_callback(lambda done: self._finished(dispatcher, done))
        return task

    def _finished(self, dispatcher: Dispatcher, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(dispatcher.address) is task:
            del self._tasks[dispatcher.address]
        self._closure_calls.discard(task)
        if self._round is not None and task in self._round:
            self._round.discard(task)
            if not self._round:
                self._round = None
                assert self._dense is not None
                self._dense.round_finished()
                self._event_loop.call_soon(self._assign)  # the next round, whatever became of this member
        if not self._closure_calls and self._drained is not None:
            self._drained.set()
        if task.cancelled() or self._stopped or dispatcher.address not in self._dispatchers:
            return
        if task.exception() is not None:
            log.error(
                "dispatcher of worker %d (%s) crashed", dispatcher.index, dispatcher.address, exc_info=task.exception()
            )
            return
        if dispatcher.state is WorkerState.DOWN:
            self._start(dispatcher, self._probe(dispatcher))
            return
        if dispatcher.state is WorkerState.UP:
            self._free.append(dispatcher)
            self._assign()

    async def _probe(self, dispatcher: Dispatcher) -> None:
        if not await dispatcher.probe():
            dispatcher.stop("it did not come back")
