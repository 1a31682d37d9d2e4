"""Primary-backup replication of a shard group: a server's place in its group, the forwarding of
every acknowledged write to the backups, and the calls the coordinator makes to members.

May import: ``protocol``, ``runtime``, ``store``, ``dataplane``, ``client``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.replication.replica import Replica
    from paramserve.psserver.replication.replica_calls import MemberState, ReplicaCalls
    from paramserve.psserver.replication.replica_forwarder import GrpcForwarder

__all__ = [
    "GrpcForwarder",
    "MemberState",
    "Replica",
    "ReplicaCalls",
]

_HOMES = {
    "GrpcForwarder": "replica_forwarder",
    "MemberState": "replica_calls",
    "Replica": "replica",
    "ReplicaCalls": "replica_calls",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
