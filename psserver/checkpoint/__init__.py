"""The on-disk format of a server's checkpoint, dense shards and growing tables (whole saves and
incremental chains), written atomically and restorable onto any partitioning.

May import: ``protocol``, ``dynamic``, ``runtime``, ``store``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.checkpoint.dynamic_chain import SaveDecision, SavedLink
    from paramserve.psserver.checkpoint.shard_files import Manifest

__all__ = [
    "Manifest",
    "SaveDecision",
    "SavedLink",
]

_HOMES = {
    "Manifest": "shard_files",
    "SaveDecision": "dynamic_chain",
    "SavedLink": "dynamic_chain",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
