"""Hybrid training's dense group on a worker: the replicated dense layers all-reduced over a
torch.distributed gloo (or NCCL) group, and the authenticated rendezvous store it forms on
(the coordinator serves it: ``coordinator/dispatch/rendezvous_server.py`` speaks ``rendezvous_wire``).

May import: what ``worker/`` may (psserver's ``protocol``, ``dynamic``, ``runtime``, ``client``)
and the rest of ``worker/``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.worker.dense.group import DenseReplicas, DenseRound, GroupSpec
    from paramserve.worker.dense.rendezvous_store import RendezvousStore

__all__ = ["DenseReplicas", "DenseRound", "GroupSpec", "RendezvousStore"]

_HOMES = {
    "DenseReplicas": "group",
    "DenseRound": "group",
    "GroupSpec": "group",
    "RendezvousStore": "rendezvous_store",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
