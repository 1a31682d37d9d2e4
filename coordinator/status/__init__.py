"""Telemetry and the status page: the coordinator's metrics, the cluster's status as one snapshot,
its history, and the page that shows it (HTML and JSON).

May import: the coordinator's base, ``dispatch``, ``checkpointing``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.status.status_page import StatusPage
    from paramserve.coordinator.status.telemetry import CoordinatorTelemetry

__all__ = [
    "CoordinatorTelemetry",
    "StatusPage",
]

_HOMES = {
    "CoordinatorTelemetry": "telemetry",
    "StatusPage": "status_page",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
