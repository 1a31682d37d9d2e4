"""The raw-socket hot path, both halves: length-prefixed frames with limits checked before
anything is allocated, an authenticated handshake before anything is read, the server's
connection loop and the client's connections. It knows frames, never steps.

May import: ``protocol``, ``runtime``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.dataplane.dataplane_client import DataPlaneLinks
    from paramserve.psserver.dataplane.dataplane_server import DataPlaneServer
    from paramserve.psserver.dataplane.frames import TransportError

__all__ = [
    "DataPlaneLinks",
    "DataPlaneServer",
    "TransportError",
]

_HOMES = {
    "DataPlaneLinks": "dataplane_client",
    "DataPlaneServer": "dataplane_server",
    "TransportError": "frames",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
