"""The failure policy: pure functions that decide what to do when a closure's call fails.

No clocks, threads or I/O here: the dispatcher passes in what happened and
acts on the ``Decision``, logging its ``reason``. Failures are classified by
gRPC status code and by the structured fields of the worker's reply, never
by message text.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from paramserve.coordinator.errors import (
    ClosureError,
    OutOfRangeError,
    ParameterServerUnavailableError,
    WorkerRejectedError,
    WorkerUnavailableError,
)

__all__ = [
    "Action",
    "Decision",
    "FailurePolicy",
    "RETRYABLE_CODES",
    "decide_on_closure_error",
    "decide_on_rpc_failure",
    "probe_delay",
]


class Action(enum.Enum):
    RETRY_ELSEWHERE = "retry_elsewhere"
    """Put the closure back at the front of the queue; mark this worker DOWN and probe it."""
    RESEND = "resend"
    """Run the closure again on the same worker with what it lacks: per-worker resources' specs
    or the cluster context (it restarted). Not an attempt."""
    AWAIT_SERVER = "await_server"
    """A parameter server failed, not the worker or the closure: put the closure back (not an
    attempt) and have the server recovered (coordinator.ps_recovery) before it runs again."""
    RAISE = "raise"
    """The closure failed: its RemoteValue is ABORTED with ``error_type``."""
    REQUEUE = "requeue"
    """Hybrid training's dense group broke under the closure (a worker left mid-round): put it
    back (an attempt); the group forms anew before the next round runs it."""
    CANCEL = "cancel"
    """The coordinator had the closure cancelled on its worker (an earlier closure's error is
    being raised): put it back, and the queue cancels it while that error is pending."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    error_type: type[ClosureError] | None = None
    """For RAISE: the error class the closure's RemoteValue and join() raise."""


@dataclass(frozen=True)
class FailurePolicy:
    """How hard the coordinator tries before a closure fails (times in seconds)."""

    max_attempts: int = 10
    """RunClosure calls of one closure that may fail at the RPC level before it fails."""
    max_resource_resends: int = 3
    """Replies asking for resources again, per closure, before it fails."""
    closure_timeout: float = 600.0
    """Deadline of one RunClosure call (all its steps)."""
    probe_initial_backoff: float = 0.1
    probe_max_backoff: float = 5.0
    probe_jitter: float = 0.1
    probe_timeout: float = 2.0
    """Deadline of one health check of a DOWN worker."""
    probe_deadline: float | None = None
    """Give a DOWN worker up (STOPPED) after this long; None: wait for it forever, as TF does."""
    join_probe_interval: float = 0.1
    """How often a worker that joined (found by name, or added) and does not serve yet is probed:
    it gets its first closure within about this long after it serves. A worker that failed is
    probed with the backoff above instead (it may stay away for a long time)."""
    max_server_waits: int = 5
    """Times one closure may fail because of a parameter server and wait for its recovery
    before it fails with ParameterServerUnavailableError."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_resource_resends < 0 or self.max_server_waits < 0:
            raise ValueError("max_attempts must be >= 1, max_resource_resends and max_server_waits >= 0")
        positive = (
            self.closure_timeout,
            self.probe_initial_backoff,
            self.probe_max_backoff,
            self.probe_timeout,
            self.join_probe_interval,
        )
        if min(positive) <= 0 or self.probe_jitter < 0:
            raise ValueError("timeouts and backoffs must be positive, jitter >= 0")
        if self.probe_deadline is not None and self.probe_deadline <= 0:
            raise ValueError("probe_deadline must be positive or None")


RETRYABLE_CODES: frozenset[str] = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL", "ABORTED"})
"""Status codes of a RunClosure call that say "this worker failed", not "this closure is bad".
The worker reports errors of the user's code in its reply, so an error status
means the worker (process, network, transport) failed."""

_STOP_ITERATION_TYPES = frozenset({"builtins.StopIteration", "builtins.StopAsyncIteration"})


class ClosureErrorData(Protocol):
    """The fields of a worker's failure reply the policy reads (worker.results.ClosureFailure and
    the ClosureFailure proto fit)."""

    @property
    def type(self) -> str: ...

    @property
    def missing_resources(self) -> Collection[str]: ...

    @property
    def parameter_server(self) -> str: ...

    @property
    def needs_cluster(self) -> bool: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def group_failed(self) -> bool: ...


def decide_on_rpc_failure(code_name: str, attempt: int, policy: FailurePolicy) -> Decision:
    """What to do when a RunClosure call failed with status ``code_name``.

    ``attempt`` counts the calls of this closure that failed so far, this one
    included. Retryable codes retry elsewhere until ``policy.max_attempts``.
    """
    if code_name not in RETRYABLE_CODES:
        return Decision(
            Action.RAISE,
            f"the worker refused the call with {code_name}; retrying cannot help",
            WorkerRejectedError,
        )
    if attempt >= policy.max_attempts:
        return Decision(
            Action.RAISE,
            f"{code_name} on attempt {attempt} of {policy.max_attempts}: giving up",
            WorkerUnavailableError,
        )
    return Decision(
        Action.RETRY_ELSEWHERE,
        f"{code_name} on attempt {attempt} of {policy.max_attempts}: the worker is presumed down",
    )


def decide_on_closure_error(
    error: ClosureErrorData,
    *,
    resends: int,
    known_resources: Collection[str],
    policy: FailurePolicy,
    server_waits: int = 0,
    servers_recover: bool = False,
    restored_since_sent: bool = False,
    attempt: int = 1,
) -> Decision:
    """What to do when a worker ran the closure and replied with an error.

    ``resends`` counts earlier RESEND of this closure and ``server_waits`` its earlier
    AWAIT_SERVER; ``known_resources`` are the resource ids the coordinator can send;
    ``servers_recover``: failed parameter servers are recovered (else such a failure raises);
    ``restored_since_sent``: variables were restored after the closure was sent (a recovery
    finished while it ran), so a server failure it met may be the one already repaired;
    ``attempt``: the calls of this closure that failed so far, this one included.
    """
    if error.cancelled:
        return Decision(Action.CANCEL, "the coordinator cancelled it on the worker (an earlier closure failed)")
    if error.group_failed:
        if attempt >= policy.max_attempts:
            return Decision(
                Action.RAISE,
                f"the workers' dense group broke under it on attempt {attempt} of {policy.max_attempts}: giving up",
                WorkerUnavailableError,
            )
        return Decision(
            Action.REQUEUE,
            f"the workers' dense group broke under it (attempt {attempt} of {policy.max_attempts}): it runs again "
            "once the group is formed anew",
        )
    missing = list(error.missing_resources)
    if missing:
        return _decide_on_missing(missing, resends, known_resources, policy)
    if error.needs_cluster:
        if resends >= policy.max_resource_resends:
            return Decision(
                Action.RAISE, f"the worker still lacks the cluster context after {resends} resends", ClosureError
            )
        return Decision(Action.RESEND, "the worker does not hold the cluster context (it restarted?): resending it")
    if error.parameter_server:
        if servers_recover and restored_since_sent and resends < policy.max_resource_resends:
            return Decision(
                Action.RESEND,
                f"parameter server {error.parameter_server} failed under the cluster context this closure was sent "
                "with, and the variables were restored since: it runs again with the new one",
            )
        if servers_recover and server_waits < policy.max_server_waits:
            return Decision(
                Action.AWAIT_SERVER,
                f"parameter server {error.parameter_server} failed (wait {server_waits + 1} of "
                f"{policy.max_server_waits}): the closure runs again once it is recovered",
            )
        if servers_recover:
            return Decision(
                Action.RAISE,
                f"parameter server {error.parameter_server} still fails after {server_waits} recoveries",
                ParameterServerUnavailableError,
            )
        return Decision(
            Action.RAISE,
            f"parameter server {error.parameter_server} is unavailable; closures are not retried for it",
            ParameterServerUnavailableError,
        )
    if error.type in _STOP_ITERATION_TYPES:
        return Decision(Action.RAISE, f"{error.type} in the step: its input is exhausted", OutOfRangeError)
    return Decision(Action.RAISE, f"the closure raised {error.type or 'an exception'}", ClosureError)


def _decide_on_missing(missing: list[str], resends: int, known: Collection[str], policy: FailurePolicy) -> Decision:
    unknown = [r for r in missing if r not in known]
    if unknown:
        return Decision(
            Action.RAISE,
            f"the closure refers to resources {unknown} that this coordinator did not create",
            ClosureError,
        )
    if resends >= policy.max_resource_resends:
        return Decision(
            Action.RAISE,
            f"the worker still lacks resources {missing} after {resends} resends",
            ClosureError,
        )
    return Decision(
        Action.RESEND,
        f"the worker lacks resources {missing} (it restarted?): resending them",
    )


def probe_delay(policy: FailurePolicy, *, joining: bool, attempt: int) -> float:
    """Seconds before the next health check of a DOWN worker, after ``attempt`` (from 1) found it
    not serving, jitter aside. A worker that joined and does not serve yet is checked every
    ``join_probe_interval``: it gets closures within about that long after it serves. One that
    failed backs off exponentially to ``probe_max_backoff``: it may stay away a long time."""
    if joining:
        return policy.join_probe_interval
    return min(policy.probe_max_backoff, policy.probe_initial_backoff * 2 ** (attempt - 1))
