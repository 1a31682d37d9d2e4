"""The one client of a cluster's parameter servers (workers and the coordinator use it): it places
variables through a partitioner, retries with tenacity under deadlines, and sends a step by the
best route (data plane, streams, unary) behind one interface.

May import: ``protocol``, ``dynamic``, ``runtime``, ``dataplane``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.client.calls import CallOptions
    from paramserve.psserver.client.probes import Prober
    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient

__all__ = [
    "CallOptions",
    "ClientConfig",
    "ParameterServerClient",
    "Prober",
]

_HOMES = {
    "CallOptions": "calls",
    "ClientConfig": "ps_client",
    "ParameterServerClient": "ps_client",
    "Prober": "probes",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
