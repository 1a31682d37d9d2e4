"""Closures to workers: the closure queue, the dispatch loop and one dispatcher per worker, the
transport to workers, batching, the failure policy, worker discovery and the dense group's rounds.

May import: the coordinator's base (``errors``, ``nest``, ``cluster``, ``cluster_resolver``,
``remote_value``, ``metrics``). It declares what it reports (``observer``); telemetry implements it.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.dispatch.closures import Closure, ClosureQueue
    from paramserve.coordinator.dispatch.dense_rounds import DenseRounds
    from paramserve.coordinator.dispatch.discovery import DiscoveryPolicy
    from paramserve.coordinator.dispatch.dispatch_loop import DispatchLoop
    from paramserve.coordinator.dispatch.failures import FailurePolicy
    from paramserve.coordinator.dispatch.observer import CoordinatorObserver

__all__ = [
    "Closure",
    "ClosureQueue",
    "CoordinatorObserver",
    "DenseRounds",
    "DiscoveryPolicy",
    "DispatchLoop",
    "FailurePolicy",
]

_HOMES = {
    "Closure": "closures",
    "ClosureQueue": "closures",
    "CoordinatorObserver": "observer",
    "DenseRounds": "dense_rounds",
    "DiscoveryPolicy": "discovery",
    "DispatchLoop": "dispatch_loop",
    "FailurePolicy": "failures",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
